"""The actor loop without batch boundaries (``pipeline.mode=async``, a streaming engine).

::

    reads   task problems; what actor/room.py reads (lag, backlog, drain: the same Room
            as the batch loop's, asked without blocking); finished groups from the engine
    writes  <run>:rollouts, one entry per group in the order groups finish
            (actor/publish.py); the status hash every second and at each change of
            state; a ``turn`` metrics record every REPORT_S seconds (engine empty:
            wait_s, busy: generate_s)
    blocks  never on a whole batch: a new group is submitted whenever fewer than
            open_target() groups are open and the Room has room (lag <= actor.max_lag,
            backlog < actor.max_queue_groups, the backlog counting the groups finished
            in the engine and not published yet); finished groups are taken as they come

With ``actor.vllm.in_flight`` requests wanted and G completions per group, the actor
keeps 2 * ceil(in_flight / G) unfinished groups in the engine: enough to fill every
slot, and as many whose requests wait for slots (they are not in vLLM yet, and take
their cache salt and version stamps when they start), so when groups finish their
slots are refilled at once, inside the engine, while the actor scores and publishes.
The engine idles only when back-pressure holds new groups back. On stop, open groups
are aborted and never published.

Bound: a group is submitted only while (published, not retired) + (finished, not
published) < max_queue_groups, and at most open_target() are unfinished, so without
retirements at most ``max_queue_groups - 1 + open_target()`` groups are ever published.
A group that has finished in the engine but is not published yet is no longer open and
not yet in Redis's counters; the backlog counts it here, or the actor would refill the
engine past a full backlog while it publishes.
"""

from __future__ import annotations

import itertools
import logging
import time

from actor.publish import publish_group, record_swaps
from actor.room import Room
from pipeline.runtime import Pool
from pipeline.tasks import DEFAULT_SYSTEM_PROMPT, RewardErrors, build_prompt_ids
from pipeline.telemetry import Window

log = logging.getLogger("actor")
REPORT_S = 2.0  # seconds between ``turn`` records


def open_target(cfg) -> int:
    """Unfinished groups kept in the engine: enough to fill every in-flight slot, and as
    many again waiting for slots, so even when every running group finishes in the same
    step the freed slots are refilled at once."""
    return 2 * -(-int(cfg.actor.vllm.in_flight) // int(cfg.task.group_size))


class Report:
    """The status hash every second and a ``turn`` record every REPORT_S seconds."""

    def __init__(self, pool: Pool, engine, receiver, rewards: Window):
        self.pool, self.engine, self.receiver, self.rewards = pool, engine, receiver, rewards
        self.t_status = self.t_turn = time.monotonic()
        self.state = ""
        self.tokens0, self.empty0, self.groups0 = engine.stats.tokens, engine.empty_s(), 0
        self.swaps_seen = (0, 0)  # (swap records, versions) recorded (record_swaps)

    def tick(self, groups: int, room: Room) -> None:
        now = time.monotonic()
        idle = "draining" if room.draining else "waiting"
        state = "generating" if self.engine.open_units else idle
        if state != self.state or now - self.t_status >= 1.0:
            self.status(room, state)
            self.t_status, self.state = now, state
        if now - self.t_turn >= REPORT_S:
            period, empty = now - self.t_turn, self.engine.empty_s()
            wait = min(max(empty - self.empty0, 0.0), period)
            self.pool.record(
                event="turn",
                mode="async",
                groups=groups - self.groups0,
                wait_s=round(wait, 4),
                generate_s=round(period - wait, 4),
                version=self.engine.version,
                tokens_per_s=round((self.engine.stats.tokens - self.tokens0) / period, 1),
            )
            self.swaps_seen = record_swaps(self.pool, self.engine, self.swaps_seen)
            self.t_turn, self.empty0, self.groups0 = now, empty, groups
            self.tokens0 = self.engine.stats.tokens

    def status(self, room: Room, state: str) -> None:
        e = self.engine
        self.pool.status.set(
            state=state,
            version=e.version,
            behind=room.behind,
            backlog=room.backlog,
            tokens=e.stats.tokens,
            in_flight=e.in_flight_now,
            open_groups=e.open_units,
            weight_updates_applied=self.receiver.applied,
            weight_updates_failed=self.receiver.failed,
            reward_mean=self.rewards.mean or 0.0,
            swap_ms_max=round(max(e.stats.swap_ms, default=0.0), 3),
        )


def stream_groups(
    pool: Pool, engine, task, tokenizer, rewards: Window, errors: RewardErrors, receiver
) -> int:
    """Keep the engine fed with groups until stop; publish each as it finishes. Returns
    the groups published."""
    cfg = pool.cfg
    g, target = cfg.task.group_size, open_target(cfg)
    system = DEFAULT_SYSTEM_PROMPT if cfg.task.system_prompt is None else cfg.task.system_prompt
    room, report = Room(pool, engine), Report(pool, engine, receiver, rewards)
    keys, open_groups, published = itertools.count(), {}, 0
    log.info("streaming: %d groups of %d kept open (actor.vllm.in_flight)", target, g)
    try:
        while not pool.stop.is_set():
            # held - open: finished in the engine, not taken and published yet (what take()
            # hands back is published before the next submit; a failed unit is not held)
            while (open_now := engine.open_units) < target and room(engine.held_units - open_now):
                problem = task.sample()
                prompt = build_prompt_ids(tokenizer, problem.question, system)
                key = next(keys)
                open_groups[key] = (problem, prompt)
                engine.submit(key, [prompt] * g, cfg.sampling.max_new_tokens)
            for key, outs in engine.take(timeout=0.05):
                problem, prompt = open_groups.pop(key)
                layout = engine.route_layout
                publish_group(pool, tokenizer, problem, prompt, outs, rewards, errors, layout)
                published += 1
                room.changed()
            pool.tick()
            report.tick(published, room)
    finally:
        room.close()
        dropped = engine.abort_open()
        if dropped:
            log.info("stopping: %d unfinished groups aborted, not published", dropped)
    return published
