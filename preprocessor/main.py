"""The preprocessor pool: rollout groups in, packed training micro-batches out.

::

    reads   <run>:rollouts  (consumer group "preprocessor", one consumer per process)
    writes  <run>:batches   (TrainBatch entries), <run>:dead (undecodable entries),
            <run>:samples_retired + retired_recent (dropped and dead-lettered groups,
            each once: pipeline.streams.retire_groups)
    blocks  on XREADGROUP when no rollouts wait

Per read of up to ``read_count`` groups, batched across them::

    dense scorers (prm, teacher)  ->  advantages: group-relative outcome advantage,
    mixed per token with the dense parts  ->  drop groups with no signal  ->
    other scorers (reference) on the kept groups  ->  pack into token-budget
    micro-batches

The scorers are ``preprocessor.scorers``, plus ``reference`` when
``trainer.kl_coef > 0`` (preprocessor/scorers.py). Rollouts are acknowledged
only after their batches are written. Groups dropped for no signal are recorded
(``no_signal`` event) for the group accounting (pipeline/run/accounting.py).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter

import msgspec
import numpy as np

from pipeline.messages import (
    SCHEMA_VERSION,
    BadEntry,
    RolloutGroup,
    TrainBatch,
    encode,
    unpack_i32,
)
from pipeline.routing import joined_routes
from pipeline.runtime import Pool, start_pool
from pipeline.stopping import final
from pipeline.streams import DATA, Consumer, Names, publish, retire_groups
from pipeline.streams.shards import open_consumer
from preprocessor.scorers import ScoredGroup, Scorer, build_scorers
from preprocessor.shaping import pack_whole_groups, set_advantages

log = logging.getLogger("preprocessor")
GROUP = Names.ROLLOUTS_GROUP


def usable(pool: Pool, consumer: Consumer, entries: list[tuple[str, RolloutGroup]]) -> list:
    """The entries whose groups pass RolloutGroup.check (the per-token invariants,
    pipeline/messages.py); the others go to the dead-letter stream with the reason and
    are retired (the actor counted them produced; undecodable entries it did not)."""
    good = []
    for entry_id, group in entries:
        try:
            group.check()
        except BadEntry as e:
            retire_groups(pool.client, pool.names, [(group.group_id, len(group.samples))])
            consumer.dead_letter(entry_id, {DATA: encode(group)}, str(e))
            continue
        good.append((entry_id, group))
    return good


def sampling_key(group: RolloutGroup) -> tuple[float, float, int]:
    """The sampling settings a group was generated under (temperature, top_p, top_k)."""
    return (group.temperature, group.top_p, group.top_k)


def to_batches(groups: list[RolloutGroup], budget: int) -> list[TrainBatch]:
    """Pack the groups into token-budget micro-batches, each group whole in one
    (shaping.pack_whole_groups; a group over the budget alone gets consecutive ones of
    its own). A TrainBatch carries one set of sampling settings, so groups generated
    under different settings (actors with other sampling.temperature/top_p/top_k) are
    packed into separate batches. With routes (sampling.keep_routing) each sample's
    routes get the group's ``prompt_routes`` joined in front, and the batch the groups'
    ``route_layout``."""
    by_settings: dict[tuple, list[RolloutGroup]] = {}
    for g in groups:  # groups with routes and without (keep_routing switched) apart
        by_settings.setdefault((*sampling_key(g), tuple(g.route_layout)), []).append(g)
    out = []
    for (temperature, top_p, top_k, route_layout), same in by_settings.items():
        if route_layout:  # every sample's routes over all its rows (prompt_routes joined)
            same = [
                msgspec.structs.replace(
                    g,
                    prompt_routes=b"",
                    samples=[
                        msgspec.structs.replace(s, routes=r)
                        for s, r in zip(g.samples, joined_routes(g), strict=True)
                    ],
                )
                for g in same
            ]
        prompt = [len(unpack_i32(g.prompt_ids)) for g in same]
        lengths = [
            [p + len(s.tokens()) for s in g.samples] for p, g in zip(prompt, same, strict=True)
        ]
        for pairs in pack_whole_groups(lengths, budget):
            chosen = [(same[gi], same[gi].samples[si]) for gi, si in pairs]
            out.append(
                TrainBatch(
                    schema=SCHEMA_VERSION,
                    batch_id=batch_id(chosen),
                    group_ids=[g.group_id for g, _ in chosen],
                    prompt_ids=[g.prompt_ids for g, _ in chosen],
                    samples=[s for _, s in chosen],
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    route_layout=list(route_layout),
                )
            )
    return out


def batch_id(chosen: list) -> str:
    """A batch's id from its (group, sample) pairs: the same samples packed again (a
    re-read after a restart before the ack) give the same id, and publish's XADD-once
    (the id is its token) adds no second copy."""
    ids = "\n".join(f"{g.group_id}/{s.index}" for g, s in chosen)
    return hashlib.sha1(ids.encode()).hexdigest()[:16]


def score_groups(
    scorers: list[Scorer], groups: list[RolloutGroup], drop_no_signal: bool, std: str = "group"
) -> tuple[list[RolloutGroup], list[RolloutGroup], Counter]:
    """Run the scorers and set advantages (``std``: trainer.advantage_std); return (kept,
    dropped, scorer counters)."""
    items = [ScoredGroup(g) for g in groups]
    counts: Counter = Counter()
    for scorer in scorers:
        if scorer.dense:
            counts.update(scorer.score(items))
    weights = {s.name: s.weight for s in scorers if s.dense}
    kept, dropped = [], []
    for it in items:
        signal = set_advantages(it.group.samples, it.dense, weights, std=std)
        (kept if signal or not drop_no_signal else dropped).append(it)
    for scorer in scorers:
        if not scorer.dense and kept:
            counts.update(scorer.score(kept))
    return [it.group for it in kept], [it.group for it in dropped], counts


def process(
    pool: Pool, scorers: list[Scorer], entries: list[tuple[str, RolloutGroup]], out=None
) -> dict:
    """Score, pack and XADD batches to ``out`` (the rollouts' shard or partition, a
    pipeline.streams.shards Part; default the primary)."""
    cfg = pool.cfg.preprocessor
    groups = [group for _id, group in entries]
    std = pool.cfg.trainer.advantage_std
    kept, dropped, counts = score_groups(scorers, groups, cfg.drop_no_signal, std)
    retire_groups(pool.client, pool.names, [(g.group_id, len(g.samples)) for g in dropped])
    batches = to_batches(kept, cfg.token_budget) if kept else []
    for b in batches:
        versions = np.concatenate([s.token_versions() for s in b.samples])
        publish(
            out.client if out else pool.client,
            (out.names if out else pool.names).batches,
            encode(b),
            token=b.batch_id,  # XADD-once: a re-send adds no copy (pipeline/streams/durable.py)
            schema=SCHEMA_VERSION,
            batch=b.batch_id,
            samples=len(b.samples),
            groups=len(set(b.group_ids)),
            versions=f"{versions.min()}-{versions.max()}",
            tokens=int(versions.size),
        )
    if kept:
        pool.record(event="batched", groups=[g.group_id for g in kept])
    if dropped:
        pool.record(event="no_signal", groups=[g.group_id for g in dropped])
    return {"kept": len(kept), "dropped": len(dropped), "batches": len(batches), **counts}


def main(argv: list[str] | None = None) -> None:
    pool = start_pool("preprocessor", argv)
    cfg = pool.cfg
    scorers = build_scorers(cfg)
    log.info("scorers: %s", ", ".join(s.name for s in scorers) or "none")
    consumer = open_consumer(  # every shard's rollouts with redis.shards > 1
        pool.shards,
        pool.names,
        pool.names.rollouts,
        GROUP,
        pool.name,
        RolloutGroup,
        block_ms=cfg.redis.block_ms,
        claim_idle_s=cfg.redis.claim_idle_s,
        dead_maxlen=cfg.redis.dead_letter_maxlen,
    )
    dead_seen = 0
    while not pool.tick():
        entries = usable(pool, consumer, consumer.read(cfg.preprocessor.read_count))
        dead_seen = count_dead_letters(pool, consumer, dead_seen)
        if not entries:
            pool.status.set(state="idle")
            continue
        counts = process(pool, scorers, entries, out=consumer.part_for(entries[0][0]))
        consumer.ack([entry_id for entry_id, _ in entries])
        consumer.trim()
        pool.record(event="preprocessed", **counts)
        add_totals(pool, counts)
        pool.status.set(state="working")
    # stopping with redis gone: one short try each (pipeline/stopping.py); the rollouts
    # this process read and did not acknowledge stay pending and are read again
    final(pool.stop, "the preprocessor's stopped status", lambda: pool.status.set(state="stopped"))
    totals = final(
        pool.stop,
        "a read of the run totals",
        lambda: pool.client.hmget(pool.status.key, ["kept", "dropped", "batches"]),
    )
    if totals is None:
        log.info("stopped (run totals not read: redis did not answer)")
        return
    kept, dropped, batches = ((t or b"0").decode() for t in totals)
    log.info("stopped: kept %s, dropped %s, batches %s (run totals)", kept, dropped, batches)


def count_dead_letters(pool: Pool, consumer: Consumer, seen: int) -> int:
    """Add this process's new dead letters to the status hash (HINCRBY: the count
    survives a restart); return the consumer's count for the next call."""
    if consumer.dead_lettered > seen:
        pool.status.incr("dead_lettered", consumer.dead_lettered - seen)
    return consumer.dead_lettered


def add_totals(pool: Pool, counts: dict) -> None:
    """Counters in the status hash are HINCRBY'd, never re-set: a restarted process
    goes on from the totals its predecessor left."""
    for key, value in counts.items():
        if isinstance(value, int):
            pool.status.incr(key, value)
        else:
            pool.status.incr_float(key, float(value))
