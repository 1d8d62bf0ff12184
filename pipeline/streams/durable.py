"""Writes that count once replicas have them, and entries published once per token.

::

    redis.mode=sentinel  ->  a write that creates or retires work (a rollouts or batches
                             XADD, an XACK, the count-once counters, the trainer's
                             version) is sent in one pipeline with ``WAIT replicas
                             timeout`` behind it, on one connection, and counts only
                             once WAIT says ``redis.min_replicas_acked`` replicas have it
    redis.mode=cluster   ->  the same as sentinel mode, the pipeline sent to the primary
                             serving the write's slot on a connection of that node
                             (:meth:`Durability.write`), redirections and a failover
                             retried within the same budget
    redis.mode=single    ->  the same commands, no pipeline around them, no WAIT

**WAIT** covers the writes made earlier *on the same connection*, and redis-py's
client takes any pooled connection for each command: a write and a separate
``client.wait()`` may go out on two connections, and the WAIT then proves nothing.
:meth:`Durability.write` therefore queues the write and its WAIT in one
``pipeline(transaction=False)``, which holds one connection for both. A WAIT that
falls short (a replica down or lagging) re-sends the write with its WAIT until
``give_up_s`` has passed, then raises :class:`NotReplicated`: the write is never
counted as safe. Re-sending is harmless because every durable write is idempotent
(:func:`publish_once`, XACK, the count-once scripts of counters.py, SET), and
it is needed: a re-send may land on another connection (redis-py reconnects after a
lost reply, a failover moves the primary). Each re-send also *writes* something (the
scripts re-set their guard, an XACK sets its stream's ``~acked`` fence field), so the
connection's WAIT offset covers the first attempt's effect on servers that advance it
only for writes that propagate (Redis 7.0 advances it for every command).

**XADD-once** (:func:`publish_once`): a Lua script XADDs an entry once per token and
returns the first entry's id for every later send of that token, so a re-sent XADD
(its reply lost when the primary died, or its WAIT fell short) never makes a second
copy. The token's entry id is kept in the hash ``<stream>:once`` (token -> id) and the
tokens in arrival order in the list ``<stream>:once:order``; past ``ONCE_CAP`` tokens
the oldest is forgotten (a re-send comes within seconds: reconnect_s, give_up_s).
Both keys are named from the stream's name by appending a suffix, so a stream name
with a Redis Cluster hash tag (``{...}``) gives them the same tag and the same slot,
as a script's keys must share one (:func:`once_keys`; redis.mode=cluster tags the work
streams' names, pipeline/streams/names.py). Tokens: a rollout group's id; a preprocessor batch's id,
derived from its sample ids (preprocessor/main.py). They may not start with ``~``
(the fence fields). :func:`publish` is the pools' XADD: with a token it is XADD-once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.client import Pipeline
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

log = logging.getLogger(__name__)

ONCE_CAP = 100_000  # tokens remembered per stream: far more than a re-send can need
FENCE = "~acked"  # the field of <stream>:once an XACK re-sets (no token starts with ~)


class NotReplicated(RuntimeError):
    """A durable write whose WAIT never saw enough replicas within ``give_up_s``: it
    may be on the primary only, and is not counted. One line for the operator."""

    def __init__(self, what: str, acked: int, needed: int, timeout_ms: int, tries: int):
        self.what, self.acked, self.needed = what, acked, needed
        super().__init__(
            f"{what} is not replicated: WAIT saw {acked} of the {needed} replica(s) "
            f"redis.min_replicas_acked asks for ({tries} tries of {timeout_ms} ms); "
            "not counted. Check that the replicas are up and attached (`redis-cli INFO "
            "replication` on the primary: connected_slaves, each replica's lag), and that "
            "redis.min_replicas_acked is not more than the replicas the primary has"
        )


class Lua:
    """A Lua script run with EVALSHA, and EVAL when the server does not have it cached
    (after a restart, or the first time). Unlike redis-py's ``register_script`` it never
    sends SCRIPT LOAD, which deploy/redis/users.acl does not grant the pools (+eval and
    +evalsha only: SCRIPT also flushes and kills). A call goes through the client's
    :class:`Durability` (WAIT behind it in sentinel and cluster mode); every script a durable write
    runs must write something each time it runs, a repeat included (see the module)."""

    def __init__(self, source: str):
        self.source, self.sha = source, hashlib.sha1(source.encode()).hexdigest()

    def queue(self, pipe: Pipeline, keys: list[str], args: list[Any], cached: bool) -> None:
        if cached:
            pipe.evalsha(self.sha, len(keys), *keys, *args)
        else:
            pipe.eval(self.source, len(keys), *keys, *args)

    def __call__(
        self, client: redis.Redis, keys: list[str], args: list[Any], what: str = ""
    ) -> Any:
        durability = policy_of(client)
        if not durability.replicas:  # single mode: as it always was, nothing around it
            try:
                return client.evalsha(self.sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                return client.eval(self.source, len(keys), *keys, *args)
        what = what or f"a script on {keys[0]}"
        queue = lambda p, c: self.queue(p, keys, args, c)  # noqa: E731
        return durability.write(client, what, queue, key=keys[0])[0]


@dataclass(frozen=True)
class Durability:
    """How a pool's work writes wait for replicas: ``replicas`` 0 sends no WAIT at all
    (single mode); else each waits up to ``timeout_ms`` per try, tries again until
    ``give_up_s`` has passed, then raises :class:`NotReplicated`. ``stop``: the pool's
    StopEvent (pipeline/stopping.py); once it is set, a write tries only for what is
    left of its final-writes budget (at least once)."""

    replicas: int = 0
    timeout_ms: int = 2000
    give_up_s: float = 60.0
    stop: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 0:
            raise ValueError(f"redis.min_replicas_acked={self.replicas!r} must be an integer >= 0")
        if not 0 < self.timeout_ms <= 20_000:
            raise ValueError(
                f"redis.wait_timeout_ms={self.timeout_ms} must be in 1..20000: WAIT 0 waits "
                "forever, and a WAIT past the client's 30 s socket deadline is cut off"
            )

    @classmethod
    def from_config(cls, cfg: Any, stop: Any = None) -> Durability:
        """From the run's config: ``redis.min_replicas_acked`` (config.min_replicas_acked:
        1 in sentinel and cluster mode unless set, 0 in single mode), ``redis.wait_timeout_ms``, and
        ``redis.reconnect_s`` as the time a write keeps trying."""
        from pipeline.config import min_replicas_acked

        return cls(
            replicas=min_replicas_acked(cfg),
            timeout_ms=int(cfg.redis.wait_timeout_ms),
            give_up_s=float(cfg.redis.reconnect_s),
            stop=stop,
        )

    def _out_of_time(self, deadline: float) -> bool:
        now = time.monotonic()
        left = getattr(self.stop, "left", None)  # a StopEvent: inf until the stop
        return now >= deadline or (left is not None and left() <= 0)

    def write(
        self,
        client: redis.Redis,
        what: str,
        queue: Callable[[Pipeline, bool], None],
        key: str | None = None,
    ) -> list[Any]:
        """Queue the write's commands (``queue(pipe, cached)``: ``cached`` False means
        send scripts with EVAL, the server lost its script cache) and ``WAIT`` behind
        them, run them on one connection, and return the write's replies once enough
        replicas have it (at once with ``replicas`` 0, which sends no WAIT).

        A Redis Cluster client (redis.mode=cluster): the pipeline goes to the primary
        serving ``key``'s slot, on a connection of that node (a cluster pipeline would
        send a keyless WAIT to any node); a dropped connection or a redirection (MOVED,
        ASK, CLUSTERDOWN, TRYAGAIN: a failover moved the slot) reads the slot map again
        and sends the write again, until ``give_up_s`` has passed."""
        deadline = time.monotonic() + self.give_up_s
        cached, tries, acked = True, 0, 0
        cluster = isinstance(client, RedisCluster) and key is not None
        while True:
            target = _slot_node(client, key) if cluster else client
            pipe = target.pipeline(transaction=False)
            queue(pipe, cached)
            n = len(pipe)
            if self.replicas:
                pipe.wait(self.replicas, self.timeout_ms)
            try:
                replies = pipe.execute(raise_on_error=False)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if not cluster:
                    raise  # the client's own retry budget is spent
                self._moved(client, what, e, deadline)
                continue
            moved = next((r for r in replies if isinstance(r, _MOVED)), None)
            if cluster and moved is not None:
                self._moved(client, what, moved, deadline)
                continue
            written = replies[:n]
            if cached and any(isinstance(r, redis.exceptions.NoScriptError) for r in written):
                cached = False  # the WAIT ran on nothing new: send the script itself
                continue
            refused = next((r for r in written if isinstance(r, redis.ResponseError)), None)
            if refused is not None and not (self.replicas and _noreplicas(refused)):
                raise refused
            if not self.replicas:
                return written
            tries += 1
            if isinstance(replies[n], redis.ResponseError):  # WAIT itself refused (a replica)
                raise replies[n]
            acked = 0 if refused is not None else int(replies[n])
            if acked >= self.replicas:
                return written
            if self._out_of_time(deadline):
                raise NotReplicated(what, acked, self.replicas, self.timeout_ms, tries)
            log.warning(
                "%s: WAIT saw %d of %d replica(s) within %d ms%s; sending it again",
                what,
                acked,
                self.replicas,
                self.timeout_ms,
                " (the primary refused it: NOREPLICAS)" if refused is not None else "",
            )

    def _moved(self, client: RedisCluster, what: str, error: Exception, deadline: float) -> None:
        """A cluster write met a dead node or a redirection: raise ``error`` when out of
        time, else read the slot map again and wait a little (a failover takes seconds)."""
        if self._out_of_time(deadline):
            raise error
        log.warning("%s: %s; reading the cluster's slot map again", what, error)
        with contextlib.suppress(redis.RedisError, RedisClusterException):
            client.nodes_manager.initialize()
        left = getattr(self.stop, "left", None)
        pause = min(0.25, max(0.0, deadline - time.monotonic()))
        time.sleep(min(pause, left()) if left is not None else pause)


# a cluster node's answer that the slot is served elsewhere, or not at the moment
_MOVED = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
)


def _slot_node(client: RedisCluster, key: str) -> redis.Redis:
    """The plain client of the primary serving ``key``'s slot (its own connections)."""
    return client.get_redis_connection(client.get_node_from_key(key))


