"""Requests for the ``vllm`` engine: submitting, slots, collecting, version stamps.

Streaming: the actor keeps enough groups open that ``in_flight`` requests are in the
engine all the time - while it scores and publishes a finished group, the next
group's requests already hold the freed slots - so the engine never idles between
groups (``generate`` is the batch form: sync mode, evaluation). Reads prompts (token
ids); writes completions with token ids, sampled-token log-probs
(``logprobs_mode=processed_logprobs``: temperature and top-k/top-p applied, the
distribution actually sampled from) and per-token versions.

Version stamps come from the workers, not from the client: at every engine step the
extension records, under the per-forward lock, the live version for each request
that step samples for (``StepVersions``); when a unit is collected the engine fetches
them for its request ids in one ``nonstop_poll`` and spreads them over the tokens
(:func:`token_versions`). They are exact per token when the worker recorded one step
per token; when it did not (records lost, a poll that failed) the stamps are a lower
bound (staleness over-, never understated: the oldest version the request can have
read) and the completion says so (``Completion.versions_exact=False``, carried to the
trainer as ``Sample.versions_exact``; counted in ``stats.inexact_stamps``).

Routes (``keep_routing``): fetched in the same poll (the worker's rows by position,
worker/routes.py) or read from vLLM's own output (CUDA), checked against prompt +
completion - 1 rows (:func:`request_routes`: cut or padded and inexact otherwise).

Prefix caching across a swap: every request carries ``cache_salt`` = the live
version and this engine's swap count, so a request submitted under version B never
hits a KV block first computed for a request submitted under A (vLLM's block hash
includes the salt in the first block; later blocks chain on it). Between asking for
a swap and its confirmation each request gets a salt of its own (no reuse at all).
A request submitted under A that the scheduler starts only after the swap may still
reuse A's blocks, like a sequence in flight keeps its KV cache; its first token is
then stamped A (``num_cached_tokens > 0``), so staleness is never understated.
``reset_prefix_cache`` is not used: vLLM refuses it while any request holds blocks.

:class:`VLLMRequests` is the client's half that makes and collects requests; the
engine (client.py) holds the state it works on (its event loop, the ``in_flight``
slots, the open units) and mixes it in.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from typing import Any

from actor.engines.base import Completion

log = logging.getLogger(__name__)


class VLLMRequests:
    """Generation and streaming for :class:`~actor.engines.vllm.client.VLLMEngine`."""

    # -- generation ------------------------------------------------------------------
    def _salt(self) -> tuple[str, int]:
        """(cache_salt, the version it stands for) for a request submitted now."""
        version = self.version if self.version is not None else -1
        if self._transition:
            return f"nonstop-x-{uuid.uuid4().hex}", version
        return f"nonstop-v{version}.{self._swaps_done}", version

    def _params(self, max_new_tokens: int):
        return self.api.SamplingParams(
            n=1,
            max_tokens=max_new_tokens,
            stop_token_ids=self.stop_ids,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=self.api.RequestOutputKind.FINAL_ONLY,
            **self.sampling,
        )

    def _start_unit(self, key, prompts: list[list[int]], max_new_tokens: int, stream: bool):
        """Submit ``prompts`` as one unit (a group, or a whole batch); each request waits
        for one of the ``in_flight`` slots, so a finished request is replaced at once."""
        unit = Unit(key, [self._ids.next() for _ in prompts], stream)
        params = self._params(max_new_tokens)

        def spawn() -> None:  # on the loop, so _abort (also on the loop, later) sees them
            unit.tasks = [self._loop.create_task(self._one(unit, i, p, params))
                          for i, p in enumerate(prompts)]  # fmt: skip

        self._loop.call_soon_threadsafe(spawn)
        return unit

    async def _one(self, unit: Unit, i: int, prompt: list[int], params) -> None:
        try:
            async with self._slots:
                salt, salt_version = self._salt()
                request = {"prompt_token_ids": list(prompt)}
                if self.prefix_caching:
                    request["cache_salt"] = salt
                if self.in_flight_now == 0:  # the engine had nothing since _empty_since
                    self._empty_s += time.monotonic() - self._empty_since
                self.in_flight_now += 1
                self.in_flight_peak = max(self.in_flight_peak, self.in_flight_now)
                ended = False
                try:
                    extra = {"lora_request": self.lora_request} if self.lora_request else {}
                    async for out in self.llm.generate(request, params, unit.ids[i], **extra):
                        unit.finals[i] = (out, salt_version)
                    ended = True
                    reason = _finish_reason(unit.finals[i])
                    if reason in FAILED_FINISH:  # not a completion: never trained on
                        raise RuntimeError(
                            f"vLLM ended request {unit.ids[i]} with finish_reason={reason}"
                        )
                finally:
                    if not ended:  # cancelled or failed: make sure it left the engine
                        await self._abort_request(unit.ids[i])
                    self.in_flight_now -= 1
                    if self.in_flight_now == 0:
                        self._empty_since = time.monotonic()
        except asyncio.CancelledError:
            unit.cancelled = True
            raise
        except Exception as e:  # raised to the actor when the unit is collected
            unit.error = unit.error or e
        finally:
            unit.left -= 1
            if unit.left == 0:
                unit.done.set()
                if unit.stream and not unit.cancelled:
                    self._finished.put(unit)

    async def _abort_request(self, request_id: str) -> None:
        """Abort ``request_id`` (our external id: every internal id vLLM made for it) in
        the output processor and the engine core. ``AsyncLLM.generate`` aborts a request
        cancelled while it waits for outputs, but not one cancelled inside
        ``add_request`` (its output queue does not exist yet), which vLLM has already
        registered and sent to the engine core: that one would run to its end, past
        ``in_flight``. Aborting a request vLLM has already dropped does nothing."""
        await self.llm.abort(request_id)

    def _collect(self, units: list[Unit]) -> list[list[Completion]]:
        """The units' completions, with per-token versions from one poll of the workers.
        A unit whose request failed raises; a poll that fails leaves the stamps inexact
        (each completion says so) unless the engine is dead (then it raises)."""
        for u in units:
            if u.error is not None:
                raise RuntimeError(f"vLLM request failed: {u.error}") from u.error
        ids = [rid for u in units for rid in u.ids]
        runs: dict = {}
        routes: dict = {}
        preempted = 0
        if ids:
            try:
                poll = self.rpc("nonstop_poll", ids, False)
                runs, routes = poll["versions"], poll.get("routes") or {}
                preempted = (poll.get("preemption") or {}).get("preempted", 0)
            except Exception as e:
                if self.llm.errored:
                    raise
                log.error(
                    "the vLLM workers' step versions for %d requests could not be read (%s); "
                    "their tokens carry inexact (oldest possible) versions",
                    len(ids),
                    e,
                )
        return [
            [
                self._completion(f, runs.get(rid), routes.get(rid), preempted)
                for rid, f in zip(u.ids, u.finals, strict=True)
            ]
            for u in units
        ]

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, should_stop=lambda: False
    ) -> list[Completion]:
        """One batch, all of it (sync mode, eval): returns when every prompt is done."""
        unit = self._start_unit(None, prompts, max_new_tokens, stream=False)
        while not unit.done.wait(0.1):
            if should_stop():
                self._abort([unit])
                break
        return self._collect([unit])[0]

    # -- streaming (pipeline.mode=async: actor/stream.py) ---------------------------
    streaming = True

    def submit(self, key, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Start one unit (a group's G prompts); :meth:`take` hands it back when all of
        its requests are done. Requests of later units wait for slots, so the engine
        always has ``in_flight`` requests while units are open."""
        self._open[key] = self._start_unit(key, prompts, max_new_tokens, stream=True)

    def take(self, timeout: float) -> list[tuple[Any, list[Completion]]]:
        """Finished units (key, completions), waiting at most ``timeout`` s for the first."""
        try:
            units = [self._finished.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                units.append(self._finished.get_nowait())
            except queue.Empty:
                break
        for u in units:
            self._open.pop(u.key, None)
        good = []
        for u in units:  # a failed request fails its own unit only
            if u.error is None:
                good.append(u)
                continue
            if self.llm.errored:  # every request fails from now on: the actor restarts
                raise RuntimeError(f"the vLLM engine died: {u.error}") from u.error
            self.units_failed += 1
            log.error("vLLM request of unit %s failed, unit dropped: %s", u.key, u.error)
        return list(zip([u.key for u in good], self._collect(good), strict=True))

    @property
    def open_units(self) -> int:
        """Units submitted and not finished (running, or waiting for slots)."""
        return sum(not u.done.is_set() for u in list(self._open.values()))

    def held_keys(self) -> set:
        """The keys of the units submitted and not taken yet (a unit take() dropped as
        failed is no longer held: the episode loop ends its episode)."""
        return set(self._open)

    @property
    def held_units(self) -> int:
        """Units submitted and not taken yet: open, or finished and waiting for take()
        (a unit take() drops as failed is no longer held)."""
        return len(self._open)

    def empty_s(self) -> float:
        """Seconds, since the engine started, with no request of this actor in it."""
        now = time.monotonic()
        return self._empty_s + (0.0 if self.in_flight_now else now - self._empty_since)

    def abort_open(self) -> int:
        """Abort every open unit (stopping): its requests leave the engine; returns how
        many units were dropped (never published: a half group is not a group)."""
        units = list(self._open.values())
        self._open.clear()
        self._abort(units)
        return len(units)

    def _abort(self, units: list[Unit]) -> None:
        """Cancel the units' requests and wait until they have left (AsyncLLM.generate
        aborts a cancelled request in the engine). A request not started yet never
        runs; its completion comes back empty."""

        async def cancel() -> None:
            tasks = [t for u in units for t in u.tasks]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._call(cancel(), self.rpc_timeout_s)

    def _completion(
        self, final, runs: list[list[int]] | None, routes: dict | None = None, preempted: int = 0
    ):
        """``runs``: the worker's step versions for the request (None: not read);
        ``routes`` (keep_routing): its rows from the worker (worker/routes.py);
        ``preempted``: the engine's preemptions so far (vLLM's own routes: inexact across
        a swap once any happened)."""
        if final is None:  # stopped before it was submitted
            return Completion([], [], [], False)
        out, salt_version = final
        c = out.outputs[0]
        tokens = list(c.token_ids)
        logprobs = [
            float(step[t].logprob) for step, t in zip(c.logprobs or [], tokens, strict=False)
        ]
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(tokens)} tokens")
        versions, exact = token_versions(runs or [], len(tokens), salt_version)
        if not exact:
            self.stats.inexact_stamps += 1
            log.warning(
                "request %s: %s step versions for %d tokens; stamped with lower bounds "
                "(versions_exact=False)",
                out.request_id,
                "no" if runs is None else sum(n for _, n in runs),
                len(tokens),
            )
        if versions and getattr(out, "num_cached_tokens", 0) and salt_version >= 0:
            versions[0] = min(versions[0], salt_version)  # it read KV cached under that
        self.stats.tokens += len(tokens)
        done = Completion(
            tokens, logprobs, versions, c.finish_reason == "stop", versions_exact=exact
        )
        if getattr(self, "keep_routing", False) and tokens:
            prompt = len(out.prompt_token_ids or ())
            if self.routes_via == "vllm":
                routes = native_request_routes(
                    getattr(c, "routed_experts", None),
                    self.moe_layers,
                    exact and (len(set(versions)) == 1 or preempted == 0),
                )
            done.routes, done.routes_exact = request_routes(
                routes, prompt + len(tokens) - 1, self.route_layout, out.request_id
            )
        return done


