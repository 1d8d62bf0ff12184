"""The engine interface every actor engine implements (``actor.engine``).

An engine generates completions for token-id prompts and reports, per sampled
token, its log-prob under the distribution actually sampled from and the weight
version that produced it. New weights arrive while it generates: the weight
receiver (pipeline/weight_receiver.py) hands ``stage`` a bucket source
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

import bisect
import statistics
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from pipeline.messages import Sample, WeightAnnouncement, pack_f32, pack_i32, pack_mask, rle_encode
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

    def to_sample(self, index: int, reward: float) -> Sample:
        """The wire form: packed arrays, run-length versions, the mask if recorded."""
        mask_ids, mask_counts = pack_mask(self.kept)  # b"", b"" unless keep_sampling_mask
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
        )


@dataclass
class SwapRecord:
    """One pause of generation for new weights: the lock held for ``ms``."""

    time: float  # wall clock when the lock was released
    ms: float
    version: int | None  # the version installed (None: the update failed)
    mode: str  # "staged" (swap of received buffers) or "in-place" (receive under the lock)


GAP_WINDOW = 32  # the usual gap: the median of this many gaps between passes before


@dataclass
class Gap:
    """Around one new version: the gap between the forward passes before and after it,
    and how much longer it was than the usual gap (never below 0), in ms; ``ms`` None:
    no pass before it to measure from."""

    ms: float | None
    usual_ms: float = 0.0
    added_ms: float = 0.0


def added_gap(passes: list[tuple[float, float]], t: float, breaks: list[float]) -> Gap | None:
    """The gap around a version that took effect at ``t`` (perf_counter) among sorted
    (start, end) forward passes; None when no pass has started after ``t`` yet;
    ``Gap(None)`` when none ran before it or generation paused of its own in the gap
    (a time in ``breaks``)."""
    starts = [start for start, _ in passes]
    i = bisect.bisect_right(starts, t)  # passes[i]: the first to start after t
    if i == len(passes):
        return None
    if i == 0 or any(passes[i - 1][1] <= b <= passes[i][0] for b in breaks):
        return Gap(None)
    before = passes[max(0, i - GAP_WINDOW - 1) : i]
    usual = [b[0] - a[1] for a, b in zip(before, before[1:], strict=False)]
    usual_ms = 1000 * statistics.median(usual) if usual else 0.0
    ms = 1000 * (passes[i][0] - passes[i - 1][1])
    return Gap(ms, usual_ms, max(0.0, ms - usual_ms))


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

    def gaps_since(self, seen: int) -> tuple[list[Gap], int]:
        """The added gap of each version after the first ``seen`` that took effect, as far
        as they are measurable (a forward pass has started after it), and the new count.
        Nothing for an engine that keeps no timeline (vllm: its passes run in the
        engine-core process)."""
        times = list(self.version_times)
        first = self.took_effect - len(times)  # the index of times[0]
        passes, breaks = sorted(self.timeline), list(self.breaks)
        gaps = []
        for i in range(max(seen, first), self.took_effect):
            gap = added_gap(passes, times[i - first], breaks)
            if gap is None:  # no pass after it yet: measured at a later call
                return gaps, i
            if gap.ms is not None:
                gaps.append(gap)
        return gaps, self.took_effect

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
