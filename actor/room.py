"""When an actor may start new groups: one :class:`Room` that both actor loops ask,
in both modes (``pipeline.mode=async|sync``).

::

    reads   <run>:samples_produced, <run>:samples_retired, <run>:trainer_version, the
            trainer's status ``rejected_held``,
            the ``drain`` field of <run>:run; sync: <run>:sync_claims (what other
            actors are generating right now), the trainer's status ``state`` (is it
            waiting for data?)
    writes  the status hash while it holds the actor back (``waiting``, ``draining``,
            ``waiting (sync)``); sync: <run>:sync_claims (this actor's claim, released
            after publishing); a ``mode`` record, a ``turn`` metrics record per batch
            (batch loop: wait and generate seconds, mode), and a ``backpressure`` record
            each time a hold of new groups ends (its reason: lag, backlog, cores, drain, sync,
            weights; wait_s)
    blocks  (``wait``, the batch loop) while the run drains; async: while more than
            actor.max_lag versions behind the trainer or while actor.max_queue_groups
            groups are in flight, or while the trainer on this host runs its step on
            idle actors' cores (its status ``cores_claimed``, trainer/cores.py); sync:
            until this actor holds the trainer's current
            version and the step still lacks samples nobody is generating.
            ``room(unpublished)`` (the streaming loop) is the same async bound, asked
            without blocking

In flight: groups produced by every actor and not yet trained, dropped or rejected
(``samples_produced - samples_retired``, less the samples the trainer's unfinished step
already rejected, its status field ``rejected_held``; over the group size). The streaming loop adds
the groups it holds finished in its engine and not published yet (``unpublished``),
which Redis's counters do not know of yet (actor/stream.py).

Sync mode, in phases as in colocated systems: the actors generate exactly
``trainer.samples_per_step`` samples with version v and wait; the preprocessor and
trainer take that step; the trainer publishes v+1; the actors resume once they hold
v+1. Policy lag is 0 by construction. A claim (Lua, atomic across actors) reserves
samples before generating: in flight (produced - retired) plus live claims never
exceed one step. Groups dropped for no signal are retired by the preprocessor, so the
step's shortfall is generated again at the same version. A claim expires after
``launch.watchdog_s`` (an actor that died mid-batch does not block the step); a step
stuck for ``pipeline.sync_stall_s`` with nothing moving (samples lost on the way,
e.g. dead-lettered) is topped up: a step's worth is generated as if those were not in
flight, with a warning. Stuck means: the trainer's status says it waits for data, this
actor cannot claim, and no counter moved.

Draining, in either mode and either loop: while the run's marker hash (``<run>:run``)
has a ``drain`` field, no actor starts a new group; the preprocessors and the trainer
go on until the streams are empty. The faults bench drains before it stops a run, so
nothing is left in flight by the stop itself; the launcher removes the field when it
starts, so a drained run launched again produces.
"""

from __future__ import annotations

import logging
import socket
import time

from pipeline.runtime import Pool, trainer_version
from pipeline.streams import CORES_CLAIMED, DRAIN_FIELD, REJECTED_HELD, Lua

log = logging.getLogger("actor")
ROOM_S = 0.05  # room(): the counters in Redis are read at most this often
HOLD_S = 0.1  # wait(): between two looks while the actor is held back
CLAIM_STALE_S = 10.0  # a trainer's cores claim with an older heartbeat is ignored


def draining(pool: Pool) -> bool:
    """An operator (or the faults bench) asked the actors to stop producing."""
    return pool.client.hget(pool.names.run_marker, DRAIN_FIELD) is not None


def in_flight_groups(pool: Pool) -> float:
    """Groups produced by every actor and not yet trained, dropped or rejected. Samples
    the trainer's unfinished step already rejected (stale, dead-lettered: its status
    field ``rejected_held``) are not in flight, though ``samples_retired`` counts them
    only with the step: counted, they could fill the backlog while the step waits for
    fresh samples, and actor and trainer would wait for each other (seen with 23 stale
    samples held, ``actor.max_queue_groups=8``). The counters are read first: the trainer
    zeroes the field in the script that retires them, so a retirement between the two
    reads counts them twice (a larger backlog), never not at all."""
    names = pool.names
    produced, retired = pool.client.mget(names.samples_produced, names.samples_retired)
    held = pool.client.hget(names.status("trainer"), REJECTED_HELD)
    in_flight = int(produced or 0) - int(retired or 0) - max(int(held or 0), 0)
    return in_flight / pool.cfg.task.group_size