def request_routes(got: dict | None, rows: int, layout: list[int], request_id: str):
    """(routes [rows, layers, k], exact) from the worker's answer for one request: its
    rows by position (prompt + sampled tokens but the last). Fewer or more rows than
    that (records lost, a poll that failed) are cut or padded with expert 0 and marked
    inexact, with a warning; nothing at all: zeros, inexact."""
    import numpy as np

    layers, k, experts = layout
    dtype = np.dtype(np.uint8 if experts <= 256 else "<u2")
    if not got:
        log.warning("request %s: no routes from the worker (routes_exact=False)", request_id)
        return np.zeros((rows, layers, k), dtype=dtype), False
    data = got["rows"]
    if isinstance(data, bytes):
        have = np.frombuffer(data, dtype=dtype).reshape(got["shape"])
    else:  # vLLM's own (native_request_routes)
        have = np.asarray(data).astype(dtype)
    exact = bool(got["exact"])
    if len(have) != rows:
        log.warning(
            "request %s: %d route rows for %d fed-forward tokens (routes_exact=False)",
            request_id,
            len(have),
            rows,
        )
        fixed = np.zeros((rows, layers, k), dtype=dtype)
        fixed[: min(rows, len(have))] = have[:rows]
        return fixed, False
    return have.copy(), exact


