"""What both actor loops write for a group: scored, XADDed to the rollouts stream,
counted once; and the engine's pauses for new weights as ``swap`` records.

::

    reads   the completions of one group (from either loop), the engine's swap records
    writes  <run>:rollouts (one entry per group, XADD-once on the group id, on the next
            shard in turn); <run>:samples_produced, groups_produced and the status hash
            (count_produced, once per group; reward errors by reason); ``group``,
            ``swap`` and ``swap_gap`` (the added gap around a new version) metrics records
    blocks  on nothing but the Redis calls
"""

from __future__ import annotations

import time
import uuid

import numpy as np

from actor.engines import Completion, Engine
from pipeline.messages import SCHEMA_VERSION, RolloutGroup, Sample, encode, pack_i32
from pipeline.runtime import Pool
from pipeline.streams import count_produced, publish
from pipeline.tasks import RewardErrors, score
from pipeline.telemetry import Window


def new_group_id(pool: Pool) -> str:
    return f"{pool.name}:{uuid.uuid4().hex[:16]}"


def to_group(
    pool: Pool, problem, prompt: list[int], samples: list[Sample], group_id: str | None = None
) -> RolloutGroup:
    """The rollout group of ``samples``; ``group_id``: one given before (an episode
    group's, from the journal), else a new one."""
    e = pool.cfg.sampling
    return RolloutGroup(
        schema=SCHEMA_VERSION,
        group_id=group_id or new_group_id(pool),
        actor=pool.name,
        problem_id=problem.id,
        prompt_ids=pack_i32(prompt),
        samples=samples,
        temperature=e.temperature,
        top_p=e.top_p,
        top_k=e.top_k,
        created=time.time(),
    )


def score_group(pool: Pool, texts: list[str], answer: str, errors: RewardErrors) -> list[float]:
    """Rewards of one group; a reward that raised scores 0.0 and is counted per reason
    in the status hash (``reward_errors``, ``reward_errors.<reason>``) and logged."""
    scores = []
    for text in texts:
        value, error = score(text, answer)
        if error is not None:
            errors.add(error, text, answer)
            pool.status.incr("reward_errors")
            pool.status.incr(f"reward_errors.{error}")
        scores.append(value)
    return scores


def publish_group(
    pool: Pool,
    tokenizer,
    problem,
    prompt: list[int],
    outs: list[Completion],
    rewards: Window,
    errors: RewardErrors,
) -> None:
    """Score one group's completions and XADD it to the rollouts stream."""
    texts = tokenizer.batch_decode([c.tokens for c in outs], skip_special_tokens=True)
    scores = score_group(pool, texts, problem.answer, errors)
    rewards.add(*scores)
    samples = [c.to_sample(k, r) for k, (c, r) in enumerate(zip(outs, scores, strict=True))]
    send_group(pool, to_group(pool, problem, prompt, samples))


def send_group(pool: Pool, group: RolloutGroup, **record) -> None:
    """XADD a scored group to the rollouts stream (once), record and count it;
    ``record``: more fields of its ``group`` metrics record (episodes' counters)."""
    per_sample = [s.token_versions() for s in group.samples]
    versions = np.concatenate(per_sample)
    scores = [s.reward for s in group.samples]
    part = pool.shards.next()  # redis.shards: the next shard or partition in turn
    publish(  # (pipeline/streams/shards.py)
        part.client,
        part.names.rollouts,
        encode(group),
        token=group.group_id,  # XADD-once: a re-send adds no copy (pipeline/streams/durable.py)
        schema=SCHEMA_VERSION,
        group=group.group_id,
        actor=pool.name,
        problem=group.problem_id,
        versions=f"{versions.min()}-{versions.max()}",
        reward=f"{np.mean(scores):.3f}",
        tokens=int(versions.size),
    )
    # the actor's own record of what it published (pipeline/accounting.py checks the
    # streams and the trainer's records against it): right after the XADD's reply
    pool.record(
        event="group",
        group=group.group_id,
        samples=len(group.samples),
        reward=float(np.mean(scores)),
        versions=[int(versions.min()), int(versions.max())],
        spanning=sum(int(v.min() != v.max()) for v in per_sample if v.size),
        **record,
    )
    # samples_produced (back-pressure) and groups_produced, once even when re-sent
    count_produced(pool.client, pool.names, pool.name, group.group_id, len(group.samples))


def record_swaps(pool: Pool, engine: Engine, seen: tuple[int, int]) -> tuple[int, int]:
    """A "swap" metrics record per pause for new weights since the last call (the lock
    hold: a staged swap, or a whole in-place receive; pipeline.plot's stalls), and a
    "swap_gap" record per new version whose added gap is measured by now (hf: from the
    engine's forward-pass timeline; vllm: by the worker, around its steps). ``seen``:
    what the last call returned."""
    records, swaps = engine.stats.swaps_since(seen[0])
    for r in records:
        pool.record(event="swap", swap_ms=round(r.ms, 3), version=r.version, mode=r.mode)
    gaps, versions = engine.stats.gaps_since(seen[1])
    for g in gaps:
        pool.record(
            event="swap_gap",
            added_gap_ms=round(g.added_ms, 3),
            gap_ms=round(g.ms, 3),
            usual_ms=round(g.usual_ms, 3),
        )
    return swaps, versions
