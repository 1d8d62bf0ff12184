"""The actor pool: generate groups of completions, score them, XADD them.

::

    reads   task problems; <run>:weights + buckets over weights.transport (receiver thread);
            <run>:trainer_version; lag of the preprocessor group on rollouts
    writes  <run>:rollouts (one entry per group); <run>:samples_produced and the
            status hash (count_produced, once per group); metrics.jsonl
    blocks  while more than actor.max_lag versions behind the trainer, or while
            actor.max_queue_groups groups are in flight (back-pressure); while the run
            drains; sync mode: until its turn (all three: the Room, actor/room.py)

Weight updates land between two forward passes (see actor/engines/), so a
group may be generated across several versions; each token says which.

Two loops: batches (actor/batch.py: ``sampling.prompts_per_batch`` groups generated
together, then scored and published; the hf engine, and every engine in
``pipeline.mode=sync``), or, for a streaming engine (vllm) in ``pipeline.mode=async``,
actor/stream.py: groups submitted and published one by one, the engine never waiting
for a batch to end. Both ask the same Room (actor/room.py: back-pressure, drain, sync
turns) before a new group and publish through actor/publish.py.
"""

from __future__ import annotations

import logging
import threading
import zlib

from actor.batch import batch_groups
from actor.engines import Engine, make_engine
from actor.episode_stream import stream_episodes
from actor.episodes import EpisodeRunner, dead_lettered_as
from actor.journal import Journal
from actor.stream import stream_groups
from actor.weight_receiver import WeightReceiver
from pipeline.config import run_secret
from pipeline.envs import load_env
from pipeline.runtime import EXIT_MISMATCH, Pool, model_path, start_pool
from pipeline.stopping import final
from pipeline.tasks import RewardErrors, make_task
from pipeline.telemetry import Window

log = logging.getLogger("actor")


def pool_seed(pool: Pool, base: int) -> int:
    """``base`` (a seed of the config) made this actor's own."""
    return base + zlib.crc32(pool.name.encode()) % 10_000


def build_engine(pool: Pool) -> Engine:
    """``actor.engine`` (actor.engines.make_engine), sampling with this pool's seed; its
    ``tokenizer`` attribute is the one the loops use. With metrics.http.enabled and the
    vllm engine, vLLM's own metrics (``vllm:*``: requests running and waiting, KV-cache
    use, ...) are served on the pool's /metrics too."""
    cfg = pool.cfg
    engine = make_engine(cfg, model_path(cfg), pool_seed(pool, cfg.run.seed))
    if engine.name == "vllm" and pool.endpoint is not None:
        pool.endpoint.reexport("vllm:")
    return engine


def build_task(pool: Pool, engine: Engine):
    """``task.kind``'s problems, drawn with this pool's seed; for ``task.kind=env`` the
    EpisodeRunner (actor/episodes.py) that runs the environment's episodes."""
    t = pool.cfg.task
    if t.kind == "env":
        env_cls = load_env(t.env)
        runner = EpisodeRunner(pool.cfg, engine, engine.tokenizer, env_cls, pool_seed(pool, t.seed))
        # each finished turn written to Redis; groups a dead actor left taken over
        runner.journal = Journal(
            pool.client,
            pool.names,
            pool.name,
            t.episode.takeover_s,
            dead_maxlen=pool.cfg.redis.dead_letter_maxlen,
            on_dead_letter=lambda gid, why: dead_lettered_as(pool, gid, why),
        )
        runner.on_env_error = lambda what: count_env_error(pool, what)
        return runner
    return make_task(t.kind, t.difficulty, t.path, pool_seed(pool, t.seed))


def count_env_error(pool: Pool, what: str) -> None:
    """An environment's reset or step raised (actor/episodes.py): counted by which."""
    pool.status.incr("env_errors")
    pool.status.incr(f"env_errors.{what}")


def start_receiver(pool: Pool, engine: Engine) -> WeightReceiver:
    """The weight receiver thread, its counters resumed (:func:`resume_counters`)."""
    cfg = pool.cfg
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
        # a ``weights`` record per applied version: staging and whole-transfer times
        on_applied=lambda **timings: pool.record(
            event="weights", **{k: round(v, 3) for k, v in timings.items()}
        ),
        transport=cfg.weights.transport,
        nccl_backend=cfg.weights.nccl_backend,
        # vllm: the channel opens in the engine's own process (the worker extension)
        receiver=engine.remote_receiver(cfg.weights.transport)
        if hasattr(engine, "remote_receiver")
        else None,
    )
    resume_counters(pool, receiver)
    receiver.start()
    return receiver


def resume_counters(pool: Pool, receiver: WeightReceiver) -> None:
    """A restarted actor goes on counting its weight updates where it left off (the
    status hash outlives the process), so summary.json counts every update once."""
    applied, failed = pool.client.hmget(
        pool.status.key, ["weight_updates_applied", "weight_updates_failed"]
    )
    receiver.applied, receiver.failed = int(applied or 0), int(failed or 0)


def is_env(task) -> bool:
    return isinstance(task, EpisodeRunner)


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


def finish(pool: Pool, engine: Engine, receiver: WeightReceiver, produced: int | None) -> None:
    """Stop the receiver, write the stopped status, close the engine (``produced``: the
    groups the loop published; None: it raised)."""
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
    groups = "?" if produced is None else produced
    log.info("stopped: %s groups, %d weight updates applied", groups, receiver.applied)
    engine.close()


def main(argv: list[str] | None = None) -> None:
    pool = start_pool("actor", argv)
    engine = build_engine(pool)
    task, receiver = build_task(pool, engine), start_receiver(pool, engine)
    streaming = pool.cfg.pipeline.mode == "async" and engine.streaming
    # episodes: actor/episode_stream.py (streaming: tools overlap other turns), or turn
    # by turn in the batch loop (actor/episodes.py)
    stream = stream_episodes if is_env(task) else stream_groups
    loop, produced = stream if streaming else batch_groups, None
    try:
        produced = loop(pool, engine, task, engine.tokenizer, Window(200), RewardErrors(), receiver)
    finally:
        if is_env(task):
            task.close()
        finish(pool, engine, receiver, produced)
    if receiver.fatal is not None:  # one line, and an exit the supervisor does not restart
        log.error("cannot take the trainer's weights: %s", receiver.fatal)
        raise SystemExit(EXIT_MISMATCH)
