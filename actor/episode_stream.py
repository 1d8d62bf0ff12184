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
completions); a new group starts only when the Room has room: one another actor left
in the episode journal first (actor/journal.py: taken over from its last written
turns), else a new task's. Every finished turn is written to the journal. On stop,
open turns are aborted; their groups are not published by this actor, and stay in
the journal for another one (or this one restarted) to take over.
"""

from __future__ import annotations

import itertools
import logging

from actor.episodes import (
    Episode,
    EpisodeRunner,
    OpenGroup,
    opened_as,
    publish_open_group,
)
from actor.publish import new_group_id
from actor.room import Room
from actor.stream import Report, open_target
from pipeline.runtime import Pool
from pipeline.telemetry import Window

log = logging.getLogger("actor")


def stream_episodes(
    pool: Pool, engine, runner: EpisodeRunner, tokenizer, rewards: Window, errors, receiver
) -> int:
    """Keep the engine fed with episode turns until stop; publish each group as its
    episodes end. Returns the groups published. (The loops' signature: ``tokenizer``
    and ``errors`` are the runner's own here.)"""
    cfg = pool.cfg
    room, report = Room(pool, engine), Report(pool, engine, receiver, rewards)
    shown, published = [None], [0]

    def next_group() -> OpenGroup | None:
        """A group another actor left in the journal, else a new task's."""
        grp = runner.take_over() or runner.open_group(
            runner.tasks.sample(), cfg.task.group_size, new_group_id(pool)
        )
        if grp is not None:
            opened_as(pool, grp)
        return grp

    def finished(grp: OpenGroup) -> None:
        publish_open_group(pool, runner, grp, rewards)
        published[0] += 1
        room.changed()

    def dropped(grp: OpenGroup) -> None:
        pool.record(event="episode_group", group=grp.group_id, action="dropped")
        if runner.journal is not None and grp.group_id:
            runner.journal.done(grp.group_id)

    def tick(open_now: int) -> None:
        if open_now != shown[0]:
            pool.status.set(episodes_open=open_now)
            shown[0] = open_now
        pool.tick()
        report.tick(published[0], room)

    try:
        drive_episodes(
            engine,
            runner,
            cfg.task.group_size,
            open_target(cfg),
            admit=lambda: room(0),
            finished=finished,
            stop=pool.stop.is_set,
            tick=tick,
            next_group=next_group,
            dropped=dropped,
        )
    finally:
        room.close()
    return published[0]


def drive_episodes(
    engine,
    runner: EpisodeRunner,
    g: int,
    target: int,
    admit,
    finished,
    stop,
    tick,
    next_group=None,
    dropped=lambda grp: None,
):
    """The loop itself: keep up to ``target`` groups of ``g`` episodes open while
    ``admit()`` allows a new one (``next_group()``: the group to open, None when its
    environment failed to reset; default a new task's, without a journal); each
    finished turn's environment step runs on the runner's loop thread while the engine
    goes on; ``finished(group)`` for each group whose episodes all ended (its
    environments closed first), ``dropped(group)`` for one that cannot be published;
    ``tick(open episodes)`` once per pass; until ``stop()``. Open turns are aborted on
    the way out."""
    if next_group is None:

        def next_group():
            return runner.open_group(runner.tasks.sample(), g)

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
                grp = next_group()
                if grp is None:  # its environment's reset raised (logged, counted)
                    continue
                gid = next(keys)
                groups[gid] = grp
                for k, ep in enumerate(grp.episodes):
                    if not ep.done:  # a group taken over: each episode at its own turn
                        submit(gid, k, len(ep.offsets))
            for (gid, k, index), (out,) in engine.take(timeout=0.02):
                turns.discard((gid, k, index))
                if gid not in groups:  # dropped: another of its episodes failed at once
                    continue
                ep = groups[gid].episodes[k]
                turn = runner.take_turn(ep, out, runner.turn_budget(ep), index)
                if turn is not None:  # its environment answers on the loop thread
                    steps[(gid, k)] = (runner.spawn(runner.step(ep, turn)), turn)
            for gid, k, index in turns - engine.held_keys():  # its request failed
                turns.discard((gid, k, index))
                if gid in groups and not end_failed(groups[gid].episodes[k]):
                    log.error("group %s dropped: an episode's first turn failed", gid)
                    grp = groups.pop(gid)
                    runner.call(_close(grp.episodes))
                    dropped(grp)
                    for key in [key for key in steps if key[0] == gid]:
                        del steps[key]
                elif gid in groups:
                    runner.written(groups[gid].episodes[k])
            for (gid, k), (future, turn) in list(steps.items()):
                if not future.done():
                    continue
                del steps[(gid, k)]
                ep = groups[gid].episodes[k]
                runner.apply(ep, turn, future.result(), turn.index >= last_turn)
                if not ep.done:
                    submit(gid, k, turn.index + 1)
            for gid in [gid for gid, grp in groups.items() if all(e.done for e in grp.episodes)]:
                if not any(key[0] == gid for key in steps):
                    grp = groups.pop(gid)
                    runner.call(_close(grp.episodes))
                    finished(grp)
            tick(sum(not e.done for grp in groups.values() for e in grp.episodes))
    finally:
        dropped_turns = engine.abort_open()
        for grp in groups.values():
            runner.call(_close(grp.episodes))
        if groups:
            log.info(
                "stopping: %d unfinished groups (%d turns) aborted; their written turns stay "
                "in the journal",
                len(groups),
                dropped_turns,
            )


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
