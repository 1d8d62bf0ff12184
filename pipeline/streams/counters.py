"""Counters that count once: updates that must not drift when a command is re-sent
after a lost reply (redis-server killed between applying and replying; connect()'s
retry re-sends it).

``samples_produced`` (the actors' groups: :func:`count_produced`, through
:func:`add_once`) and ``samples_retired`` (samples the trainer trained: :func:`add_once`;
groups a preprocessor dropped or dead-lettered: :func:`retire_groups`) are updated by
Lua scripts that remember the last update applied, so a re-send changes nothing; the
actors' back-pressure reads the difference. Every run of a script writes, a repeat included,
so in sentinel and cluster mode the WAIT behind it (durable.py) covers the first attempt.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from pipeline.streams.durable import Lua
from pipeline.streams.names import Names

# The trainer's status field: samples its unfinished step rejected (stale, in
# dead-lettered entries), which samples_retired counts only once the step retires them.
# The actors' back-pressure does not count them as in flight (actor/room.py): a step short
# of fresh samples would otherwise wait for actors that wait for it. The trainer sets it
# while it reads and zeroes it in the add_once that retires them.
REJECTED_HELD = "rejected_held"
# The trainer's status field: 1 while a step runs on cores an idle actor on its host would
# take (trainer.torch_threads=auto, trainer/cores.py); such an actor starts no new group.
CORES_CLAIMED = "cores_claimed"

# KEYS: a counter, a status hash; ARGV: guard field, token, amount, then (field, amount)
# pairs added to the status hash. Applied once per token: the guard field remembers it.
# A repeat re-sets the guard: it writes, so a WAIT behind it covers the first (durable.py).
_ADD_ONCE = Lua("""
if redis.call('HGET', KEYS[2], ARGV[1]) == ARGV[2] then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  return 0
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('INCRBY', KEYS[1], ARGV[3])
for i = 4, #ARGV, 2 do redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1]) end
return 1
""")


def add_once(
    client: redis.Redis,
    counter: str,
    status: str,
    guard: str,
    token: str,
    n: int,
    fields: dict[str, int],
) -> bool:
    """INCRBY ``counter`` by ``n`` and HINCRBY the ``fields`` of the ``status`` hash,
    atomically and once per ``token`` (kept in the hash's ``guard`` field): a call whose
    reply was lost (redis-server killed between applying and replying) is re-sent by
    connect()'s retry, and the re-send changes nothing. False when already applied."""
    args: list[Any] = [guard, token, n]
    for field, by in fields.items():
        args += [field, by]
    return bool(_ADD_ONCE(client, [counter, status], args, f"{counter} += {n} ({token})"))


def count_produced(client: redis.Redis, names: Names, actor: str, group_id: str, n: int) -> bool:
    """Add a published group to ``samples_produced`` (the back-pressure count) and the
    actor's ``groups_produced``, once (:func:`add_once`, the last group counted is the
    token), so the count does not drift up by a group that never comes."""
    status, fields = names.status(actor), {"groups_produced": 1}
    return add_once(
        client, names.samples_produced, status, "last_counted_group", group_id, n, fields
    )


# KEYS: samples_retired, retired_recent; ARGV: now, cap, then (group id, samples) pairs.
_RETIRE_GROUPS = Lua("""
local total = 0
for i = 3, #ARGV, 2 do
  if redis.call('ZADD', KEYS[2], 'NX', ARGV[1], ARGV[i]) == 1 then
    total = total + tonumber(ARGV[i + 1])
  end
end
redis.call('INCRBY', KEYS[1], total)  -- also 0: every run writes (durable.py)
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -tonumber(ARGV[2]) - 1)
return total
""")
RETIRED_RECENT_CAP = 100_000  # groups remembered: far more than a re-read can bring back


def retire_groups(client: redis.Redis, names: Names, groups: list[tuple[str, int]]) -> int:
    """Add the samples of ``groups`` ((group id, samples) pairs a preprocessor dropped or
    dead-lettered) to ``samples_retired``, each group once: a preprocessor restarted
    before acknowledging its read re-reads those groups, another one may claim them,
    and a call whose reply was lost is re-sent; ``retired_recent`` remembers the last
    RETIRED_RECENT_CAP groups retired, so none of these counts a group twice (the
    back-pressure count would drift). Returns the samples newly retired."""
    if not groups:
        return 0
    args: list[Any] = [time.time(), RETIRED_RECENT_CAP]
    for group_id, n in groups:
        args += [group_id, n]
    keys, what = [names.samples_retired, names.retired_recent], f"retiring {len(groups)} groups"
    return int(_RETIRE_GROUPS(client, keys, args, what))
