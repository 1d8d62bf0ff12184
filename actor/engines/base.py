"""The engine interface every actor engine implements (``actor.engine``).

An engine generates completions for token-id prompts and reports, per sampled
token, its log-prob under the distribution actually sampled from and the weight
version that produced it. New weights arrive while it generates: the weight
receiver (actor/weight_receiver.py) hands ``stage`` a bucket source
(pipeline/transfer/) to fill the engine's staging copy from, then calls
``swap``, which takes the engine's per-forward-pass lock only to install it;
or, in in-place mode, ``update_in_place`` holds that lock for the whole
receive. Either way every pause of generation is recorded in ``stats`` as a
swap with its lock-hold time.

Implementations: ``hf`` (actor/engines/hf.py, CPU and GPU; one batch at a time) and
``vllm`` (actor/engines/vllm/client.py: vLLM's AsyncLLM, tested versions in
pipeline/vllm_versions.py's TESTED_VLLM; its worker extension,
actor/engines/vllm/worker/extension.py, stages in the engine-core process and swaps under a lock
around each forward pass). An engine with ``streaming = True`` also takes units of
prompts one at a time (``submit`` / ``take`` / ``open_units`` / ``held_units`` /
``empty_s`` / ``abort_open``), and in ``pipeline.mode=async`` the actor keeps it fed without
batch boundaries (actor/stream.py).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pipeline.messages import Sample, WeightAnnouncement, pack_f32, pack_i32, pack_mask, rle_encode
from pipeline.routing import RouteLayout
from pipeline.telemetry import Gap, added_gap
from pipeline.transfer import BucketSource

HISTORY = 1024  # recent swaps kept (counters keep the totals)


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool
    kept: list = field(default_factory=list)  # keep_sampling_mask: kept vocab ids per token
    # False: ``versions`` are lower bounds, not each token's own version (the engine
    # could not tell; staleness overstated), carried as Sample.versions_exact
    versions_exact: bool = True
    # sampling.keep_routing: the experts every fed-forward token was routed to, prompt
    # included (pipeline/routing.py's layout: [prompt + len(tokens) - 1, moe layers, k],
    # ids ascending per row, uint8 or uint16); False in routes_exact: some rows come from
    # a recompute after a swap or preemption
    routes: np.ndarray | None = None
    routes_exact: bool = True

    def to_sample(self, index: int, reward: float, layout: RouteLayout | None = None) -> Sample:
        """The wire form: packed arrays, run-length versions, the mask if recorded, the
        routes packed in ``layout`` (the engine's ``route_layout``) when given."""
        mask_ids, mask_counts = pack_mask(self.kept)  # b"", b"" unless keep_sampling_mask
        routes = b""
        if layout is not None and self.routes is not None:
            routes = layout.pack(self.routes)
        return Sample(
            index=index,
            completion_ids=pack_i32(self.tokens),
            logprobs=pack_f32(self.logprobs),
            versions=rle_encode(self.versions),
            reward=float(reward),
            finished=self.finished,
            mask_ids=mask_ids,
            mask_counts=mask_counts,
            versions_exact=self.versions_exact,
            routes=routes,
            routes_exact=self.routes_exact,
        )


@dataclass
class SwapRecord:
    """One pause of generation for new weights: the lock held for ``ms``."""

    time: float  # wall clock when the lock was released
    ms: float
    version: int | None  # the version installed (None: the update failed)
    mode: str  # "staged" (swap of received buffers) or "in-place" (receive under the lock)


@dataclass
class EngineStats:
    swaps: int = 0  # successful swaps
    swap_events: int = 0  # every lock hold for weights, failed ones too
    recent_swaps: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    forward_passes: int = 0
    tokens: int = 0
    inexact_stamps: int = 0  # completions whose versions are lower bounds (versions_exact)
    # (start, end) perf_counter times of recent forward passes, and the times new
    # versions took effect: an update's stall is the gap between the passes around it
    timeline: deque = field(default_factory=lambda: deque(maxlen=4096))
    version_times: deque = field(default_factory=lambda: deque(maxlen=4096))
    took_effect: int = 0  # versions that took effect (appended to version_times)
    # when generation started again after a pause of its own (a new batch): a gap
    # between passes that spans one is not the swap's
    breaks: deque = field(default_factory=lambda: deque(maxlen=4096))
    gaps: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # measured (Gap)
    gaps_total: int = 0
    _times_seen: int = 0  # version_times examined for a gap (hf)

    @property
    def swap_ms(self) -> list[float]:
        """Lock-hold times of the recent swaps (at most HISTORY)."""
        return [r.ms for r in self.recent_swaps]

    def add_swap(self, t0: float, version: int | None, mode: str) -> SwapRecord:
        """Record a lock hold that began at ``t0`` (perf_counter) and ends now."""
        record = SwapRecord(time.time(), 1000 * (time.perf_counter() - t0), version, mode)
        self.recent_swaps.append(record)
        self.swap_events += 1
        if version is not None:
            self.swaps += 1
        return record

    def new_version(self) -> None:
        """A new version takes effect now (between two forward passes)."""
        self.version_times.append(time.perf_counter())
        self.took_effect += 1

    def add_gaps(self, gaps: list[Gap]) -> None:
        """Gaps measured elsewhere (vllm: by the worker, around its steps)."""
        self.gaps.extend(gaps)
        self.gaps_total += len(gaps)

    def gaps_since(self, seen: int) -> tuple[list[Gap], int]:
        """The added gaps measured after the first ``seen``, and the new total. The hf
        engine's are measured here from its timeline, as far as they are measurable (a
        forward pass has started after the version); the vllm engine's come measured
        from its worker (``add_gaps``)."""
        times = list(self.version_times)
        first = self.took_effect - len(times)  # the index of times[0]
        passes, breaks = sorted(self.timeline), list(self.breaks)
        i = max(self._times_seen, first)
        while i < self.took_effect:
            gap = added_gap(passes, times[i - first], breaks)
            if gap is None:  # no pass after it yet: measured at a later call
                break
            i += 1
            if gap.ms is not None:
                self.add_gaps([gap])
        self._times_seen = i
        total, recent = self.gaps_total, list(self.gaps)
        new = recent[len(recent) - min(total - seen, len(recent)) :] if total > seen else []
        return new, total

    def swaps_since(self, seen: int) -> tuple[list[SwapRecord], int]:
        """The swap records after the first ``seen`` events, and the new total."""
        total, recent = self.swap_events, list(self.recent_swaps)
        new = recent[len(recent) - min(total - seen, len(recent)) :] if total > seen else []
        return new, total


class Engine(ABC):
    """Generation with per-token versions, and weights swapped between forward passes."""

    name: str
    stats: EngineStats
    version: int | None  # the live weight version (None: partial, nothing generates)
    streaming = False  # True: submit/take units without batch boundaries (actor/stream.py)
    # sampling.keep_routing: the layout of every Completion.routes (None: none recorded);
    # a RouteLayout or its [layers, k, experts] list (actor/publish.py takes either)
    route_layout: RouteLayout | list[int] | None = None

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, should_stop=lambda: False
    ) -> list[Completion]:
        """Sample a completion per prompt (token ids); stop early when should_stop()."""

    @abstractmethod
    def stage(self, ann: WeightAnnouncement, source: BucketSource, deadline: float) -> None:
        """Receive every bucket of ``ann`` into staging while generating goes on;
        raise on any failure (the live weights are untouched)."""

    @abstractmethod
    def swap(self, version: int) -> None:
        """Install the staged ``version`` under the per-forward-pass lock."""

    @abstractmethod
    def update_in_place(
        self, ann: WeightAnnouncement, source: BucketSource, deadline: float
    ) -> None:
        """Hold the lock while each bucket is received straight into the weights. A
        failure leaves them partial (version None: nothing generates) until the next
        whole version. The whole hold is recorded as the swap."""

    def close(self) -> None:  # noqa: B027 (optional: most engines hold nothing to release)
        """Release what the engine holds (processes, GPU memory)."""

    def dead(self) -> str:
        """Why the engine can never generate again ("" while it can): an engine in a
        process of its own (vLLM's engine core) can die while the actor lives on."""
        return ""
