"""Per-request weight versions of the engine steps that sampled each token.

Under the per-forward-pass lock, the locked ``execute_model``
(actor/engines/vllm/worker/locked.py, ``LockedWeights.wrap``) records here the live
version for every request a step samples for; the engine fetches them through the worker
extension's ``nonstop_poll`` (actor/engines/vllm/worker/extension.py) when a request is
collected (actor/engines/vllm/requests.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


def external_id(internal: str) -> str:
    """vLLM appends ``-<8 random chars>`` to the client's request id."""
    head, _, tail = internal.rpartition("-")
    return head if head and len(tail) == 8 else internal


class StepVersions:
    """Per request, run-length versions of the engine steps that sampled a token for it.

    A step samples for a request unless it is a prefill chunk that does not reach
    the end of the request's known tokens (prompt + tokens sampled so far). No
    speculative decoding: the vLLM engine refuses it (one token per decode step).

    Every scheduler output must be recorded, including vLLM's steps with no tokens
    scheduled (``execute_model`` is called with zero tokens to tell the workers which
    requests finished): a finished request's runs leave ``rle`` there. The client
    polls a request once, right after its final output, which is usually before the
    step that says it finished: :meth:`take` then hands over a copy and marks the
    request, and its runs are dropped when it finishes. Runs of requests that finish
    without being taken (aborted ones) wait in ``finished``, the oldest evicted past
    ``keep_finished``. Every look-up is by key (``ext``: external -> internal id).

    Preemption: model runner V1 gets a resumed request among the cached ones
    (``resumed_req_ids``) and its count stands. Model runner V2 (the default for Llama
    and Qwen on CUDA from 0.24, for every model from 0.32) gets it re-sent as a new
    request whose ``prefill_token_ids`` hold the prompt *and* every token sampled so
    far: its count starts from those, so the recompute chunks are not taken for
    sampled steps (they were, counted from the prompt: stamps went inexact).
    ``preempted`` / ``resumed`` count what the scheduler outputs said (the poll's
    ``preemption``).
    """

    def __init__(self, keep_finished: int = 65536):
        self.known: dict[str, int] = {}  # internal id -> prompt + sampled tokens
        self.rle: dict[str, list[list[int]]] = {}  # internal id -> runs (running)
        self.ext: dict[str, str] = {}  # external id -> internal id (running)
        self.taken: set[str] = set()  # running, handed over: dropped when finished
        self.finished: OrderedDict[str, list[list[int]]] = OrderedDict()  # external id
        self.keep_finished, self.evicted = keep_finished, 0
        self.preempted = self.resumed = 0

    def record(self, so: Any, version: int) -> None:
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            # V2 re-sends a preempted request as new: prefill_token_ids = prompt + sampled
            tokens = getattr(new, "prefill_token_ids", None) or new.prompt_token_ids or ()
            if new.req_id in self.known:
                self.resumed += 1
            self.known[new.req_id] = len(tokens)
            self.ext[external_id(new.req_id)] = new.req_id
            computed[new.req_id] = new.num_computed_tokens
        self.preempted += len(getattr(so, "preempted_req_ids", None) or ())
        cached = so.scheduled_cached_reqs
        self.resumed += len(getattr(cached, "resumed_req_ids", None) or ())
        for rid, done in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
            computed[rid] = done
        for rid, n in so.num_scheduled_tokens.items():
            known = self.known.get(rid)
            if n == 1 or known is None or computed.get(rid, 0) + n >= known:
                self.known[rid] = (known or 0) + 1
                runs = self.rle.get(rid)
                if runs is None:
                    runs = self.rle[rid] = []
                    self.ext[external_id(rid)] = rid
                if runs and runs[-1][0] == version:
                    runs[-1][1] += 1
                else:
                    runs.append([version, 1])
        for rid in so.finished_req_ids:
            seen = self.known.pop(rid, None) is not None
            runs = self.rle.pop(rid, None)
            ext = external_id(rid)
            if self.ext.get(ext) == rid:
                del self.ext[ext]
            if rid in self.taken:
                self.taken.discard(rid)
            elif seen or runs is not None:
                self.finished[ext] = runs or []
        while len(self.finished) > self.keep_finished:
            self.finished.popitem(last=False)
            self.evicted += 1

    def take(self, ids: list[str]) -> dict[str, list[list[int]]]:
        """Finished requests' runs (removed), or a running request's runs so far (a
        copy; the request's runs are dropped when it finishes)."""
        out = {}
        for ext in ids:
            if ext in self.finished:
                out[ext] = self.finished.pop(ext)
                continue
            rid = self.ext.get(ext)
            if rid is not None and rid in self.rle:
                out[ext] = [list(r) for r in self.rle[rid]]
                self.taken.add(rid)
        return out

    def sizes(self) -> dict[str, int]:
        """How many requests are held, per table (a leak shows here)."""
        return {
            "running": len(self.rle),
            "ids": len(self.ext),
            "taken": len(self.taken),
            "finished": len(self.finished),
            "evicted": self.evicted,
        }
