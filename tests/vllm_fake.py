"""A fake of vLLM 0.24.0's AsyncLLM for CPU tests of actor/engines/vllm.py.

Written from the 0.24.0 wheel's source: the same method names and signatures
(``AsyncLLM.from_engine_args``, ``generate``, ``collective_rpc``,
``pause_generation(mode=..., clear_cache=...)``, ``resume_generation``,
``reset_prefix_cache``, ``abort``, ``shutdown``), request ids made internal as
``<id>-<8 chars>`` (input_processor.assign_request_id), FINAL_ONLY outputs with
``token_ids``, ``logprobs`` (``[{token: Logprob}]``), ``finish_reason`` and
``num_cached_tokens``. An "engine core" thread steps like EngineCore with
UniProcExecutor: utility calls (collective_rpc, pause) are served between steps, and
each step calls the worker's ``execute_model`` then ``sample_tokens`` on a fake
Worker that mixes in the real worker extension (``worker_extension_cls``), so the
real lock, staging, swap and StepVersions run. Outputs reach the asyncio loop from
that thread.

Prefix caching is keyed like vLLM's (v1/core/kv_cache_utils.py: ``hash_block_tokens``
hashes (parent hash, block tokens, extra keys) and ``generate_block_hash_extra_keys``
puts ``cache_salt`` into the first block's extra keys only); each cached block
remembers the weight version it was computed under.
"""

from __future__ import annotations

import asyncio
import importlib
import queue
import threading
import time
import uuid
from concurrent.futures import Future
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
    logprobs_mode: str = "raw_logprobs"
    worker_extension_cls: str = ""
    extra: dict = field(default_factory=dict)


def block_hash(parent, tokens, extra_keys):
    """vLLM's hash_block_tokens keying: (parent or NONE_HASH, tokens, extra keys)."""
    return hash((parent if parent else "NONE_HASH", tuple(tokens), extra_keys))


class Req:
    def __init__(self, rid, prompt, params, salt, out_q, loop):
        self.rid, self.prompt, self.params, self.salt = rid, prompt, params, salt
        self.out_q, self.loop = out_q, loop
        self.tokens, self.logprobs, self.versions = [], [], []
        self.cached_tokens, self.started = 0, False
        self.hashes: list = []

    def all_tokens(self):
        return self.prompt + self.tokens


class FakeCore:
    """The engine-core thread: a scheduler, a prefix cache, the worker."""

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
        self.thread = threading.Thread(target=self.run, name="fake-engine-core", daemon=True)
        self.thread.start()

    def run(self):
        while not self.stopped:
            try:
                while True:
                    fn, fut = self.inbox.get_nowait()
                    try:
                        fut.set_result(fn())
                    except Exception as e:
                        fut.set_exception(e)
            except queue.Empty:
                pass
            if self.paused or not (self.waiting or self.running):
                time.sleep(0.001)
                continue
            self.step()

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

    def step(self):
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.pop(0)
            req.cached_tokens = self._lookup(req) if self.caching else 0
            self.running.append(req)
        self.active_log.append((len(self.running), len(self.waiting)))
        new = [r for r in self.running if not r.started]
        old = [r for r in self.running if r.started]
        so = SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(
                    req_id=r.rid, prompt_token_ids=r.prompt, num_computed_tokens=r.cached_tokens
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
            total_num_scheduled_tokens=1,
            finished_req_ids=set(self.finished_ids),
        )
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
                self._emit(r, reason)
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


class FakeWorkerBase:
    """vLLM's Worker as the extension sees it: get_model, execute_model (returns None:
    sampling follows), sample_tokens. Returns (weights checksum, live version)."""

    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model

    def execute_model(self, scheduler_output):
        self._seen = sum(float(p.sum()) for p in self.model.flat)
        w = getattr(self, "_nonstop", None)
        self._version = w.live_version if w is not None else 0  # read under the lock
        return None

    def sample_tokens(self, grammar_output):
        return self._seen, self._version


class AsyncLLM:
    """``FakeAsyncLLM.model_tensors`` (set by the test) are the vLLM-layout weights."""

    model_tensors: dict[str, torch.Tensor] = {}
    step_s: float = 0.002
    last: AsyncLLM | None = None

    def __init__(self, args: AsyncEngineArgs):
        module, _, name = args.worker_extension_cls.rpartition(".")
        ext = getattr(importlib.import_module(module), name)
        worker_cls = type("Worker", (ext, FakeWorkerBase), {})
        self.worker = worker_cls(FakeModel(self.model_tensors))
        self.args = args
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
        out_q: asyncio.Queue = asyncio.Queue()
        rid = f"{request_id}-{uuid.uuid4().hex[:8]}"
        req = Req(
            rid,
            list(prompt["prompt_token_ids"]),
            sampling_params,
            prompt.get("cache_salt"),
            out_q,
            asyncio.get_running_loop(),
        )
        await asyncio.wrap_future(self.core.utility(lambda: self.core.waiting.append(req)))
        try:
            out = await out_q.get()
            yield out
        except (asyncio.CancelledError, GeneratorExit):
            self.core.utility(lambda: self._drop(rid))
            raise

    def _drop(self, rid):
        self.core.waiting = [r for r in self.core.waiting if r.rid != rid]
        self.core.running = [r for r in self.core.running if r.rid != rid]

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
        self._drop(request_id)

    def shutdown(self, timeout=None):
        self.core.stopped = True


API = SimpleNamespace(
    AsyncLLM=AsyncLLM,
    AsyncEngineArgs=AsyncEngineArgs,
    SamplingParams=SamplingParams,
    RequestOutputKind=RequestOutputKind,
)