def _noreplicas(error: redis.ResponseError) -> bool:
    """The primary refused a write for want of replicas (``min-replicas-to-write``)."""
    return "NOREPLICAS" in str(error)


SINGLE = Durability()
_POLICIES: weakref.WeakKeyDictionary[redis.Redis, Durability] = weakref.WeakKeyDictionary()


def attach(client: redis.Redis, durability: Durability) -> redis.Redis:
    """Make ``client``'s work writes follow ``durability`` (pipeline/runtime.py does it
    for every pool's clients); returns the client."""
    _POLICIES[client] = durability
    return client


def policy_of(client: redis.Redis) -> Durability:
    """The client's :class:`Durability`; a client nobody attached one to (the launcher's,
    a test's, a tool's) writes as in single mode."""
    return _POLICIES.get(client, SINGLE)


# ---- XADD-once

# KEYS: the stream, <stream>:once, <stream>:once:order; ARGV: token, cap, field/value pairs
_XADD_ONCE = Lua("""
local id = redis.call('HGET', KEYS[2], ARGV[1])
if id then
  redis.call('HSET', KEYS[2], ARGV[1], id)  -- a re-send writes too (module docstring)
  return {id, 0}
end
id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
redis.call('HSET', KEYS[2], ARGV[1], id)
redis.call('RPUSH', KEYS[3], ARGV[1])
if redis.call('LLEN', KEYS[3]) > tonumber(ARGV[2]) then
  redis.call('HDEL', KEYS[2], redis.call('LPOP', KEYS[3]))
end
return {id, 1}
""")


