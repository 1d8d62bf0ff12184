"""A fake of vLLM 0.24.0's AsyncLLM for CPU tests of actor/engines/vllm/client.py.

Written from the 0.24.0 wheel's source: the same method names and signatures
(``AsyncLLM.from_engine_args``, ``generate``, ``collective_rpc``,
``pause_generation(mode=..., clear_cache=...)``, ``resume_generation``,
``reset_prefix_cache``, ``abort``, ``shutdown``), request ids made internal as
``<id>-<8 chars>`` (input_processor.assign_request_id), FINAL_ONLY outputs with
``token_ids``, ``logprobs`` (``[{token: Logprob}]``), ``finish_reason`` and
``num_cached_tokens``. An "engine core" thread steps like EngineCore with
UniProcExecutor: utility calls (collective_rpc, pause) are served between steps, and
each step calls the worker's ``execute_model`` then ``sample_tokens`` on a fake
Worker that mixes in the real worker extension (``worker_extension_cls``) the way
vLLM 0.32 does (:func:`inject_extension`: appended to the Worker's bases after a
check that no attribute clashes), so the real lock, staging, swap and StepVersions
run. Outputs reach the asyncio loop from that thread.

Prefix caching is keyed like vLLM's (v1/core/kv_cache_utils.py: ``hash_block_tokens``
hashes (parent hash, block tokens, extra keys) and ``generate_block_hash_extra_keys``
puts ``cache_salt`` into the first block's extra keys only); each cached block
remembers the weight version it was computed under.

LoRA (``enable_lora``): like vLLM's LRUCacheWorkerLoRAManager (lora/worker_manager.py)
and LoRAModelManager (lora/model_manager.py), each step's ``execute_model`` activates the
adapters its requests carry, loading one from its ``lora_path`` only if its id is not
registered yet; ``activate_adapter`` copies an adapter into a GPU slot allocated once
(``set_lora``: the slot tensors keep their addresses). The step's "weights" include the
slot, so tokens change with the adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace

import torch

BLOCK = 4  # tokens per KV block


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


@dataclass
class AsyncEngineArgs:
    model: str = ""
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    seed: int = 0
    gpu_memory_utilization: float = 0.92
    max_num_seqs: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    logprobs_mode: str = "raw_logprobs"
    async_scheduling: bool | None = None
    worker_extension_cls: str = ""
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    extra: dict = field(default_factory=dict)


def block_hash(parent, tokens, extra_keys):
    """vLLM's hash_block_tokens keying: (parent or NONE_HASH, tokens, extra keys)."""
    return hash((parent if parent else "NONE_HASH", tuple(tokens), extra_keys))


