"""The actor pool: generate groups of completions, score them, XADD them.

::

    reads   task problems; <run>:weights + buckets over weights.transport (receiver thread);
            <run>:trainer_version; lag of the preprocessor group on rollouts
    writes  <run>:rollouts (one entry per group); <run>:samples_produced and the
            status hash (count_produced, once per group); metrics.jsonl
    blocks  while more than actor.max_lag versions behind the trainer, or while
            actor.max_queue_groups rollouts wait unread (back-pressure)

Weight updates land between two forward passes (see actor/engines/), so a
group may be generated across several versions; each token says which.

Two loops: batches (``sampling.prompts_per_batch`` groups generated together, then
scored and published; the hf engine, and every engine in ``pipeline.mode=sync``), or,
for a streaming engine (vllm) in ``pipeline.mode=async``, actor/stream.py: groups
submitted and published one by one, the engine never waiting for a batch to end.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib

import numpy as np

from actor.engines import Completion, Engine, make_engine
from actor.sync import Turns
from actor.task import DEFAULT_SYSTEM_PROMPT, RewardErrors, build_prompt_ids, make_task, score
from pipeline.config import run_secret
from pipeline.messages import (
    SCHEMA_VERSION,
    RolloutGroup,
    encode,
    pack_i32,
)
from pipeline.runtime import EXIT_MISMATCH, Pool, model_path, start_pool, trainer_version
from pipeline.stopping import final
from pipeline.streams import count_produced, publish
from pipeline.telemetry import Window
from pipeline.weight_receiver import WeightReceiver

log = logging.getLogger("actor")


def in_flight_groups(pool: Pool) -> float:
    """Groups produced by every actor and not yet trained, dropped or rejected."""
    produced, retired = pool.client.mget(pool.names.samples_produced, pool.names.samples_retired)
    return (int(produced or 0) - int(retired or 0)) / pool.cfg.task.group_size


def wait_for_room(pool: Pool, engine: Engine) -> None:
    """Back-pressure: hold back new groups while too stale or too far ahead."""
    cfg = pool.cfg.actor
    while not pool.stop.is_set():
        behind = trainer_version(pool) - engine.version
        backlog = in_flight_groups(pool)
        if behind <= cfg.max_lag and backlog < cfg.max_queue_groups:
            return
        pool.status.set(state="waiting", version=engine.version, behind=behind, backlog=backlog)
        pool.tick()
        time.sleep(0.1)


def to_group(
    pool: Pool, problem, prompt: list[int], outs: list[Completion], rewards: list[float]
) -> RolloutGroup:
    e = pool.cfg.sampling
    samples = [c.to_sample(k, r) for k, (c, r) in enumerate(zip(outs, rewards, strict=True))]
    return RolloutGroup(
        schema=SCHEMA_VERSION,
        group_id=f"{pool.name}:{uuid.uuid4().hex[:16]}",
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
        publish_group(pool, tokenizer, problem, prompt, outs[i * g : (i + 1) * g], rewards, errors)
    return len(problems)


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
    group = to_group(pool, problem, prompt, outs, scores)
    per_sample = [s.token_versions() for s in group.samples]
    versions = np.concatenate(per_sample)
    publish(
        pool.shards.next(),  # redis.shards: the next shard in turn (pipeline/shards.py)
        pool.names.rollouts,
        encode(group),
        token=group.group_id,  # XADD-once: a re-send adds no copy (pipeline/durable.py)
        schema=SCHEMA_VERSION,
        group=group.group_id,
        actor=pool.name,
        problem=problem.id,
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
    )
    # samples_produced (back-pressure) and groups_produced, once even when re-sent
    count_produced(pool.client, pool.names, pool.name, group.group_id, len(group.samples))


def record_swaps(pool: Pool, engine: Engine, logged: int) -> int:
    """A "swap" metrics record per pause for new weights since the last call (the lock
    hold: a staged swap, or a whole in-place receive; pipeline.plot's stalls)."""
    records, total = engine.stats.swaps_since(logged)
    for r in records:
        pool.record(event="swap", swap_ms=round(r.ms, 3), version=r.version, mode=r.mode)
    return total


def resume_counters(pool: Pool, receiver: WeightReceiver) -> None:
    """A restarted actor goes on counting its weight updates where it left off (the
    status hash outlives the process), so summary.json counts every update once."""
    applied, failed = pool.client.hmget(
        pool.status.key, ["weight_updates_applied", "weight_updates_failed"]
    )
    receiver.applied, receiver.failed = int(applied or 0), int(failed or 0)


RECEIVER_STOP_S = 3.0  # a stopping actor waits this long for its weight receiver to close


def stop_receiver(pool: Pool, receiver: WeightReceiver) -> None:
    """``receiver.stop()``; when the pool was told to stop, waited for RECEIVER_STOP_S at
    most: a machine shutting down SIGTERMs vLLM's engine core too, and the receiver's
    close (an RPC into that engine) then waits for an answer that never comes (seen:
    the actor sat out the launcher's grace). The engine is closed next either way, and
    a version half received is not applied (receiver.py: staged, or marked partial)."""
    if not pool.stop.is_set():
        receiver.stop()
        return

    def close() -> None:
        try:
            receiver.stop()
        except Exception as e:  # its engine died (a machine shutdown stops it too)
            log.warning("stopping: the weight receiver did not close cleanly: %s", e)

    closing = threading.Thread(target=close, name="receiver-stop", daemon=True)
    closing.start()
    closing.join(timeout=RECEIVER_STOP_S)
    if closing.is_alive():
        log.warning(
            "stopping: the weight receiver did not close within %.0f s; going on", RECEIVER_STOP_S
        )


def build_engine(pool: Pool) -> tuple[Engine, object]:
    """``actor.engine`` (actor.engines.make_engine), sampling with this pool's seed."""
    cfg = pool.cfg
    seed = cfg.run.seed + zlib.crc32(pool.name.encode()) % 10_000
    engine = make_engine(cfg, model_path(cfg), seed)
    return engine, engine.tokenizer


def main(argv: list[str] | None = None) -> None:
    pool = start_pool("actor", argv)
    cfg = pool.cfg
    engine, tokenizer = build_engine(pool)
    task = make_task(
        cfg.task.kind,
        cfg.task.difficulty,
        cfg.task.path,
        cfg.task.seed + zlib.crc32(pool.name.encode()) % 10_000,
    )
    receiver = WeightReceiver(
        pool.client,
        pool.names,
        pool.name,
        engine,
        cfg.trainer.transfer_timeout_s,
        run_secret(),
        staged=cfg.sampling.weight_staging,
        on_error=lambda msg: pool.status.set(last_error=msg),
        on_fatal=lambda msg: pool.stop.set(),  # weights this actor can never take: stop
        transport=cfg.weights.transport,
        nccl_backend=cfg.weights.nccl_backend,
        # vllm: the channel opens in the engine's own process (the worker extension)
        receiver=engine.remote_receiver(cfg.weights.transport)
        if hasattr(engine, "remote_receiver")
        else None,
    )
    resume_counters(pool, receiver)
    receiver.start()
    rewards, produced, swaps, errors = Window(200), 0, 0, RewardErrors()
    turns = Turns(pool, engine, wait_for_room)  # pipeline.mode: async or sync phases
    try:
        if cfg.pipeline.mode == "async" and engine.streaming:
            from actor.stream import stream_groups

            produced = stream_groups(pool, engine, task, tokenizer, rewards, errors, receiver)
        while not pool.stop.is_set():
            prompts_n = turns.wait()
            if pool.stop.is_set():
                break
            t0, tokens0 = time.monotonic(), engine.stats.tokens
            made = generate_step(pool, engine, task, tokenizer, rewards, errors, prompts_n)
            produced += made
            turns.done(made, time.monotonic() - t0)
            swaps = record_swaps(pool, engine, swaps)
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
    finally:
        stop_receiver(pool, receiver)
        swap_ms = engine.stats.swap_ms
        final(  # stopping with redis gone: one short try (pipeline/stopping.py), then on
            pool.stop,
            "the actor's stopped status",
            lambda: pool.status.set(
                state="stopped",
                version=engine.version,
                weight_updates_applied=receiver.applied,
                weight_updates_failed=receiver.failed,
                swap_ms_max=max(swap_ms) if swap_ms else 0.0,
            ),
        )
        log.info("stopped: %d groups, %d weight updates applied", produced, receiver.applied)
        engine.close()
    if receiver.fatal is not None:  # one line, and an exit the supervisor does not restart
        log.error("cannot take the trainer's weights: %s", receiver.fatal)
        raise SystemExit(EXIT_MISMATCH)