def once_keys(stream: str) -> tuple[str, str]:
    """``<stream>:once`` (token -> entry id) and ``<stream>:once:order`` (tokens, oldest
    first): the stream's name with a suffix, so any hash tag in it carries over."""
    return f"{stream}:once", f"{stream}:once:order"


def publish_once(
    client: redis.Redis, stream: str, token: str, entry: dict[str, Any], cap: int = ONCE_CAP
) -> tuple[str, bool]:
    """XADD ``entry`` to ``stream`` unless ``token`` was published there already:
    (entry id, True) for a new entry, (the first entry's id, False) for a re-send. In
    sentinel and cluster mode it returns once WAIT saw enough replicas (else NotReplicated)."""
    if not token or token.startswith("~"):
        raise ValueError(f"publish token {token!r} must be non-empty and not start with '~'")
    args: list[Any] = [token, cap]
    for name, value in entry.items():
        args += [name, value]
    reply = _XADD_ONCE(client, [stream, *once_keys(stream)], args, f"XADD {token} to {stream}")
    entry_id, new = reply
    return (entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)), bool(new)


def publish(
    client: redis.Redis,
    stream: str,
    payload: bytes,
    maxlen: int | None = None,
    token: str | None = None,
    **fields: Any,
) -> str:
    """XADD ``payload`` with readable plain ``fields`` beside it; returns the entry id.

    ``token`` (work entries: a group's or a batch's id): XADD-once
    (:func:`publish_once`): a re-send of the same token, a retry after
    a lost reply included, returns the first entry's id and adds no copy; in sentinel
    and cluster mode it returns once enough replicas have the entry (else NotReplicated).
    ``maxlen`` caps streams whose old entries nobody needs (weight announcements:
    a receiver only acts on the newest); work streams are trimmed by consumption.
    """
    entry: dict[str, Any] = {k: str(v) for k, v in fields.items()}
    entry["data"] = payload
    if token is not None:
        if maxlen is not None:
            raise ValueError("publish: a token (XADD-once) is for work streams, not maxlen")
        return publish_once(client, stream, token, entry)[0]
    return client.xadd(stream, entry, maxlen=maxlen, approximate=maxlen is not None).decode()