def cores_claimed(pool: Pool, host: str) -> bool:
    """The trainer on this host runs its step on the cores of idle actors
    (``trainer.torch_threads=auto``, trainer/cores.py): no new group until the step ends.
    A claim whose heartbeat is older than CLAIM_STALE_S (a trainer killed mid-step) or
    made on another host holds nobody back."""
    claim, where, beat = pool.client.hmget(
        pool.names.status("trainer"), [CORES_CLAIMED, "host", "heartbeat"]
    )
    if claim != b"1" or (where or b"").decode() != host:
        return False
    return time.time() - float(beat or 0) <= CLAIM_STALE_S


# KEYS: produced, claims hash (the keys it writes)
# ARGV: actor, want, step_samples, now, expires_at, group_size, engine_version, slack,
#       retired, trainer_version (keys it only reads: EVAL's declared keys need write
#       access, which users.acl does not give the actor; the GETs are checked as reads)
# Returns the samples claimed (a multiple of group_size; 0: wait), or -1: not at the
# trainer's version yet. want=0 releases this actor's claim.
_CLAIM = Lua("""
local produced = tonumber(redis.call('GET', KEYS[1]) or '0')
local retired = tonumber(redis.call('GET', ARGV[9]) or '0')
local version = tonumber(redis.call('GET', ARGV[10]) or '0')
local want, g = tonumber(ARGV[2]), tonumber(ARGV[6])
redis.call('HDEL', KEYS[2], ARGV[1])
if want == 0 then return 0 end
if version ~= tonumber(ARGV[7]) then return -1 end
local claimed = 0
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local n, expires = string.match(all[i + 1], '^(%d+):([%d%.]+)$')
  if n and tonumber(expires) > tonumber(ARGV[4]) then claimed = claimed + tonumber(n) end
end
local free = tonumber(ARGV[3]) + tonumber(ARGV[8]) - (produced - retired) - claimed
local n = math.min(want, math.floor(free / g) * g)
if n <= 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], n .. ':' .. ARGV[5])
return n
""")


