"""Rank 0's intake: micro-batches from the batches stream, admitted or not.

::

    reads   <run>:batches (consumer group "trainer", consumer "trainer")
    writes  <run>:dead (entries whose per-sample arrays disagree), status hash
    blocks  on XREADGROUP (redis.block_ms per read) until a step's worth of samples

The path of one entry, all of it in :func:`collect` (entries are read one at a
time)::

    TrainBatch.check(vocab_size, route_layout)  fails -> <run>:dead with the reason, acknowledged
        |                                       now; its samples dead and retired
        v passes: the entry id joins the step (acknowledged after the step)
    admit, per sample:
        trained inside the dedupe window, or earlier in this step -> duplicate, dropped
                                                                     uncounted
        oldest token more than trainer.max_lag versions old       -> stale: retired, dropped
        else                                                      -> fresh: retired, kept
        |
        v the fresh samples, if any: one batch of the step

until ``trainer.samples_per_step`` fresh samples. ``retired`` counts each sample
that left the pipeline here (trained, stale, dead-lettered) once; a duplicate (a
batch delivered again after a restart) was retired when first seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.messages import BadEntry, TrainBatch, encode
from pipeline.streams import DATA, REJECTED_HELD, Consumer


@dataclass
class StepData:
    entry_ids: list[str] = field(default_factory=list)
    batches: list[TrainBatch] = field(default_factory=list)
    batch_entries: list[str] = field(default_factory=list)  # the entry id of each batch
    samples: int = 0
    stale: int = 0
    duplicates: int = 0
    dead: int = 0  # samples in dead-lettered entries
    retired: int = 0  # samples trained, rejected as stale or dead-lettered (no duplicates)
    stale_ids: list[str] = field(default_factory=list)
    stale_lengths: list[int] = field(default_factory=list)  # their completion lengths
    sample_ids: set[str] = field(default_factory=set)


def sample_ids(batch: TrainBatch) -> list[str]:
    """(group id, index) names a sample across every pool and every retry."""
    return [f"{g}/{s.index}" for g, s in zip(batch.group_ids, batch.samples, strict=True)]


def admit(
    data: StepData, batch: TrainBatch, version: int, max_lag: int, seen: dict[str, int]
) -> TrainBatch | None:
    """The batch cut to its fresh samples (None when none is): duplicates are dropped
    uncounted, samples older than ``max_lag`` versions dropped as stale; both recorded."""
    ids, keep = sample_ids(batch), []
    for i, s in enumerate(batch.samples):
        if ids[i] in seen or ids[i] in data.sample_ids:
            data.duplicates += 1
            continue
        data.retired += 1
        if version - int(s.token_versions().min()) > max_lag:
            data.stale += 1
            data.stale_ids.append(ids[i])
            data.stale_lengths.append(len(s.tokens()))
        else:
            keep.append(i)
            data.sample_ids.add(ids[i])
    if not keep:
        return None
    if len(keep) < len(batch.samples):
        batch.samples = [batch.samples[i] for i in keep]
        batch.group_ids = [batch.group_ids[i] for i in keep]
        batch.prompt_ids = [batch.prompt_ids[i] for i in keep]
    return batch


def rejected_held(data: StepData) -> int:
    """Samples the unfinished step rejected (stale, in dead-lettered entries): retired
    from the pipeline's point of view, counted in ``samples_retired`` only with the step."""
    return data.retired - data.samples


def stale_by_length(lengths: list[int], cfg) -> dict[str, int]:
    """The step's stale drops by completion length, in four equal ranges up to
    ``sampling.max_new_tokens`` (longer ones, e.g. episodes, in the last): a skew towards
    long samples would show as counts rising to the right (README "The objective")."""
    top = max(int(cfg.sampling.max_new_tokens), 4)
    edges = [round(top * q / 4) for q in (1, 2, 3)]
    labels = [f"1-{edges[0]}", f"{edges[0] + 1}-{edges[1]}", f"{edges[1] + 1}-{edges[2]}"]
    labels.append(f"{edges[2] + 1}+")
    counts = dict.fromkeys(labels, 0)
    for n in lengths:
        counts[labels[sum(n > e for e in edges)]] += 1
    return counts


def collect(
    pool,
    consumer: Consumer,
    version: int,
    seen: dict[str, int],
    vocab_size: int,
    idle: Callable[[], None] = lambda: None,
    idle_every_s: float = 5.0,
    route_layout: list[int] | None = None,
) -> StepData | None:
    """Read micro-batches until a step's worth of fresh samples; None when stopping.
    ``idle`` runs every ``idle_every_s`` while waiting (keeps other ranks' deadlines).
    ``route_layout``: the model's (``[]`` dense); a batch whose routes do not fit it is
    dead-lettered (None: not checked)."""
    cfg, data = pool.cfg.trainer, StepData()
    last_idle = time.monotonic()
    while data.samples < cfg.samples_per_step:
        if pool.stop.is_set():
            return None
        pool.tick()
        # one entry at a time: a step overshoots samples_per_step by less than one micro-batch
        # even when a backlog waits (else async steps would grow with the backlog)
        for entry_id, batch in consumer.read(count=1):
            try:
                # the per-token invariants and the routes' layout (pipeline/messages.py)
                batch.check(vocab_size, route_layout)
            except BadEntry as e:  # decodes but cannot be trained on: acknowledged now
                consumer.dead_letter(entry_id, {DATA: encode(batch)}, str(e))
                data.dead += len(batch.samples)
                data.retired += len(batch.samples)
                continue
            data.entry_ids.append(entry_id)  # acknowledged after the step (trainer/main.py)
            fresh = admit(data, batch, version, cfg.max_lag, seen)
            if fresh is not None:
                data.batches.append(fresh)
                data.batch_entries.append(entry_id)
                data.samples += len(fresh.samples)
        # what the unfinished step holds: fresh samples, and stale ones its record will
        # drop (the faults bench checks them against the trainer's pending list);
        # rejected_held: the samples it rejected (stale, dead-lettered) and retires only
        # with the step, which the actors' back-pressure must not count as in flight
        # (actor/room.py in_flight_groups: else a step short of fresh samples waits for
        # actors that wait for it)
        pool.status.set(
            state="waiting for data",
            buffered_samples=data.samples,
            buffered_stale=len(set(data.stale_ids)),
            **{REJECTED_HELD: rejected_held(data)},
        )
        if time.monotonic() - last_idle > idle_every_s:
            idle()
            last_idle = time.monotonic()
    return data
