"""The actor loop in batches: ``sampling.prompts_per_batch`` groups generated together,
then scored and published (the hf engine, and every engine in ``pipeline.mode=sync``;
episodes, ``task.kind=env``, on every engine: actor/episodes.py, turn by turn).

::

    reads   task problems; what actor/room.py reads (lag, backlog, drain; sync: claims)
    writes  <run>:rollouts, one entry per group once the whole batch is done
            (actor/publish.py); the status hash and a ``turn`` metrics record per batch
    blocks  before each batch, in Room.wait (actor/room.py); on the engine for the whole
            batch (a stop aborts it, and a half-finished batch is not published)

The engine is empty while the actor scores and publishes a batch; the streaming loop
(actor/stream.py) removes that wait for a streaming engine in ``pipeline.mode=async``.
"""

from __future__ import annotations

import time

from actor.engines import Engine
from actor.episodes import EpisodeRunner, publish_episodes
from actor.publish import publish_group, record_swaps
from actor.room import Room
from pipeline.runtime import Pool
from pipeline.tasks import DEFAULT_SYSTEM_PROMPT, RewardErrors, build_prompt_ids
from pipeline.telemetry import Window


def generate_step(
    pool: Pool,
    engine: Engine,
    task,
    tokenizer,
    rewards: Window,
    errors: RewardErrors,
    prompts_n: int | None = None,
) -> int:
    """Generate, score and publish one batch of groups (``prompts_n`` prompts, default
    sampling.prompts_per_batch); return groups published."""
    cfg = pool.cfg
    if isinstance(task, EpisodeRunner):  # task.kind=env: multi-turn episodes
        return publish_episodes(pool, task, rewards, prompts_n or cfg.sampling.prompts_per_batch)
    g = cfg.task.group_size
    problems = [task.sample() for _ in range(prompts_n or cfg.sampling.prompts_per_batch)]
    system = DEFAULT_SYSTEM_PROMPT if cfg.task.system_prompt is None else cfg.task.system_prompt
    prompts = [build_prompt_ids(tokenizer, p.question, system) for p in problems]
    outs = engine.generate(
        [p for p in prompts for _ in range(g)],
        cfg.sampling.max_new_tokens,
        should_stop=pool.tick,
    )
    if pool.stop.is_set():
        return 0  # a half-finished batch is not published
    for i, (problem, prompt) in enumerate(zip(problems, prompts, strict=True)):
        group = outs[i * g : (i + 1) * g]
        publish_group(pool, tokenizer, problem, prompt, group, rewards, errors, engine.route_layout)
    return len(problems)


def batch_groups(
    pool: Pool, engine: Engine, task, tokenizer, rewards: Window, errors: RewardErrors, receiver
) -> int:
    """Generate and publish batches until stop, each when the Room lets it start.
    Returns the groups published."""
    room, produced, swaps = Room(pool, engine), 0, (0, 0)
    try:
        while not pool.stop.is_set():
            produced += _batch(pool, engine, task, tokenizer, rewards, errors, receiver, room)
            swaps = record_swaps(pool, engine, swaps)
    finally:
        room.close()
    return produced


def _batch(pool, engine, task, tokenizer, rewards, errors, receiver, room) -> int:
    """One batch, when the Room lets it start; the groups it published (0: stop)."""
    prompts_n = room.wait()
    if pool.stop.is_set():
        return 0
    t0, tokens0 = time.monotonic(), engine.stats.tokens
    made = generate_step(pool, engine, task, tokenizer, rewards, errors, prompts_n)
    room.done(made, time.monotonic() - t0)
    rate = (engine.stats.tokens - tokens0) / max(time.monotonic() - t0, 1e-9)
    pool.status.set(
        state="generating",
        version=engine.version,
        tokens=engine.stats.tokens,
        weight_updates_applied=receiver.applied,
        weight_updates_failed=receiver.failed,
        reward_mean=rewards.mean or 0.0,
        tokens_per_s=round(rate, 1),
        swap_ms_max=round(max(engine.stats.swap_ms, default=0.0), 3),  # recent pauses
    )
    return made
