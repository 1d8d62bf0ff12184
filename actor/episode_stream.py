"""Episodes without turn boundaries (``task.kind=env``, a streaming engine - vllm - in
``pipeline.mode=async``).

::

    reads   the environment's tasks; finished turns from the engine (``take``); the
            environments' answers (futures on the runner's event-loop thread); what
            actor/room.py reads (lag, backlog, drain: asked without blocking)
    writes  <run>:rollouts, one group as soon as its G episodes have ended
            (actor/publish.py send_group); the status hash (actor/stream.py's Report,
            and the episode counters); ``turn`` metrics records
    blocks  never on a tool or on another episode: each episode's turn is a unit of
            its own in the engine; when it finishes, its tool call runs on the
            runner's event-loop thread (pipeline/envs/tools.py budgets) while the
            engine goes on with every other episode's turns, and the next turn is
            submitted when the tool answers

Up to ``open_target`` groups are open at once (as actor/stream.py keeps groups of
completions); a new group starts only when the Room has room. On stop, open turns
are aborted and their groups are never published.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from actor.episodes import Episode, EpisodeRunner, episode_counts
from actor.publish import send_group, to_group
from actor.room import Room
from actor.stream import Report, open_target
from pipeline.runtime import Pool
from pipeline.telemetry import Window

log = logging.getLogger("actor")


@dataclass
class OpenGroup:
    problem: object
    prompt: list[int]
    episodes: list[Episode]


def stream_episodes(
    pool: Pool, engine, runner: EpisodeRunner, tokenizer, rewards: Window, errors, receiver
) -> int:
    """Keep the engine fed with episode turns until stop; publish each group as its
    episodes end. Returns the groups published. (The loops' signature: ``tokenizer``
    and ``errors`` are the runner's own here.)"""
    cfg = pool.cfg
    room, report = Room(pool, engine), Report(pool, engine, receiver, rewards)
    shown, published = [None], [0]

    def finished(grp: OpenGroup) -> None:
        publish(pool, runner, grp, rewards)
        published[0] += 1
        room.changed()

    def tick(open_now: int) -> None:
        if open_now != shown[0]:
            pool.status.set(episodes_open=open_now)
            shown[0] = open_now
        pool.tick()
        report.tick(published[0], room)

    drive_episodes(
        engine,
        runner,
        cfg.task.group_size,
        open_target(cfg),
        admit=lambda: room(0),
        finished=finished,
        stop=pool.stop.is_set,
        tick=tick,
    )
    return published[0]


def drive_episodes(engine, runner: EpisodeRunner, g: int, target: int, admit, finished, stop, tick):
    """The loop itself: keep up to ``target`` groups of ``g`` episodes open while
    ``admit()`` allows a new one; each finished turn's environment step runs on the
    runner's loop thread while the engine goes on; ``finished(group)`` for each group
    whose episodes all ended (its environments closed first); ``tick(open episodes)``
    once per pass; until ``stop()``. Open turns are aborted on the way out."""
    last_turn = runner.cfg.task.episode.max_turns - 1
    keys, groups, steps, turns = itertools.count(), {}, {}, set()

    def submit(gid: int, k: int, index: int) -> None:
        ep = groups[gid].episodes[k]
        prompt = groups[gid].prompt + ep.ids
        engine.submit((gid, k, index), [prompt], runner.turn_budget(ep))
        turns.add((gid, k, index))

    try:
        while not stop():
            while len(groups) < target and admit():
                gid, problem = next(keys), runner.tasks.sample()
                eps = runner.new_episodes(g)
                (prompt,) = runner.openings([problem], eps, g)
                groups[gid] = OpenGroup(problem, prompt, eps)
                for k in range(g):
                    submit(gid, k, 0)
            for (gid, k, index), (out,) in engine.take(timeout=0.02):
                turns.discard((gid, k, index))
                if gid not in groups:  # dropped: another of its episodes failed at once
                    continue
                ep = groups[gid].episodes[k]
                turn = runner.take_turn(ep, out, runner.turn_budget(ep), index)
                if turn is not None:  # its environment answers on the loop thread
                    steps[(gid, k)] = (runner.spawn(ep.env.step(turn)), turn)
            for gid, k, index in turns - engine.held_keys():  # its request failed
                turns.discard((gid, k, index))
                if gid in groups and not end_failed(groups[gid].episodes[k]):
                    log.error("group %s dropped: an episode's first turn failed", gid)
                    runner.call(_close(groups.pop(gid).episodes))
                    for key in [key for key in steps if key[0] == gid]:
                        del steps[key]
            for (gid, k), (future, turn) in list(steps.items()):
                if not future.done():
                    continue
                del steps[(gid, k)]
                ep = groups[gid].episodes[k]
                runner.apply(ep, turn, future.result(), turn.index == last_turn)
                if not ep.done:
                    submit(gid, k, turn.index + 1)
            for gid in [gid for gid, grp in groups.items() if all(e.done for e in grp.episodes)]:
                if not any(key[0] == gid for key in steps):
                    grp = groups.pop(gid)
                    runner.call(_close(grp.episodes))
                    finished(grp)
            tick(sum(not e.done for grp in groups.values() for e in grp.episodes))
    finally:
        dropped = engine.abort_open()
        for grp in groups.values():
            runner.call(_close(grp.episodes))
        if groups:
            log.info("stopping: %d unfinished groups (%d turns) aborted", len(groups), dropped)


def end_failed(ep: Episode) -> bool:
    """The engine failed a turn's request (logged by the engine): the episode ends on
    its last sampled id, marked as an infrastructure failure (out of its group's
    advantage statistics, never scored as a wrong answer). False when it had sampled
    nothing yet: its group cannot be published and is dropped (never produced)."""
    ep.drop_observation()
    ep.done = ep.infra = True
    return bool(ep.offsets)


async def _close(eps: list[Episode]) -> None:
    for ep in eps:
        await ep.env.close()


def publish(pool: Pool, runner: EpisodeRunner, grp: OpenGroup, rewards: Window) -> None:
    samples = [ep.to_sample(k) for k, ep in enumerate(grp.episodes)]
    rewards.add(*[ep.reward for ep in grp.episodes])
    counts = episode_counts(grp.episodes)
    send_group(pool, to_group(pool, grp.problem, grp.prompt, samples), episodes=counts)
    for name, value in counts.items():
        pool.status.incr(name, value)
