"""The ``vllm`` inference engine: vLLM 0.24.0's ``AsyncLLM`` behind the sync Engine API.

::

    actor thread (sync)              engine loop thread (asyncio)      engine-core process
    generate(prompts)  ------------> up to actor.vllm.in_flight  ----> scheduler + GPU Worker
      waits, calls should_stop()     AsyncLLM.generate() at once;      with NonstopWorkerExtension
                                     each one that finishes is         (actor/vllm_worker.py):
                                     replaced by the next prompt       per-forward lock, staging,
    stage / swap (receiver thread) -> collective_rpc("nonstop_*")  --> per-step versions

Reads: prompts (token ids) from the actor, new weights through the worker's own
transfer channel (:meth:`VLLMEngine.remote_receiver` is the actor-side handle the
WeightReceiver joins with). Writes: completions with token ids, sampled-token
log-probs (``logprobs_mode=processed_logprobs``: temperature and top-k/top-p
applied, the distribution actually sampled from) and per-token versions. Blocks:
generate() until its prompts are done; swap() until the worker confirms.

Version stamps come from the worker, not from the client: at every engine step the
extension records, under the per-forward lock, the live version for each request
that step samples for (``StepVersions``); after a batch the engine fetches them for
its request ids in one ``nonstop_poll`` and spreads them over the tokens
(``vllm_layout.token_versions``). They are exact per token.

``weights.update_mode``: ``lock`` stages in the engine-core process while it
generates and swaps under the per-forward lock (a background thread of the worker
waits for it, at most ``actor.vllm.lock_timeout_s``; a timeout fails the update
and the old version keeps generating); ``pause`` is vLLM's own way, the baseline:
``pause_generation(mode="keep", clear_cache=False)``, the same swap on the engine
thread, ``resume_generation()``.

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
every request carries its ``LoRARequest``, and each version is an adapter: announced
``kind="lora"``, staged and swapped by the worker under the same lock, deadline and
version stamps (``AdapterSwap``); the base weights are never copied or written. An
announcement of the other kind is refused with a message naming ``model.lora``.

vLLM is imported lazily (:func:`load_vllm`); only tensor_parallel_size=1 is built.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from types import SimpleNamespace
from typing import Any

import torch

from actor.engines import vllm_lora
from actor.engines.base import Completion, Engine, EngineStats
from actor.vllm_layout import token_versions
from pipeline import lora as lora_lib
from pipeline.config import VLLM_MISSING
from pipeline.messages import WeightAnnouncement, encode
from pipeline.transfer import BucketSource, ReceiverSource

log = logging.getLogger(__name__)
VLLM_VERSION = "0.24.0"
POLL_S = 0.01  # between polls of the worker while an update runs


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


class EngineChannel:
    """The actor-side handle of the worker's transfer channel: the WeightReceiver joins
    through Redis as usual and calls connect(), which opens ``weights.transport`` in
    the engine-core process; buckets then land there, never in this process."""

    device = torch.device("cpu")

    def __init__(self, engine: VLLMEngine, transport: str):
        self.engine, self.name = engine, transport

    def connect(self, rendezvous: dict[str, str], nonce: str, deadline: float) -> None:
        self.engine.rpc(
            "nonstop_connect", self.name, rendezvous, nonce, timeout=deadline - time.monotonic()
        )

    def begin(self, version: int, buckets: int, deadline: float) -> None:
        self.receive([], deadline)

    def receive(self, buckets: list[torch.Tensor], deadline: float) -> None:
        raise RuntimeError("the vLLM engine receives in its own process; use engine.stage()")

    def finish(self, error: str | None) -> None:
        pass  # the worker's own channel acknowledges the version

    def close(self) -> None:
        if not self.engine.closed:
            self.engine.rpc("nonstop_disconnect")


class VLLMEngine(Engine):
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
            worker_extension_cls="actor.vllm_worker.NonstopWorkerExtension",
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
        """``collective_rpc`` into the worker extension with a deadline; the first
        worker's answer (tensor_parallel_size is 1)."""
        limit = self.rpc_timeout_s if timeout is None else timeout
        return self._call(self.llm.collective_rpc(method, timeout=limit, args=args), limit + 5)[0]

    def remote_receiver(self, transport: str) -> EngineChannel:
        """The Receiver handle the actor's WeightReceiver joins with (``receiver=``)."""
        return EngineChannel(self, transport)

    # -- generation ------------------------------------------------------------------
    def _salt(self) -> tuple[str, int]:
        """(cache_salt, the version it stands for) for a request submitted now."""
        version = self.version if self.version is not None else -1
        if self._transition:
            return f"nonstop-x-{uuid.uuid4().hex}", version
        return f"nonstop-v{version}.{self._swaps_done}", version

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, should_stop=lambda: False
    ) -> list[Completion]:
        params = self.api.SamplingParams(
            n=1,
            max_tokens=max_new_tokens,
            stop_token_ids=self.stop_ids,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=self.api.RequestOutputKind.FINAL_ONLY,
            **self.sampling,
        )
        ids = [self._ids.next() for _ in prompts]
        stop = threading.Event()
        future = asyncio.run_coroutine_threadsafe(
            self._batch(prompts, params, ids, stop), self._loop
        )
        while True:
            try:
                finals = future.result(timeout=0.1)
                break
            except FutureTimeout:
                if should_stop():
                    stop.set()
        runs = self.rpc("nonstop_poll", ids, False)["versions"] if ids else {}
        return [self._completion(f, runs.get(rid, [])) for rid, f in zip(ids, finals, strict=True)]

    async def _batch(self, prompts, params, ids, stop: threading.Event):
        """Every prompt through AsyncLLM.generate, at most ``in_flight`` at once."""
        slots = asyncio.Semaphore(int(self.settings.in_flight))
        finals: list = [None] * len(prompts)

        async def one(i: int) -> None:
            async with slots:
                if stop.is_set():
                    return
                salt, salt_version = self._salt()
                prompt = {"prompt_token_ids": list(prompts[i])}
                if self.settings.enable_prefix_caching:
                    prompt["cache_salt"] = salt
                self.in_flight_now += 1
                self.in_flight_peak = max(self.in_flight_peak, self.in_flight_now)
                try:
                    extra = {"lora_request": self.lora_request} if self.lora_request else {}
                    async for out in self.llm.generate(prompt, params, ids[i], **extra):
                        finals[i] = (out, salt_version)
                        if stop.is_set():
                            break
                finally:
                    self.in_flight_now -= 1

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.1)
            if stop.is_set():
                for t in tasks:
                    t.cancel()  # generate() aborts the request in the engine
                await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return finals

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

    # -- weights ---------------------------------------------------------------------
    def _wait_worker(self, done, what: str, failed_before: int, deadline: float) -> dict:
        """Poll the worker until ``done(status)``; raise on a new failure or the deadline.
        The returned status holds every swap record taken on the way."""
        swaps: list[dict] = []
        while True:
            status = self.rpc("nonstop_poll", [])
            swaps += status["swaps"]
            status["swaps"] = swaps
            if status["failed"] > failed_before:
                raise RuntimeError(f"{what} failed in the vLLM worker: {status['last_error']}")
            if done(status):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: the vLLM worker did not finish in time")
            time.sleep(POLL_S)

    def stage(self, ann: WeightAnnouncement, source: BucketSource, deadline: float) -> None:
        """The worker receives into its staging copy while generation goes on: over its
        own channel when ``source`` reads from :meth:`remote_receiver`'s handle, else
        the buckets are read here and sent along (tests, benchmarks, small models)."""
        if ann.kind != self.kind:
            lora = "with" if self.kind == lora_lib.KIND_LORA else "without"
            raise ValueError(
                f"the trainer publishes {ann.kind!r} weights but this vLLM engine was started "
                f"{lora} model.lora and takes {self.kind!r} ones; give every pool the same "
                "model.lora settings"
            )
        if isinstance(source, ReceiverSource) and isinstance(source.receiver, EngineChannel):
            spec = None
        else:
            buckets = []
            for i, b in enumerate(ann.buckets):
                buf = torch.empty(b.numel, dtype=getattr(torch, ann.dtype))
                source.fetch(i, buf, deadline)
                buckets.append(buf)
            spec = {"factory": "pipeline.transfer:TensorSource", "buckets": buckets}
        failed = self.rpc("nonstop_poll", [], False)["failed"]
        self.rpc("nonstop_update", encode(ann), spec, False)
        self._wait_worker(
            lambda s: s["busy"] == 0 and s["staged_version"] == ann.version,
            f"staging version {ann.version}",
            failed,
            deadline,
        )

    def swap(self, version: int) -> None:
        """Install the staged ``version``: under the per-forward lock (lock) or with the
        engine paused (pause). On failure the old version keeps generating."""
        failed = self.rpc("nonstop_poll", [], False)["failed"]
        self._transition = True
        try:
            if self.update_mode == "pause":
                self._swap_paused(version)
            else:
                self.rpc("nonstop_swap", version)
                deadline = time.monotonic() + float(self.settings.lock_timeout_s) + 30
                status = self._wait_worker(
                    lambda s: s["busy"] == 0 and s["live_version"] == version,
                    f"swap to version {version}",
                    failed,
                    deadline,
                )
                for rec in status["swaps"]:  # the lock hold, as the worker measured it
                    t0 = time.perf_counter() - rec["hold_ms"] / 1000
                    self.stats.add_swap(t0, rec["version"], "staged")
            self.version = version
            self._swaps_done += 1
            self.stats.version_times.append(time.perf_counter())
        finally:
            self._transition = False

    def _swap_paused(self, version: int) -> None:
        t0 = time.perf_counter()  # the whole pause is the stall
        try:
            self._call(
                self.llm.pause_generation(mode="keep", clear_cache=False), self.rpc_timeout_s
            )
            self.rpc("nonstop_swap_paused", version)
        finally:
            self._call(self.llm.resume_generation(), self.rpc_timeout_s)
            self.rpc("nonstop_poll", [])  # drop the worker's swap record: counted here
        self.stats.add_swap(t0, version, "pause")

    def update_in_place(
        self, ann: WeightAnnouncement, source: BucketSource, deadline: float
    ) -> None:
        raise ValueError(
            "engine.weight_staging=false is for actor.engine=hf; the vllm engine always "
            "receives into a staging copy (set engine.weight_staging=true)"
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