@dataclass(frozen=True)
class LoRARequest:
    """vllm.lora.request.LoRARequest's fields that the engine and worker use (hashable,
    as vLLM's: the model runner keeps sets of them)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


class Req:
    def __init__(self, rid, prompt, params, salt, out_q, loop, lora_request=None):
        self.rid, self.prompt, self.params, self.salt = rid, prompt, params, salt
        self.lora_request = lora_request
        self.out_q, self.loop = out_q, loop
        self.tokens, self.logprobs, self.versions = [], [], []
        self.cached_tokens, self.started = 0, False
        self.hashes: list = []

    def all_tokens(self):
        return self.prompt + self.tokens


class FakeCore:
    """The engine-core thread: a scheduler, a prefix cache, the worker."""

    forced_reasons: dict[int, str] = {}  # a prompt's first token -> its finish_reason

    def __init__(self, worker, max_num_seqs, caching, step_s):
        self.worker, self.max_num_seqs, self.caching, self.step_s = (
            worker,
            max_num_seqs,
            caching,
            step_s,
        )
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.finished_ids: set[str] = set()
        self.cache: dict = {}  # block hash -> version it was computed under
        self.hits: list[tuple[str, int]] = []  # (salt, version of the block hit)
        self.active_log: list[tuple[int, int]] = []  # (running, waiting) per step
        self.calls: list[str] = []
        self.truth: dict[str, list[int]] = {}  # request id -> version of each token's step
        self.inbox: queue.Queue = queue.Queue()
        self.paused = False
        self.stopped = False
        self.empty_spins = 0  # loop turns with no request to run, after the first step
        self.empty_gaps = 0  # times the engine ran dry after a step (a run of empty spins)
        self._dry = False
        self.flushes = 0  # zero-token steps (finished ids only)
        self.thread = threading.Thread(target=self.run, name="fake-engine-core", daemon=True)
        self.thread.start()

    def run(self):
        while not self.stopped:
            try:
                while True:
                    fn, fut = self.inbox.get_nowait()
                    try:
                        result, error = fn(), None
                    except Exception as e:
                        result, error = None, e
                    with contextlib.suppress(InvalidStateError):  # the caller was cancelled
                        fut.set_exception(error) if error else fut.set_result(result)
            except queue.Empty:
                pass
            if not self.paused and not (self.waiting or self.running) and self.finished_ids:
                self.flush()  # as EngineCore: has_requests() counts finished ids
                continue
            if self.paused or not (self.waiting or self.running):
                if self.active_log and not self.paused:
                    self.empty_spins += 1  # nothing to run after the first step
                    self.empty_gaps += not self._dry
                    self._dry = True
                time.sleep(0.001)
                continue
            try:
                self.step()
            except Exception as e:  # as EngineCore dies: every request gets the error
                for r in self.waiting + self.running:
                    r.loop.call_soon_threadsafe(r.out_q.put_nowait, e)
                self.waiting, self.running = [], []

    def utility(self, fn) -> Future:
        fut: Future = Future()
        self.inbox.put((fn, fut))
        return fut

    def _lookup(self, req: Req) -> int:
        """Hash the prompt's full blocks like vLLM; count the cached prefix."""
        parent, hit = None, 0
        prompt = req.prompt
        for start in range(0, len(prompt) - len(prompt) % BLOCK, BLOCK):
            extra = (req.salt,) if (start == 0 and req.salt) else None
            h = block_hash(parent, prompt[start : start + BLOCK], extra)
            req.hashes.append(h)
            if hit == start and h in self.cache and start + BLOCK < len(prompt):
                self.hits.append((req.salt, self.cache[h]))
                hit += BLOCK
            parent = h
        return hit

    def flush(self):
        """A step with no tokens scheduled that only tells the workers which requests
        finished (vLLM's scheduler does this when nothing else runs; the model runner
        returns an empty output at once and sample_tokens is not called)."""
        so = SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            finished_req_ids=set(self.finished_ids),
        )
        self.finished_ids.clear()
        self.flushes += 1
        assert self.worker.execute_model(so) is not None, "a zero-token step samples nothing"

    def step(self):
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.pop(0)
            req.cached_tokens = self._lookup(req) if self.caching else 0
            self.running.append(req)
        self.active_log.append((len(self.running), len(self.waiting)))
        self._dry = False
        new = [r for r in self.running if not r.started]
        old = [r for r in self.running if r.started]
        so = SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(
                    req_id=r.rid,
                    prompt_token_ids=r.prompt,
                    num_computed_tokens=r.cached_tokens,
                    lora_request=r.lora_request,
                )
                for r in new
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r.rid for r in old],
                num_computed_tokens=[len(r.all_tokens()) - 1 for r in old],
            ),
            num_scheduled_tokens={
                **{r.rid: len(r.prompt) - r.cached_tokens for r in new},
                **{r.rid: 1 for r in old},
            },
            finished_req_ids=set(self.finished_ids),
        )
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        self.finished_ids.clear()
        self.worker.execute_model(so)
        weights, version = self.worker.sample_tokens(None)
        for r in new:
            r.started = True
            for h in r.hashes:  # the prompt's blocks, computed by this step
                self.cache.setdefault(h, version)
        for r in list(self.running):
            lp = -((weights % 7.0) + 0.1) - 0.001 * len(r.tokens)
            token = int(abs(weights) * 1000 + len(r.tokens) + sum(r.prompt)) % 97
            r.tokens.append(token)
            r.logprobs.append({token: SimpleNamespace(logprob=lp, rank=1)})
            r.versions.append(version)
            stops = r.params.stop_token_ids or []
            if len(r.tokens) >= r.params.max_tokens or token in stops:
                self.running.remove(r)
                self.finished_ids.add(r.rid)
                reason = "stop" if token in stops else "length"
                self._emit(r, self.forced_reasons.get(r.prompt[0], reason))
        time.sleep(self.step_s)

    def _emit(self, r: Req, reason: str):
        self.truth[r.rid.rpartition("-")[0]] = list(r.versions)
        out = SimpleNamespace(
            request_id=r.rid.rpartition("-")[0],
            outputs=[
                SimpleNamespace(
                    token_ids=list(r.tokens), logprobs=list(r.logprobs), finish_reason=reason
                )
            ],
            finished=True,
            num_cached_tokens=r.cached_tokens,
        )
        r.loop.call_soon_threadsafe(r.out_q.put_nowait, out)