# ---- durable forms of plain commands (single mode: the plain command)


def xack(client: redis.Redis, stream: str, group: str, ids: list[str]) -> int:
    """XACK ``ids``; in sentinel and cluster mode with a fence (``<stream>:once`` field ``~acked``
    set to the last id: a repeated XACK changes nothing, the fence still writes) and
    WAIT behind it, in one pipeline."""
    durability = policy_of(client)
    if not durability.replicas:
        return client.xack(stream, group, *ids)

    def queue(pipe: Pipeline, _cached: bool) -> None:
        pipe.xack(stream, group, *ids)
        pipe.hset(once_keys(stream)[0], FENCE, f"{group}:{ids[-1]}")

    return durability.write(client, f"XACK of {len(ids)} entries on {stream}", queue, stream)[0]


def xadd(client: redis.Redis, stream: str, entry: dict[str, Any], maxlen: int | None = None) -> str:
    """A plain XADD (a new entry each time: for entries whose copy is harmless, the
    dead letters), with WAIT behind it in sentinel and cluster mode."""
    durability = policy_of(client)
    approximate = maxlen is not None
    if not durability.replicas:
        reply = client.xadd(stream, entry, maxlen=maxlen, approximate=approximate)
    else:
        reply = durability.write(
            client,
            f"XADD to {stream}",
            lambda p, _c: p.xadd(stream, entry, maxlen=maxlen, approximate=approximate),
            stream,
        )[0]
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def set_value(client: redis.Redis, key: str, value: Any) -> None:
    """SET ``key``, with WAIT behind it in sentinel and cluster mode (the trainer's version)."""
    durability = policy_of(client)
    if not durability.replicas:
        client.set(key, value)
        return
    durability.write(client, f"SET {key}", lambda p, _c: p.set(key, value), key)
