"""When an actor may generate: ``pipeline.mode=async`` (back-pressure only) or
``pipeline.mode=sync`` (one trainer step's worth of groups per policy version).

::

    reads   <run>:samples_produced, <run>:samples_retired, <run>:trainer_version,
            <run>:sync_claims (sync: what other actors are generating right now),
            the trainer's status ``state`` (sync: is it waiting for data?), the
            ``drain`` field of <run>:run
    writes  <run>:sync_claims (sync: this actor's claim, released after publishing);
            a ``turn`` metrics record per batch (wait and generate seconds, mode)
    blocks  while the run drains; async: while behind or backlogged (actor.main.wait_for_room);
            sync: until this actor holds the trainer's current version and the
            step still lacks samples nobody is generating

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

Draining, in either mode: while the run's marker hash (``<run>:run``) has a ``drain``
field, no actor starts a new group (the streaming loop's Room holds too); the
preprocessors and the trainer go on until the streams are empty. The faults bench
drains before it stops a run, so nothing is left in flight by the stop itself; the
launcher removes the field when it starts, so a drained run launched again produces.
"""

from __future__ import annotations

import logging
import time

from pipeline.runtime import Pool
from pipeline.streams import Lua

log = logging.getLogger("actor")
DRAIN_FIELD = "drain"  # in <run>:run: set, no actor starts a new group


def draining(pool: Pool) -> bool:
    """An operator (or the faults bench) asked the actors to stop producing."""
    return pool.client.hget(pool.names.run_marker, DRAIN_FIELD) is not None


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


class Turns:
    """The actor loop's gate: how many prompts it may generate now."""

    def __init__(self, pool: Pool, engine, wait_for_room):
        self.pool, self.engine, self.wait_for_room = pool, engine, wait_for_room
        self.mode = pool.cfg.pipeline.mode
        names = pool.names
        self.keys = [names.samples_produced, names.sync_claims]
        self.read_keys = [names.samples_retired, names.trainer_version]
        self.waited = 0.0
        pool.record(event="mode", mode=self.mode)
        pool.status.set(mode=self.mode)

    def _call(self, want: int, slack: int = 0) -> int:
        cfg = self.pool.cfg
        now = time.time()
        args = [self.pool.name, want, cfg.trainer.samples_per_step, now]
        args += [now + max(cfg.launch.watchdog_s, 30.0), cfg.task.group_size]
        args += [-1 if self.engine.version is None else self.engine.version, slack]
        args += self.read_keys
        return int(_CLAIM(self.pool.client, self.keys, args))

    def wait(self) -> int:
        """Block until this actor may generate; return the number of prompts (0: stop)."""
        t0 = time.monotonic()
        prompts = self.pool.cfg.sampling.prompts_per_batch
        while not self.pool.stop.is_set() and draining(self.pool):
            self.pool.status.set(state="draining", version=self.engine.version)
            self.pool.tick()  # waiting on purpose is not a hang
            time.sleep(0.1)
        if self.mode == "async":
            self.wait_for_room(self.pool, self.engine)
        else:
            prompts = self._wait_sync(prompts)
        self.waited = time.monotonic() - t0
        return 0 if self.pool.stop.is_set() else prompts

    def _wait_sync(self, prompts: int) -> int:
        cfg, pool = self.pool.cfg, self.pool
        g = cfg.task.group_size
        stuck_since, seen, slack = time.monotonic(), None, 0
        while not pool.stop.is_set():
            n = self._call(prompts * g, slack)
            if n > 0:
                return n // g
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