class FakeModel(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.names = list(tensors)
        self.flat = torch.nn.ParameterList(
            [torch.nn.Parameter(t.clone(), requires_grad=False) for t in tensors.values()]
        )

    def named_parameters(self, *args, **kwargs):
        return iter(zip(self.names, self.flat, strict=True))


class OwnedLock:
    """threading.Lock that knows which thread holds it: the fake worker gives one to
    the extension's LockedWeights, so records say whether *this* thread held the
    forward lock (a plain ``locked()`` is also true while the engine's thread runs a
    step beside the receiver)."""

    def __init__(self):
        self._lock, self.owner = threading.Lock(), None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self.owner = threading.get_ident()
        return got

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def held_by_me(self) -> bool:
        return self._lock.locked() and self.owner == threading.get_ident()


def forward_lock_held_here(worker) -> bool:
    """Whether the calling thread holds the worker's per-forward-pass lock."""
    lock = getattr(getattr(worker, "_nonstop", None), "lock", None)
    return lock is not None and lock.held_by_me()


class FakeLoRAModelManager:
    """LoRAModelManager with one GPU slot: registered adapters (CPU) and the slot they
    are copied into on activation. ``writes`` records every slot write: (version tag,
    thread name, the worker's forward lock held, a step between execute and sample)."""

    def __init__(self, worker):
        self.worker = worker
        self.registered: dict[int, SimpleNamespace] = {}
        self.active: int | None = None
        self.slot: dict[str, torch.Tensor] = {}  # allocated at the first activation
        self.writes: list[tuple] = []
        self.merges: list[tuple] = []

    def list_adapters(self) -> set[int]:
        return set(self.registered)

    def get_adapter(self, adapter_id: int):  # lora/model_manager.py: get_adapter
        return self.registered.get(adapter_id)

    def remove_adapter(self, adapter_id: int) -> bool:
        if self.active == adapter_id:
            self.active = None  # deactivate: the slot is free (its tensors stay)
        return self.registered.pop(adapter_id, None) is not None

    def add_adapter(self, model) -> bool:
        self._create_merged_loras_inplace(model)  # as LoRAModelManager._add_adapter
        self.registered[model.id] = model
        return True

    def _create_merged_loras_inplace(self, model) -> None:
        """vLLM merges q/k/v into packed modules here (again: a no-op once merged);
        ``merges`` records where the work was done: (tag, thread, forward lock held)."""
        if getattr(model, "merged", False):
            return
        self.merges.append(
            (model.tag, threading.current_thread().name, forward_lock_held_here(self.worker))
        )
        model.merged = True

    def activate_adapter(self, adapter_id: int) -> bool:
        if self.active == adapter_id:
            return False
        model = self.registered[adapter_id]
        if not self.slot:
            self.slot = {n: torch.zeros_like(t) for n, t in model.tensors.items()}
        self.writes.append(
            (
                model.tag,
                threading.current_thread().name,
                forward_lock_held_here(self.worker),
                self.worker.in_step,
            )
        )
        for n, t in model.tensors.items():
            self.slot[n].copy_(t)  # set_lora: in place
        self.active = adapter_id
        return True


class FakeLoRAManager:
    """LRUCacheWorkerLoRAManager: ``_load_adapter`` reads a peft folder on the CPU (and
    refuses tensors that do not fit the version-0 adapter's); ``set_active_adapters``
    is what the model runner calls in each step's execute_model."""

    def __init__(self, worker):
        self._adapter_manager = FakeLoRAModelManager(worker)
        self.loads: list[str] = []

    def _load_adapter(self, request) -> SimpleNamespace:
        from safetensors.torch import load_file

        with open(os.path.join(request.lora_path, "adapter_config.json")) as f:
            config = json.load(f)
        tensors = load_file(os.path.join(request.lora_path, "adapter_model.safetensors"))
        slot = self._adapter_manager.slot
        if slot and {n: t.shape for n, t in tensors.items()} != {
            n: t.shape for n, t in slot.items()
        }:
            raise ValueError(f"adapter at {request.lora_path} does not fit the LoRA slot")
        self.loads.append(request.lora_path)
        tag = round(sum(float(t.double().sum()) for t in tensors.values()), 6)
        return SimpleNamespace(id=request.lora_int_id, tensors=tensors, config=config, tag=tag)

    def set_active_adapters(self, requests: set) -> None:
        manager = self._adapter_manager
        for request in requests:
            if request.lora_int_id not in manager.list_adapters():
                manager.add_adapter(self._load_adapter(request))
            manager.activate_adapter(request.lora_int_id)


class FakeWorkerBase:
    """vLLM's Worker as the extension sees it: get_model, execute_model (returns None:
    sampling follows), sample_tokens. Returns (weights checksum, live version); with
    LoRA the checksum includes the adapter slot, activated as the model runner does."""

    # worker_base.py: parallel_config (tensor_parallel_size, ...) and the rank
    parallel_config = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    rank = 0

    def __init__(self, model, enable_lora: bool = False):
        self.model, self.in_step = model, False
        self.lora_of: dict[str, LoRARequest] = {}  # request id -> its adapter
        if enable_lora:
            self.model_runner = SimpleNamespace(lora_manager=FakeLoRAManager(self))

    @property
    def _nonstop(self):
        return self.__dict__.get("_nonstop")

    @_nonstop.setter
    def _nonstop(self, weights) -> None:
        """The extension sets its LockedWeights here (before any locked step): its lock
        becomes an OwnedLock, so the fake can tell which thread holds it."""
        if weights is not None and not weights.lock.locked():
            weights.lock = OwnedLock()
        self.__dict__["_nonstop"] = weights

    def get_model(self):
        return self.model

    def execute_model(self, scheduler_output):
        if scheduler_output.total_num_scheduled_tokens == 0:
            return "EMPTY_MODEL_RUNNER_OUTPUT"  # gpu_model_runner: no forward, no sampling
        self.in_step = True
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            for new in scheduler_output.scheduled_new_reqs:
                if new.lora_request is not None:
                    self.lora_of[new.req_id] = new.lora_request
            ids = scheduler_output.num_scheduled_tokens
            runner.lora_manager.set_active_adapters(
                {self.lora_of[r] for r in ids if r in self.lora_of}
            )
        self._seen = sum(float(p.sum()) for p in self.model.flat)
        if runner is not None:
            slot = runner.lora_manager._adapter_manager.slot
            self._adapter = round(sum(float(t.double().sum()) for t in slot.values()), 6)
            self._seen += self._adapter
        w = getattr(self, "_nonstop", None)
        self._version = w.live_version if w is not None else 0  # read under the lock
        return None

    def sample_tokens(self, grammar_output):
        self.in_step = False
        if getattr(self, "model_runner", None) is not None:
            self.adapters_seen.append((self._version, self._adapter))
        return self._seen, self._version


def inject_extension(worker_cls: type, qualname: str) -> None:
    """As vLLM 0.32's ``WorkerWrapperBase.init_worker`` (v1/worker/worker_base.py): the
    extension may not have any attribute the Worker class has (an AssertionError names
    it), and it is appended to the Worker's bases, so the Worker's own methods win."""
    module, _, name = qualname.rpartition(".")
    ext = getattr(importlib.import_module(module), name)
    if ext in worker_cls.__bases__:
        return
    for attr in dir(ext):
        if attr.startswith("__"):
            continue
        assert not hasattr(worker_cls, attr), (
            f"Worker class {worker_cls} already has an attribute {attr}, which conflicts "
            f"with the worker extension class {ext}."
        )
    worker_cls.__bases__ = worker_cls.__bases__ + (ext,)


class AsyncLLM:
    """``FakeAsyncLLM.model_tensors`` (set by the test) are the vLLM-layout weights."""

    model_tensors: dict[str, torch.Tensor] = {}
    step_s: float = 0.002
    last: AsyncLLM | None = None

    def __init__(self, args: AsyncEngineArgs):
        worker_cls = type("Worker", (FakeWorkerBase,), {})  # vLLM changes its class: one each
        inject_extension(worker_cls, args.worker_extension_cls)
        self.worker = worker_cls(FakeModel(self.model_tensors), args.enable_lora)
        self.worker.adapters_seen = []  # per step (LoRA): (live version, the slot's sum)
        self.args = args
        self.errored = False  # AsyncLLM.errored: the engine core died
        self.vllm_config = SimpleNamespace(  # AsyncLLM.vllm_config: what the engine resolved
            scheduler_config=SimpleNamespace(async_scheduling=bool(args.async_scheduling))
        )
        self.lora_requests: list = []  # the lora_request of every generate call
        self.core = FakeCore(
            self.worker, args.max_num_seqs or 256, bool(args.enable_prefix_caching), self.step_s
        )
        AsyncLLM.last = self

    @classmethod
    def from_engine_args(
        cls, engine_args, start_engine_loop=True, usage_context=None, stat_loggers=None
    ):
        return cls(engine_args)

    async def generate(
        self,
        prompt,
        sampling_params,
        request_id,
        *,
        prompt_text=None,
        lora_request=None,
        tokenization_kwargs=None,
        trace_headers=None,
        priority=0,
        data_parallel_rank=None,
        reasoning_ended=None,
        reasoning_parser_kwargs=None,
    ):
        assert sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
        if lora_request is not None and not self.args.enable_lora:
            raise ValueError("LoRA is not enabled")  # as vLLM's input processor says
        self.lora_requests.append(lora_request)
        out_q: asyncio.Queue = asyncio.Queue()
        rid = f"{request_id}-{uuid.uuid4().hex[:8]}"
        req = Req(
            rid,
            list(prompt["prompt_token_ids"]),
            sampling_params,
            prompt.get("cache_salt"),
            out_q,
            asyncio.get_running_loop(),
            lora_request,
        )
        added = False  # AsyncLLM.generate's ``q``: set once add_request has returned
        try:  # the add is sent at once (it happens even if this task is cancelled now)
            await asyncio.wrap_future(self.core.utility(lambda: self.core.waiting.append(req)))
            added = True
            out = await out_q.get()
            if isinstance(out, Exception):
                raise RuntimeError(f"fake engine core step failed: {out!r}") from out
            yield out
        except (asyncio.CancelledError, GeneratorExit):
            if added:  # as vLLM 0.32: a cancel that lands while adding aborts nothing
                self.core.utility(lambda: self._drop(rid))
            raise

    def _drop(self, rid):
        """An abort: as vLLM's scheduler, the request is finished (its id goes to the
        workers in the next step)."""
        core = self.core
        if any(r.rid == rid for r in core.waiting + core.running):
            core.finished_ids.add(rid)
        core.waiting = [r for r in core.waiting if r.rid != rid]
        core.running = [r for r in core.running if r.rid != rid]

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.core.calls.append(method)
        fut = self.core.utility(lambda: getattr(self.worker, method)(*args, **(kwargs or {})))
        return [await asyncio.wait_for(asyncio.wrap_future(fut), timeout)]

    async def pause_generation(self, *, mode="abort", wait_for_inflight_requests=None,
                               clear_cache=True):  # fmt: skip
        self.core.calls.append(f"pause_generation(mode={mode},clear_cache={clear_cache})")
        await asyncio.wrap_future(self.core.utility(lambda: setattr(self.core, "paused", True)))
        await asyncio.sleep(0.02)  # as 0.24.0 does

    async def resume_generation(self):
        self.core.calls.append("resume_generation")
        await asyncio.wrap_future(self.core.utility(lambda: setattr(self.core, "paused", False)))

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        return False

    async def abort(self, request_id, internal=False):
        """As vLLM 0.32's AsyncLLM.abort: external ids (every internal id made for them)
        unless ``internal``; dropped on the engine-core thread."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)

        def drop():
            core = self.core
            for r in core.waiting + core.running:
                if (r.rid if internal else r.rid.rpartition("-")[0]) in ids:
                    self._drop(r.rid)

        await asyncio.wrap_future(self.core.utility(drop))

    def shutdown(self, timeout=None):
        self.core.stopped = True


API = SimpleNamespace(
    version="0.32.0",
    AsyncLLM=AsyncLLM,
    AsyncEngineArgs=AsyncEngineArgs,
    SamplingParams=SamplingParams,
    RequestOutputKind=RequestOutputKind,
    LoRARequest=LoRARequest,
)