def native_request_routes(got, moe_layers: list[int], exact: bool) -> dict | None:
    """vLLM's own routed experts of one request (``CompletionOutput.routed_experts``,
    ``[tokens, every decoder layer, k]``, with ``enable_return_routed_experts``) in the
    worker's form: the MoE layers' columns, ids ascending per row. ``exact``: vLLM's
    capture knows nothing of swaps or preemption, so the caller says (the request's
    stamps are exact, and it ran on one version or no preemption happened)."""
    import numpy as np

    if got is None:
        return None
    rows = np.sort(np.asarray(got)[:, moe_layers], axis=-1)
    return {"rows": rows, "shape": list(rows.shape), "exact": exact}


FAILED_FINISH = ("abort", "error")  # vLLM's FinishReason: the request did not complete


def _finish_reason(final) -> str | None:
    if final is None or not final[0].outputs:
        return None
    reason = final[0].outputs[0].finish_reason
    return None if reason is None else str(reason)


class Unit:
    """Requests submitted together and handed back together (a group, or a batch)."""

    def __init__(self, key: Any, ids: list[str], stream: bool):
        self.key, self.ids, self.stream = key, ids, stream
        self.finals: list = [None] * len(ids)  # (final RequestOutput, salt version)
        self.left, self.error, self.cancelled = len(ids), None, False
        self.done = threading.Event()
        self.tasks: list[asyncio.Task] = []  # created on the engine loop


