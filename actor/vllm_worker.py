"""The vLLM worker extension: a per-forward-pass lock, a staged receive while the
engine generates, and the swap between two forward passes.

Loaded by vLLM 0.24 in its engine-core process through
``worker_extension_cls="actor.vllm_worker.NonstopWorkerExtension"``, which makes
this class a base of vLLM's GPU ``Worker`` (``self`` is the Worker; our method
names start with ``nonstop_`` so they never clash with its own)::

    actor process (client)                    engine core (this module)
    collective_rpc("nonstop_install")   -->   wrap execute_model / sample_tokens with the
                                              lock; staging = copy of the live parameters
    collective_rpc("nonstop_update",    -->   a background thread receives the buckets on
                   announcement, source)      a side stream, one bucket in flight at a time,
                                              checks each bucket's sum, scatters it into
                                              staging (actor/vllm_layout.py), then takes
                                              the lock (with a deadline) and enqueues
                                              staging -> parameters on the engine's stream
    collective_rpc("nonstop_update",    -->   stage only (the engine interface's stage());
                   ..., swap=False)           then "nonstop_swap" (lock mode: the same
                                              locked swap, queued) or, with the engine
                                              paused, "nonstop_swap_paused" (pause mode)
    collective_rpc("nonstop_poll", ids) -->   live and staged version, swaps, errors, and
                                              per request the versions of the steps that
                                              sampled it

The lock is taken on entry of ``execute_model`` and released on exit of the
matching ``sample_tokens`` (model runner V2 computes the logits there), so no
swap falls between a forward pass and the logits computed from it. The copy is
only enqueued under the lock; pointers never change, so CUDA graphs read the new
weights. A failed, partial or mis-summed receive never touches the parameters; a
lock not had within ``lock_timeout_s`` fails the update with an error and the
engine keeps generating on the old version. The recipe and its H100 numbers:
``device/VLLM_LOCK.md`` in the project's shared notes.

With ``model.lora`` (``nonstop_install(..., lora={"dir", "request"})``) the base
weights never change and no staging copy of them is made: announcements must say
``kind="lora"``; the buckets (peft-named adapter tensors) are received and checked the
same way, built into a vLLM LoRAModel outside the lock (``AdapterSwap.stage``,
actor/engines/vllm_lora.py), and the adapter's GPU slot is rewritten under the same
lock, deadline and version bookkeeping (``AdapterSwap.swap``). An announcement of the
other kind fails the update, saying which ``model.lora`` setting differs.

Everything except the vLLM Worker it is mixed into is plain torch, so the lock,
staging, scatter and swap are tested on the CPU with a fake worker.
"""

from __future__ import annotations

import importlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from actor.vllm_layout import Plan, build_plan
from actor.vllm_steps import StepVersions
from actor.vllm_tp import TPSource, tp_of, weights_group
from pipeline.lora import KIND_FULL, KIND_LORA
from pipeline.messages import WeightAnnouncement, decode
from pipeline.weights import checksum

log = logging.getLogger(__name__)
ALIGN = 256  # bytes: staging views start on 256-byte boundaries


class BucketSource(Protocol):
    """Fills bucket ``i`` of an announced version (a transport's receiving end)."""

    def fetch(self, index: int, out: torch.Tensor, deadline: float) -> None: ...


