"""What both actor loops write for a group: scored, XADDed to the rollouts stream,
counted once; and the engine's pauses for new weights as ``swap`` records.

::

    reads   the completions of one group (from either loop), the engine's swap records
    writes  <run>:rollouts (one entry per group, XADD-once on the group id, on the next
            shard in turn); <run>:samples_produced, groups_produced and the status hash
            (count_produced, once per group; reward errors by reason); ``group``,
            ``swap`` and ``swap_gap`` (the added gap around a new version) metrics records;
            <run>:dead instead of the rollouts for a group whose payload is over
            MAX_GROUP_BYTES (its samples counted produced and retired at once)
    blocks  on nothing but the Redis calls

sampling.keep_routing: each sample carries its routes (pipeline/routing.py's layout, the
engine's ``route_layout``); when every sample's prompt rows are identical the group
carries them once (``prompt_routes``) and the samples their completion rows only.
"""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np

from actor.engines import Completion, Engine
from pipeline.messages import (
    MAX_PAYLOAD_BYTES,
    SCHEMA_VERSION,
    RolloutGroup,
    Sample,
    encode,
    pack_i32,
)
from pipeline.routing import RouteLayout
from pipeline.runtime import Pool
from pipeline.streams import count_produced, publish, retire_groups
from pipeline.streams.durable import xadd
from pipeline.tasks import RewardErrors, score
from pipeline.telemetry import Window

# the largest rollout group the actor publishes: what a preprocessor decodes
# (pipeline/messages.py refuses a bigger payload); a bigger one goes to the dead letters
MAX_GROUP_BYTES = MAX_PAYLOAD_BYTES


log = logging.getLogger("actor")


def new_group_id(pool: Pool) -> str:
    return f"{pool.name}:{uuid.uuid4().hex[:16]}"


def to_group(
    pool: Pool,
    problem,
    prompt: list[int],
    samples: list[Sample],
    group_id: str | None = None,
    layout: RouteLayout | None = None,
) -> RolloutGroup:
    """The rollout group of ``samples``; ``group_id``: one given before (an episode
    group's, from the journal), else a new one. ``layout``: the samples carry routes
    (sampling.keep_routing) in that layout; their prompt rows go in ``prompt_routes``
    once when they are identical (:func:`share_prompt_routes`)."""
    e = pool.cfg.sampling
    prompt_routes = b""
    if layout is not None:
        prompt_routes = share_prompt_routes(samples, len(prompt), layout)
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
        route_layout=layout.as_list() if layout is not None else [],
        prompt_routes=prompt_routes,
    )


def share_prompt_routes(samples: list[Sample], prompt_len: int, layout: RouteLayout) -> bytes:
    """The prompt's rows once, taken off every sample's routes, when they are identical
    in every sample (b"" and the samples untouched otherwise: each keeps all its rows)."""
    cut = prompt_len * layout.layers * layout.k * layout.dtype.itemsize
    heads = {s.routes[:cut] for s in samples}
    if len(heads) != 1 or any(len(s.routes) < cut for s in samples):
        return b""
    for s in samples:
        s.routes = s.routes[cut:]
    return heads.pop()


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
    layout: RouteLayout | list[int] | None = None,
) -> None:
    """Score one group's completions and XADD it to the rollouts stream. ``layout``:
    the engine's ``route_layout`` (sampling.keep_routing: every completion has routes),
    a RouteLayout or its [layers, k, experts] list."""
    if isinstance(layout, list | tuple):
        layout = RouteLayout.from_list(list(layout))
    texts = tokenizer.batch_decode([c.tokens for c in outs], skip_special_tokens=True)
    scores = score_group(pool, texts, problem.answer, errors)
    rewards.add(*scores)
    if pool.cfg.sampling.keep_routing and (layout is None or any(c.routes is None for c in outs)):
        raise RuntimeError(
            f"sampling.keep_routing is set but the {pool.cfg.actor.engine} engine recorded no "
            "routes: this engine does not record them yet; set sampling.keep_routing=false"
        )
    samples = [c.to_sample(k, r, layout) for k, (c, r) in enumerate(zip(outs, scores, strict=True))]
    send_group(pool, to_group(pool, problem, prompt, samples, layout=layout))


def send_group(pool: Pool, group: RolloutGroup, **record) -> None:
    """XADD a scored group to the rollouts stream (once), record and count it;
    ``record``: more fields of its ``group`` metrics record (episodes' counters). A
    group over MAX_GROUP_BYTES is dead-lettered instead (:func:`dead_letter_group`)."""
    per_sample = [s.token_versions() for s in group.samples]
    versions = np.concatenate(per_sample)
    scores = [s.reward for s in group.samples]
    part = pool.shards.next()  # redis.shards: the next shard or partition in turn
    payload = encode(group)
    if len(payload) > MAX_GROUP_BYTES:
        dead_letter_group(pool, part, group, len(payload))
        return
    # said before the XADD: a process killed between redis applying it and the ``group``
    # record below (a SIGKILL; a machine shutdown that stops redis-server before its
    # reply) leaves this record, and the account counts the group as published where it
    # turns up, and not at all where it does not (pipeline/run/accounting.py published)
    pool.record(event="group_unconfirmed", group=group.group_id, samples=len(group.samples))
    publish(  # (pipeline/streams/shards.py)
        part.client,
        part.names.rollouts,
        payload,
        token=group.group_id,  # XADD-once: a re-send adds no copy (streams/durable.py)
        schema=SCHEMA_VERSION,
        group=group.group_id,
        actor=pool.name,
        problem=group.problem_id,
        versions=f"{versions.min()}-{versions.max()}",
        reward=f"{np.mean(scores):.3f}",
        tokens=int(versions.size),
    )
    # the actor's own record of what it published (pipeline/run/accounting.py checks the
    # streams and the trainer's records against it): right after the XADD's reply, it
    # confirms the record above
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


def dead_letter_group(pool: Pool, part, group: RolloutGroup, size: int) -> None:
    """A group too big for the rollouts stream: a <run>:dead entry (role ``actor``, the
    reason saying what to change, no payload), its ``group`` record (dead_lettered) and
    its samples counted produced and retired at once (back-pressure stays balanced); the
    actor goes on."""
    routes = len(group.prompt_routes) + sum(len(s.routes) for s in group.samples)
    reason = (
        f"rollout group of {size} bytes exceeds the {MAX_GROUP_BYTES} bytes a rollouts entry "
        "may hold (pipeline/messages.py MAX_PAYLOAD_BYTES)"
        + (f", {routes} of them routes (sampling.keep_routing)" if routes else "")
        + ": lower sampling.max_new_tokens or task.group_size"
        + (", or set sampling.keep_routing=false" if routes else "")
    )
    log.error("dead-lettering rollout group %s: %s", group.group_id, reason)
    xadd(
        part.client,
        part.names.dead,
        {
            "source": part.names.rollouts,
            "id": "",
            "consumer": pool.name,
            "role": "actor",
            "reason": reason,
            "group": group.group_id,
            "data": b"",
        },
        maxlen=pool.cfg.redis.dead_letter_maxlen,
    )
    pool.status.incr("dead_lettered")
    pool.record(
        event="group",
        group=group.group_id,
        samples=len(group.samples),
        dead_lettered=True,
        bytes=size,
    )
    count_produced(pool.client, pool.names, pool.name, group.group_id, len(group.samples))
    retire_groups(pool.client, pool.names, [(group.group_id, len(group.samples))])


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
