"""The ``vllm`` inference engine: vLLM 0.24.0's ``AsyncLLM`` behind the Engine API.

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
(``vllm_layout.token_versions``). They are exact per token. New weights:
actor/engines/vllm/weights.py (``weights.update_mode=lock|pause``).

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
from actor.engines.vllm.worker.layout import token_versions
from pipeline import lora as lora_lib
from pipeline.config import VLLM_MISSING

log = logging.getLogger(__name__)
VLLM_VERSION = "0.24.0"


def load_vllm() -> SimpleNamespace:
    """The vLLM 0.24.0 classes the engine uses; a clear ValueError when absent."""
    try:
        import vllm
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as e:
        raise ValueError(VLLM_MISSING) from e
    if getattr(vllm, "__version__", "") != VLLM_VERSION:
        log.warning("vLLM %s found; this engine is written for %s", vllm.__version__, VLLM_VERSION)
    return SimpleNamespace(
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
        self.api = api or load_vllm()
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
            worker_extension_cls="actor.engines.vllm.worker.extension.NonstopWorkerExtension",
            **vllm_lora.engine_kwargs(lora),
        )
        self.llm = self._call(self._start(args), self.rpc_timeout_s * 5)
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
        """Run ``coro`` on the engine loop; wait at most ``timeout`` seconds."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=max(timeout, 0.001))
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"the vLLM engine did not answer within {timeout:.1f} s") from None

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
                try:
                    extra = {"lora_request": self.lora_request} if self.lora_request else {}
                    async for out in self.llm.generate(request, params, unit.ids[i], **extra):
                        unit.finals[i] = (out, salt_version)
                finally:
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

    def _collect(self, units: list[_Unit]) -> list[list[Completion]]:
        """The units' completions, with per-token versions from one poll of the workers."""
        for u in units:
            if u.error is not None:
                raise RuntimeError(f"vLLM request failed: {u.error}") from u.error
        ids = [rid for u in units for rid in u.ids]
        runs = self.rpc("nonstop_poll", ids, False)["versions"] if ids else {}
        return [
            [self._completion(f, runs.get(rid, [])) for rid, f in zip(u.ids, u.finals, strict=True)]
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
        return list(zip([u.key for u in units], self._collect(units), strict=True))

    @property
    def open_units(self) -> int:
        """Units submitted and not finished (running, or waiting for slots)."""
        return sum(not u.done.is_set() for u in list(self._open.values()))

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

    def _completion(self, final, runs: list[list[int]]) -> Completion:
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
        versions, exact = token_versions(runs, len(tokens))
        if not exact:
            log.warning("request %s: %d step versions for %d tokens", out.request_id,
                        sum(n for _, n in runs), len(tokens))  # fmt: skip
        if versions and getattr(out, "num_cached_tokens", 0) and salt_version >= 0:
            versions[0] = min(versions[0], salt_version)  # it read KV cached under that
        self.stats.tokens += len(tokens)
        return Completion(tokens, logprobs, versions, c.finish_reason == "stop")

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
        temperature=cfg.engine.temperature,
        top_p=cfg.engine.top_p,
        top_k=cfg.engine.top_k,
        settings=cfg.actor.vllm,
        dtype=pool_dtype(cfg, "actor"),
        seed=seed,
        update_mode=cfg.weights.update_mode,
        transfer_timeout_s=cfg.trainer.transfer_timeout_s,
        lora=cfg.model.get("lora"),
        lora_seed=cfg.run.seed,  # the trainer's adapter init; ``seed`` is this pool's
    )