class Room:
    """Back-pressure, for both loops and both modes (module docstring): the batch loop
    asks :meth:`wait` before each batch and calls :meth:`done` after publishing it; the
    streaming loop (async only) asks ``room(unpublished)`` before each new group and
    calls :meth:`changed` after publishing one. ``behind``, ``backlog`` and ``draining``
    are what it saw last (the actor's status reports them)."""

    def __init__(self, pool: Pool, engine):
        self.pool, self.engine = pool, engine
        self.mode = pool.cfg.pipeline.mode
        names = pool.names
        self.keys = [names.samples_produced, names.sync_claims]
        self.read_keys = [names.samples_retired, names.trainer_version]
        self.checked = 0.0  # when room() last read the counters in Redis
        self.behind, self.published, self.backlog = 0, 0.0, 0.0
        self.draining = False  # the run drains: no new group (draining())
        # the trainer on this host runs its step on this actor's core (cores_claimed())
        self.cores_claimed, self.host = False, socket.gethostname()
        self.waited = 0.0
        self.held: tuple[str, float] | None = None  # (reason, since): new groups held back
        pool.record(event="mode", mode=self.mode)
        pool.status.set(mode=self.mode)

    def _held_back(self, reason: str | None) -> None:
        """Back-pressure: ``reason`` holds new groups back now (None: room again). A
        ``backpressure`` record (reason, wait_s) when a hold ends or its reason changes
        (a backlog hold that turns into a lag hold is two records, each reason with its
        own time: a hold that only changed reasons until the run drained was never
        recorded, and the histogram stayed empty)."""
        now = time.monotonic()
        if self.held is not None and reason != self.held[0]:
            (why, since), self.held = self.held, None
            self.pool.record(event="backpressure", reason=why, wait_s=round(now - since, 4))
        if reason is not None and self.held is None:
            self.held = (reason, now)

    def close(self) -> None:
        """The loop ends (stop): the hold in progress is recorded too, so no held time is
        lost from the histogram."""
        self._held_back(None)

    # -- async: lag and backlog ------------------------------------------------------
    def changed(self) -> None:
        """A group was published: read the counters afresh at the next call."""
        self.checked = 0.0

    def __call__(self, unpublished: int = 0) -> bool:
        """May a new group start now (async)? The counters in Redis are read at most
        every ROOM_S seconds; ``unpublished`` (groups this actor holds finished and not
        published: counted anew at every call, as groups finish in the engine between
        two reads of Redis) is added to the backlog."""
        reason = self._refused(unpublished)
        self._held_back(reason)
        return reason is None

    def _refused(self, unpublished: int) -> str | None:
        """Why no new group may start now (None: it may). Raises when the engine died: an
        actor held back would otherwise tick on (healthy to /health and the watchdog)
        with an engine that can never generate again; exiting lets it be restarted."""
        self.check_engine()
        now = time.monotonic()
        if self.engine.version is None:  # partial weights: nothing may be generated
            return "weights"
        if now - self.checked >= ROOM_S:
            self.checked = now
            self.behind = trainer_version(self.pool) - self.engine.version
            self.published = in_flight_groups(self.pool)
            self.draining = draining(self.pool)
            self.cores_claimed = cores_claimed(self.pool, self.host)
        if self.draining:
            return "drain"
        cfg = self.pool.cfg.actor
        self.backlog = self.published + unpublished
        if self.behind > cfg.max_lag:
            return "lag"
        if self.backlog >= cfg.max_queue_groups:
            return "backlog"
        if self.cores_claimed:
            return "cores"
        return None

    # -- the batch loop: a whole batch at a time -------------------------------------
    def wait(self) -> int:
        """Block until this actor may generate a batch; return the number of prompts
        (sampling.prompts_per_batch; sync: what it could claim; 0: stop)."""
        t0 = time.monotonic()
        prompts = self.pool.cfg.sampling.prompts_per_batch
        if self.mode == "async":
            self._wait_async()
        else:
            self._wait_drained()
            prompts = self._wait_sync(prompts)
        self.waited = time.monotonic() - t0
        return 0 if self.pool.stop.is_set() else prompts

    def check_engine(self) -> None:
        if why := self.engine.dead():
            raise RuntimeError(f"{why}; the actor exits so that it is restarted")

    def _hold(self, **status) -> None:
        """Held back on purpose: say so, and tick (waiting is not a hang)."""
        self.check_engine()
        self.pool.status.set(version=self.engine.version, **status)
        self.pool.tick()
        time.sleep(HOLD_S)

    def _wait_async(self) -> None:
        while not self.pool.stop.is_set():
            self.changed()  # each look reads the counters afresh
            if self(0):
                return
            if self.draining:
                self._hold(state="draining")
            else:
                self._hold(state="waiting", behind=self.behind, backlog=self.backlog)

    def _wait_drained(self) -> None:
        while not self.pool.stop.is_set() and draining(self.pool):
            self.draining = True
            self._held_back("drain")
            self._hold(state="draining")
        self.draining = False
        self._held_back(None)

    # -- sync: a step's worth per version, claimed -----------------------------------
    def _call(self, want: int, slack: int = 0) -> int:
        cfg = self.pool.cfg
        now = time.time()
        args = [self.pool.name, want, cfg.trainer.samples_per_step, now]
        args += [now + max(cfg.launch.watchdog_s, 30.0), cfg.task.group_size]
        args += [-1 if self.engine.version is None else self.engine.version, slack]
        args += self.read_keys
        return int(_CLAIM(self.pool.client, self.keys, args))

    def _wait_sync(self, prompts: int) -> int:
        cfg, pool = self.pool.cfg, self.pool
        g = cfg.task.group_size
        stuck_since, seen, slack = time.monotonic(), None, 0
        while not pool.stop.is_set():
            n = self._call(prompts * g, slack)
            if n > 0:
                self._held_back(None)
                return n // g
            self._held_back("sync")
            # produced, retired, trainer_version
            counters = pool.client.mget([self.keys[0], *self.read_keys])
            trainer, buffered = pool.client.hmget(
                pool.names.status("trainer"), ["state", "buffered_samples"]
            )
            # stuck: the trainer waits for data, this actor waits for room, nothing moves
            state = (n, counters, trainer, buffered)
            if state != seen or trainer != b"waiting for data":
                stuck_since, seen = time.monotonic(), state
            elif n == 0 and time.monotonic() - stuck_since > cfg.pipeline.sync_stall_s:
                # counted in flight but neither in the trainer's buffer nor moving
                in_flight = int(counters[0] or 0) - int(counters[1] or 0) - int(buffered or 0)
                log.warning(
                    "sync: version %s: the trainer has waited %.0fs for samples counted in "
                    "flight (%d) that never came (lost, dead-lettered, or a counter reset); "
                    "generating a step's worth without them",
                    self.engine.version,
                    time.monotonic() - stuck_since,
                    in_flight,
                )
                pool.record(event="sync_stall", version=self.engine.version, in_flight=in_flight)
                slack, stuck_since = max(in_flight, 0), time.monotonic()
            pool.status.set(state="waiting (sync)", version=self.engine.version)
            pool.tick()
            time.sleep(0.02)
        return 0

    def done(self, groups: int, generate_s: float) -> None:
        """After a batch is published: release the claim; record the turn's timings."""
        if self.mode == "sync":
            self._call(0)
        self.pool.record(
            event="turn",
            mode=self.mode,
            groups=groups,
            wait_s=round(self.waited, 4),
            generate_s=round(generate_s, 4),
            version=self.engine.version,
        )