class LockedWeights:
    """The live parameters, a staging copy in the same layout, and the forward lock.

    ``adapter`` (an ``AdapterSwap``, with ``model.lora``): versions are LoRA adapters;
    the parameters are never written and no staging copy of them is made."""

    def __init__(
        self,
        named: list[tuple[str, torch.Tensor]],
        lock_timeout_s: float,
        adapter: Any = None,
        tp: tuple[int, int] = (0, 1),
    ):
        self.names = [n for n, _ in named]
        self.params = [p.data for _, p in named]
        self.device = self.params[0].device
        self.cuda = self.device.type == "cuda"
        self.compute = torch.cuda.current_stream() if self.cuda else None  # the engine's
        self.side = torch.cuda.Stream() if self.cuda else None
        self.lock = threading.Lock()
        self.lock_timeout_s = lock_timeout_s
        self.live_version = 0
        self.staged_version: int | None = None  # staging holds this whole version
        self.steps = StepVersions()
        self.swaps: deque[dict] = deque(maxlen=1024)
        self.failed, self.last_error, self.orphans = 0, "", 0
        self._pending = False
        self.tp_rank, self.tp_size = tp
        self.armed: int | None = None  # TP > 1: swap at the next execute_model entry
        self._copy_done: Any = None  # CUDA event: the last swap's copy out of staging
        self.adapter = adapter
        self.kind = KIND_FULL if adapter is None else KIND_LORA
        self.plan: Plan | None = None
        self.staging: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.by_name: dict[str, torch.Tensor] = {}
        if adapter is None:
            self._make_staging()

    def _make_staging(self) -> None:
        """A staging copy of every parameter in one buffer, initialised to them."""
        offsets, total = [], 0
        for p in self.params:
            if not p.is_contiguous():
                raise ValueError("vLLM parameters must be contiguous to be staged")
            offsets.append(total)
            total += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
        self.staging = torch.empty(total, dtype=torch.uint8, device=self.device)
        self.views = [
            self.staging[o : o + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            for o, p in zip(offsets, self.params, strict=True)
        ]
        with torch.no_grad():
            torch._foreach_copy_(self.views, self.params)  # padding rows keep their values
        self.by_name = dict(zip(self.names, self.views, strict=True))

    # -- the per-forward-pass lock ------------------------------------------------
    def wrap(self, worker: Any) -> None:
        """Shadow the worker's execute_model / sample_tokens with locked versions."""
        run, sample = worker.execute_model, worker.sample_tokens

        def execute_model(scheduler_output, *args, **kwargs):
            if self._pending:  # the last step's sample_tokens never came: end its hold
                self._pending = False
                self.orphans += 1
                self.lock.release()
            self.lock.acquire()
            try:
                if self.armed is not None:  # asked for mid-step on every rank: apply now
                    version, self.armed = self.armed, None
                    self._apply_logged(version, time.perf_counter())
                if scheduler_output.total_num_scheduled_tokens > 0:
                    self.steps.record(scheduler_output, self.live_version)
                out = run(scheduler_output, *args, **kwargs)
            except BaseException:
                self.lock.release()
                raise
            if out is None and scheduler_output.total_num_scheduled_tokens > 0:
                self._pending = True  # sample_tokens of this step releases it
            else:
                self.lock.release()
            return out

        def sample_tokens(grammar_output, *args, **kwargs):
            try:
                return sample(grammar_output, *args, **kwargs)
            finally:
                if self._pending:
                    self._pending = False
                    self.lock.release()

        worker.execute_model = execute_model
        worker.sample_tokens = sample_tokens

    # -- receive and swap ---------------------------------------------------------
    def check_kind(self, ann: WeightAnnouncement) -> None:
        """Refuse an announcement of the other kind (full weights vs a LoRA adapter)."""
        if ann.kind == self.kind:
            return
        if ann.kind == KIND_LORA:
            raise ValueError(
                f"version {ann.version} is a LoRA adapter (kind='lora') but this vLLM engine "
                "was started without model.lora; give the actors the trainer's model.lora"
            )
        raise ValueError(
            f"version {ann.version} holds {ann.kind!r} weights but this vLLM engine was "
            "started with model.lora (it takes adapters only); give the actors the "
            "trainer's model.lora (rank 0 or null for full fine-tuning)"
        )

    def stage(self, ann: WeightAnnouncement, source: BucketSource, deadline: float) -> None:
        """Receive every bucket of ``ann`` into staging; raise on any failure."""
        self.check_kind(ann)
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the last swap has read staging
        self.staged_version = None  # from here staging is partial until the end
        if self.adapter is not None:
            self._stage_adapter(ann, source, deadline)
            self.staged_version = ann.version
            return
        if self.plan is None:
            hf = {p.name: tuple(p.shape) for b in ann.buckets for p in b.params}
            self.plan = build_plan(
                {n: tuple(p.shape) for n, p in zip(self.names, self.params, strict=True)},
                hf,
                self.tp_rank,
                self.tp_size,
            )
        dtype = getattr(torch, ann.dtype)
        buf = torch.empty(max(b.numel for b in ann.buckets), dtype=dtype, device=self.device)
        side = torch.cuda.stream(self.side) if self.cuda else nullcontext()
        for i, spec in enumerate(ann.buckets):
            part = buf[: spec.numel]
            with side:
                source.fetch(i, part, deadline)
                if checksum([part])[0] != ann.checksums[i]:
                    raise RuntimeError(f"version {ann.version} bucket {i} failed its checksum")
                for p in spec.params:
                    n = 1
                    for d in p.shape:
                        n *= d
                    self.plan.scatter(
                        p.name, part[p.offset : p.offset + n].view(p.shape), self.by_name
                    )
            if self.cuda:
                self.side.synchronize()  # paced: one bucket in flight, buf reused next
        self.staged_version = ann.version

    def _stage_adapter(self, ann: WeightAnnouncement, source: BucketSource, deadline: float):
        """Receive the adapter's buckets (small: one buffer each), check their sums, and
        build the vLLM LoRAModel outside the lock (AdapterSwap.stage)."""
        from actor.engines.vllm_lora import adapter_tensors_from_buckets

        dtype = getattr(torch, ann.dtype)
        bufs = [torch.empty(b.numel, dtype=dtype, device=self.device) for b in ann.buckets]
        with torch.cuda.stream(self.side) if self.cuda else nullcontext():
            for i, buf in enumerate(bufs):
                source.fetch(i, buf, deadline)
                if checksum([buf])[0] != ann.checksums[i]:
                    raise RuntimeError(f"version {ann.version} bucket {i} failed its checksum")
        if self.cuda:
            self.side.synchronize()
        self.adapter.stage(ann.version, adapter_tensors_from_buckets(ann.buckets, bufs))

    def swap(self, version: int) -> dict:
        """Enqueue staging -> parameters under the lock; the next step runs ``version``."""
        self._check_staged(version)
        t0 = time.perf_counter()
        if not self.lock.acquire(timeout=self.lock_timeout_s):
            raise TimeoutError(
                f"the per-forward-pass lock was not free within {self.lock_timeout_s:g} s; "
                f"version {version} not applied, generation goes on with version "
                f"{self.live_version} (raise actor.vllm.lock_timeout_s if steps are that long)"
            )
        try:
            rec = self._apply(version, t0)
        finally:
            self.lock.release()  # right after enqueuing: the copy runs on, the lock is free
        if self._copy_done is not None:
            self._copy_done.synchronize()
            rec["done_ms"] = 1e3 * (time.perf_counter() - t0) - rec["lock_wait_ms"]
        return rec

    def swap_between_steps(self, version: int) -> None:
        """TP > 1, on the engine's thread in the broadcast queue's order (the same place
        on every rank): apply now if no step is in progress, else at the next
        execute_model entry. Never waits for the lock (this thread may hold it)."""
        self._check_staged(version)
        if self._pending:  # between a step's execute_model and its sample_tokens
            self.armed = version
            return
        with self.lock:  # free: only this thread takes it when TP > 1
            self._apply_logged(version, time.perf_counter())

    def _check_staged(self, version: int) -> None:
        if self.staged_version != version:
            raise RuntimeError(
                f"version {version} is not staged (staging holds {self.staged_version}); "
                "stage it first"
            )

    def _apply_logged(self, version: int, t0: float) -> None:
        """_apply where no caller can take the error: it is recorded for the poll."""
        try:
            self._apply(version, t0)
        except Exception as e:
            self.failed += 1
            self.last_error = f"version {version}: {e}"
            log.error("weight swap failed, keeping version %d: %s", self.live_version, e)

    def _apply(self, version: int, t0: float) -> dict:
        """The caller holds the lock: enqueue the copy on the engine's stream."""
        t1 = time.perf_counter()
        end = torch.cuda.Event() if self.cuda else None
        with torch.cuda.stream(self.compute) if self.cuda else nullcontext(), torch.no_grad():
            if self.adapter is not None:
                self.adapter.swap(version)  # rewrites the adapter's GPU slot in place
            else:
                torch._foreach_copy_(self.params, self.views)
            if end is not None:
                end.record()
        self.live_version = version
        self._copy_done = end  # stage() waits for it before it writes staging again
        t2 = time.perf_counter()
        rec = {
            "version": version,
            "lock_wait_ms": 1e3 * (t1 - t0),
            "hold_ms": 1e3 * (t2 - t1),
            "done_ms": 1e3 * (t2 - t1),  # the copy enqueued (CPU); swap() adds the GPU's
        }
        self.swaps.append(rec)
        return rec


def import_path(path: str) -> Any:
    """The object ``module:name`` names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def load_source(spec: dict) -> BucketSource:
    """``spec["factory"]`` is ``module:function``; it gets the rest of ``spec``."""
    factory: Callable[..., BucketSource] = import_path(spec["factory"])
    return factory(**{k: v for k, v in spec.items() if k != "factory"})


class NonstopWorkerExtension:
    """Mixed into vLLM's Worker; driven by the actor through ``collective_rpc``."""

    def nonstop_install(
        self,
        lock_timeout_s: float = 10.0,
        transfer_timeout_s: float = 60.0,
        lora: dict | None = None,
    ) -> dict:
        """Wrap the steps with the lock and start the receiver thread. ``lora``
        (``model.lora``): ``{"dir": the version-0 adapter folder, "request": the
        LoRARequest class as module:name}``; versions are then adapters."""
        if getattr(self, "_nonstop", None) is not None:
            return self._nonstop_info
        adapter = None
        if lora is not None:
            from actor.engines.vllm_lora import AdapterSwap

            adapter = AdapterSwap(self, lora["dir"], import_path(lora["request"]))
        named = list(self.get_model().named_parameters())
        tp = tp_of(self)
        w = LockedWeights(named, lock_timeout_s, adapter, tp)
        w.wrap(self)
        self._nonstop, self._nonstop_timeout = w, transfer_timeout_s
        self._nonstop_group = (  # TP > 1: the weights-only group (every rank at once)
            weights_group(tp[1], w.device, transfer_timeout_s) if tp[1] > 1 else None
        )
        self._nonstop_jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._nonstop_loop, name="nonstop-receiver", daemon=True).start()
        self._nonstop_info = {
            "params": len(named),
            "kind": w.kind,
            "bytes": int(w.staging.numel()) if w.staging is not None else 0,
            "device": str(w.device),
            "compute_stream": str(w.compute),
            "tp_rank": tp[0],
            "tp_size": tp[1],
        }
        return self._nonstop_info

    def nonstop_connect(self, transport: str, rendezvous: dict, nonce: str) -> None:
        """Open this worker's channel of ``weights.transport`` for a signed join (the
        actor process did the Redis side: read the rendezvous, XADD the join)."""
        from pipeline.transfer import make_receiver

        if self._nonstop.tp_rank != 0:
            return  # TP rank 0 receives and broadcasts to the others (actor/vllm_tp.py)
        if getattr(self, "_nonstop_receiver", None) is not None:
            self._nonstop_receiver.close()
        receiver = make_receiver(transport, self._nonstop_timeout)
        receiver.connect(rendezvous, nonce, time.monotonic() + self._nonstop_timeout)
        self._nonstop_receiver = receiver

    def nonstop_disconnect(self) -> None:
        """Close this worker's transfer channel (the actor rejoins with a new one)."""
        receiver, self._nonstop_receiver = getattr(self, "_nonstop_receiver", None), None
        if receiver is not None:
            receiver.close()

    def nonstop_update(
        self, announcement: bytes, source: dict | None = None, swap: bool = True
    ) -> None:
        """Queue one version: receive into staging while generating, then (``swap``)
        swap. ``source`` names a BucketSource factory (tests, in-memory buckets);
        default: the connected channel. Returns at once: poll for the outcome."""
        ann = decode(announcement, WeightAnnouncement)
        self._nonstop_jobs.put(("update" if swap else "stage", ann, source))

    def nonstop_swap(self, version: int) -> None:
        """Queue the locked swap of the staged ``version`` (lock mode). Never waits for
        the lock here: this runs on the engine thread, which may hold it between a step's
        execute_model and sample_tokens. Returns at once: poll for the outcome.
        TP > 1: swapped between the same two steps on every rank, from right here
        (LockedWeights.swap_between_steps, actor/vllm_tp.py)."""
        w = self._nonstop
        if w.tp_size == 1:
            self._nonstop_jobs.put(("swap", version, None))
            return
        try:
            w.swap_between_steps(version)
        except Exception as e:
            w.failed += 1
            w.last_error = f"version {version}: {e}"

    def nonstop_swap_paused(self, version: int) -> dict:
        """Pause mode: the engine is paused (no step runs), so swap right here on the
        engine thread and wait for the copy; raises if ``version`` is not staged."""
        w = self._nonstop
        if self._nonstop_jobs.unfinished_tasks:
            raise RuntimeError(f"version {version}: a receive is still running; poll first")
        try:
            return w.swap(version)
        except Exception as e:
            w.failed += 1
            w.last_error = f"version {version}: {e}"
            raise

    def nonstop_poll(self, request_ids: list[str] | None = None, take_swaps: bool = True) -> dict:
        """The worker's state; ``take_swaps``: hand over (and forget) the swap records."""
        w = self._nonstop
        swaps = list(w.swaps)
        if take_swaps:
            w.swaps.clear()
        return {
            "live_version": w.live_version,
            "staged_version": w.staged_version,
            "swaps": swaps,
            "failed": w.failed,
            "last_error": w.last_error,
            "busy": self._nonstop_jobs.unfinished_tasks,
            "orphan_holds": w.orphans,
            "tp_rank": w.tp_rank,
            "versions": w.steps.take(request_ids or []),
        }

    def _nonstop_source(self, ann: WeightAnnouncement, spec: dict | None) -> BucketSource:
        """Where the buckets come from: ``spec`` or the channel; TP > 1: rank 0 reads
        that and broadcasts, the other ranks receive the broadcast."""
        w = self._nonstop
        inner = None
        if w.tp_rank == 0 and spec is not None:
            inner = load_source(spec)
        elif w.tp_rank == 0:
            receiver = getattr(self, "_nonstop_receiver", None)
            if receiver is None:
                raise RuntimeError("no transfer channel: call nonstop_connect after joining")
            from pipeline.transfer import ReceiverSource

            inner = ReceiverSource(receiver, ann)
        if w.tp_size == 1:
            return inner
        return TPSource(inner, self._nonstop_group, w.tp_rank, w.device)

    def _nonstop_loop(self) -> None:
        w = self._nonstop
        if w.cuda:
            torch.cuda.set_device(w.device)
        while True:
            kind, job, spec = self._nonstop_jobs.get()
            version = job if kind == "swap" else job.version
            try:
                if kind == "update" and w.tp_size > 1:
                    raise RuntimeError("with tensor parallelism swaps come by nonstop_swap")
                if kind in ("update", "stage"):
                    deadline = time.monotonic() + self._nonstop_timeout
                    w.stage(job, self._nonstop_source(job, spec), deadline)
                if kind in ("update", "swap"):
                    w.swap(version)
            except Exception as e:  # the old weights stay whole; the client sees the error
                w.failed += 1
                w.last_error = f"version {version}: {e}"
                log.error("weight update failed, keeping version %d: %s", w.live_version, e)
            finally:
                self._nonstop_jobs.task_done()