class RequestIds:
    """Request ids ``<prefix>-<n>``: unique per engine, never ending in 8 characters
    after a dash (vLLM appends ``-<8 random>`` to make its internal id)."""

    def __init__(self, prefix: str):
        self.prefix, self.n, self.lock = prefix, 0, threading.Lock()

    def next(self) -> str:
        with self.lock:
            self.n += 1
            return f"nonstop{self.prefix}-{self.n}"


def token_versions(
    step_versions: list[list[int]], n_tokens: int, floor: int = -1
) -> tuple[list[int], bool]:
    """Per-token versions from a request's run-length ``[[version, steps], ...]`` of
    the engine steps that sampled a token for it (recorded by the worker extension).

    Returns (versions, exact); ``exact`` when there is one step per token (the rule with
    async scheduling off). Otherwise the stamps are lower bounds, so staleness is over-,
    never understated: with more steps than tokens the first ``n_tokens`` steps (an
    extra step comes at the end: a request scheduled once more after its last token);
    with fewer, the missing earliest tokens get the oldest version the request can have
    read: the smaller of its first recorded step and ``floor`` (the live version when it
    was submitted; < 0: unknown); with neither, 0.
    """
    flat = [v for v, n in step_versions for _ in range(n)]
    if len(flat) == n_tokens:
        return flat, True
    if len(flat) > n_tokens:
        return flat[:n_tokens], False
    known = [v for v in (floor, flat[0] if flat else -1) if v >= 0]
    pad = min(known) if known else 0
    return [pad] * (n_tokens - len(flat)) + flat, False
