"""The Redis Streams layer shared by every pool.

Streams are named ``<prefix>:<run>:<name>``. Each entry holds a few plain
fields an operator can read with ``redis-cli XRANGE`` beside the binary
``data`` payload. Consumers read through consumer groups and acknowledge;
an entry that does not decode goes to ``<prefix>:<run>:dead`` with the reason
and is acknowledged, so the consumer goes on. Trimming removes only entries
every group has read and acknowledged.

Counters that must not drift when a command is re-sent after a lost reply
(``samples_produced``, ``samples_retired``) are updated by :class:`Lua` scripts
that remember the last update applied (:func:`add_once`, :func:`retire_groups`);
a work entry published with a token (:func:`publish`) is XADDed once however often it
is re-sent. In sentinel mode these writes and the consumers' XACKs count only once
WAIT says enough replicas have them (pipeline/durable.py).

Sharding (``redis.shards``): the work streams (``rollouts`` and ``batches``)
may live on several independent Redis instances, each with its own consumer
groups; :class:`Shards` holds the clients (shard 0 is the primary, which also
holds every control key, the weight and join streams and the dead letters)
and :class:`ShardedConsumer` reads them all behind the Consumer interface.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from pipeline import durable
from pipeline.durable import Lua
from pipeline.messages import BadEntry, decode
from pipeline.redis_errors import RedisRefused, RedisUnavailable
from pipeline.redis_tls import TLSFiles, explain, is_tls, settled

log = logging.getLogger(__name__)

DATA = b"data"


class Names:
    """Every stream and key name of one run, in one place: ``<prefix>:<run>:<name>``.

    Pools, the launcher, inspect and the benchmarks use these properties, never a
    raw string, so a renamed stream or key changes here only (and in the key
    patterns of deploy/redis/users.acl).
    """

    STREAMS = ("rollouts", "batches", "weights", "joins", "dead")  # every run has these
    ROLLOUTS_GROUP = "preprocessor"  # the consumer group reading rollouts
    BATCHES_GROUP = "trainer"  # the consumer group reading batches

    def __init__(self, prefix: str, run: str):
        self.base = f"{prefix}:{run}"

    def stream(self, name: str) -> str:
        return f"{self.base}:{name}"

    def key(self, name: str) -> str:
        return f"{self.base}:{name}"

    # ---- streams
    @property
    def rollouts(self) -> str:  # actor -> preprocessor: one RolloutGroup per entry
        return self.stream("rollouts")

    @property
    def batches(self) -> str:  # preprocessor -> trainer: one TrainBatch per entry
        return self.stream("batches")

    @property
    def weights(self) -> str:  # trainer -> actors: WeightAnnouncement per version
        return self.stream("weights")

    @property
    def joins(self) -> str:  # actors -> trainer: signed requests to join the transfer group
        return self.stream("joins")

    @property
    def rollouts_once(self) -> str:  # hash: XADD-once token -> entry id (pipeline/durable.py)
        return durable.once_keys(self.rollouts)[0]

    @property
    def batches_once(self) -> str:
        return durable.once_keys(self.batches)[0]

    @property
    def stats(self) -> str:
        return self.stream("stats")

    @property
    def dead(self) -> str:  # entries a consumer could not use, with the reason
        return self.stream("dead")

    # ---- keys
    @property
    def run_marker(self) -> str:  # hash set once per run; its absence means data lost
        return self.key("run")

    @property
    def trainer_version(self) -> str:  # the trainer's optimizer steps (policy version)
        return self.key("trainer_version")

    @property
    def published_version(self) -> str:  # the newest version some actor received
        return self.key("published_version")

    @property
    def samples_produced(self) -> str:  # samples XADDed by every actor (INCRBY)
        return self.key("samples_produced")

    @property
    def samples_retired(self) -> str:  # samples trained, dropped or rejected (INCRBY)
        return self.key("samples_retired")

    @property
    def retired_recent(self) -> str:  # sorted set: groups the preprocessors retired lately
        return self.key("retired_recent")

    @property
    def rendezvous(self) -> str:  # hash: the trainer's transfer address, port, epoch
        return self.key("rendezvous")

    @property
    def sync_claims(self) -> str:  # hash: pipeline.mode=sync claims per actor
        return self.key("sync_claims")

    @property
    def faults_probe(self) -> str:  # pipeline.bench faults: a write timed across a failover
        return self.key("faults_probe")

    def status(self, pool: str) -> str:  # hash: a pool's heartbeat and counters
        return self.key(f"status:{pool}")


def connect(
    url: str,
    attempts: int = 20,
    delay_s: float = 0.25,
    reconnect_s: float = 60.0,
    startup_s: float = 8.0,
    tls: TLSFiles | None = None,
) -> redis.Redis:
    """Connect with bounded retries (``attempts`` tries within ``startup_s`` seconds,
    then :class:`RedisUnavailable` naming the URL, password hidden, and what to
    check); every call has a socket deadline.

    ``rediss://`` URLs speak TLS with ``tls``'s CA, certificate and key (None: from
    ``NONSTOP_REDIS_TLS_CA``/``_CERT``/``_KEY``, pipeline.config.tls_files); a TLS
    mismatch (a plain client at a TLS server, a CA that does not sign the server's
    certificate, a missing client certificate) is :class:`RedisRefused` in one line.

    Once connected, a command that meets a dropped connection (redis-server
    restarting) is retried with exponential backoff for about ``reconnect_s``
    seconds before the error reaches the caller.

    ``redis+sentinel://`` URLs (redis.mode=sentinel; pipeline/sentinel.py) give a client
    of the primary the sentinels name, found again on every reconnect, so it follows a
    failover with the same reconnect budget.
    """
    if _is_sentinel(url):
        return _connect_sentinel(url, startup_s, reconnect_s, tls)
    tls, ssl_kwargs = _tls(url, tls)
    _probe(url, attempts, delay_s, startup_s, tls, ssl_kwargs)
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=max(1, int(reconnect_s / 2)))
    client = redis.Redis.from_url(
        url,
        socket_timeout=30,
        socket_connect_timeout=5,
        health_check_interval=30,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **ssl_kwargs,
    )
    client.ping()
    return client


def _is_sentinel(url: str) -> bool:
    from pipeline.sentinel import is_sentinel

    return is_sentinel(url)


def _connect_sentinel(
    url: str, startup_s: float, reconnect_s: float, tls: TLSFiles | None
) -> redis.Redis:
    """:func:`connect` for a ``redis+sentinel://`` URL (pipeline/sentinel.py)."""
    from pipeline import sentinel

    parsed = sentinel.parse(url)  # ValueError: the form to use
    if tls is not None and (tls.ca or tls.cert):
        raise ValueError(
            f"TLS files ({tls.named('ca')}, ...) given for the sentinel URL {parsed.shown()}: "
            "TLS with sentinels is not built yet; drop them"
        )
    sentinel.probe(parsed, startup_s)
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=max(1, int(reconnect_s / 2)))
    client = sentinel.sentinel_client(
        parsed, retry, socket_timeout=30, socket_connect_timeout=5, health_check_interval=30
    )
    client.ping()
    return client


def _tls(url: str, tls: TLSFiles | None) -> tuple[TLSFiles | None, dict[str, str]]:
    """The TLS files for ``url`` and redis-py's arguments for them ({} for redis://)."""
    if not is_tls(url):
        if tls is not None and (tls.ca or tls.cert):
            raise ValueError(
                f"TLS files ({tls.named('ca')}, ...) given for the plain-text URL "
                f"{_redact(url)}: use rediss:// for TLS, or drop them"
            )
        return None, {}
    if tls is None:
        from pipeline.config import tls_files

        tls = tls_files(None)
    return tls, tls.client_kwargs()


def cli_command(url: str, tls: TLSFiles | None = None) -> str:
    """``redis-cli`` reaching ``url`` (password hidden), with ``--tls --cacert ...``
    for a ``rediss://`` URL (redis-cli's -u takes no TLS files)."""
    base = f"redis-cli -u {_redact(url)}"
    return f"{base} {(tls or TLSFiles()).cli_args()}" if is_tls(url) else base


def _probe(
    url: str,
    attempts: int,
    delay_s: float,
    startup_s: float,
    tls: TLSFiles | None = None,
    ssl_kwargs: dict[str, str] | None = None,
) -> None:
    """PING ``url`` without the run-time retries until it answers or the start-up
    budget is spent: a refused or unanswered connection is tried again, refused
    credentials are not (they will not change), nor a TLS mismatch (redis_tls.explain:
    one line saying what is wrong and how to fix it; an ambiguous one once seen twice)."""
    deadline, last, why = time.monotonic() + startup_s, None, None
    for i in range(attempts):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        probe = redis.Redis.from_url(
            url,
            socket_timeout=min(5.0, left),
            socket_connect_timeout=min(5.0, left),
            **(ssl_kwargs or {}),
        )
        try:
            probe.ping()
            return
        except redis.AuthenticationError as e:
            raise RedisRefused(
                f"redis at {_redact(url)} refused the credentials ({e}): check the user and "
                "password in the URL (redis://USER:PASSWORD@host:port/db) against the "
                "server's ACL (deploy/redis/users.acl)"
            ) from None
        except (redis.ConnectionError, redis.TimeoutError) as e:
            last, seen = e, why
            why = explain(url, e, tls, _redact(url))
            if why is not None and (why == seen or settled(e)):
                raise RedisRefused(why) from None
            log.debug("redis at %s not reachable (%s), try %d/%d", _redact(url), e, i + 1, attempts)
        finally:
            probe.close()
        time.sleep(max(0.0, min(delay_s * 2**i, 2.0, deadline - time.monotonic())))
    if why is not None:
        raise RedisRefused(why)
    raise RedisUnavailable(
        f"cannot reach redis at {_redact(url)} within {startup_s:.0f} s ({last}): check that "
        "redis-server is running there, the host and port in redis.url (or NONSTOP_REDIS_URL), "
        f"any firewall between, and try `{cli_command(url, tls)} ping`"
    )


# what each role writes, probed at start-up against its own keys: (command, Names property)
ROLE_PROBES = {
    "actor": (
        ("XADD", "rollouts"),
        ("EVALSHA", "rollouts"),  # XADD-once (pipeline/durable.py): the stream and
        ("EVALSHA", "rollouts_once"),  # its once keys, as a script's keys (RW)
        ("EVALSHA", "samples_produced"),
    ),
    "preprocessor": (
        ("XADD", "batches"),
        ("EVALSHA", "batches"),
        ("EVALSHA", "batches_once"),
        ("XACK", "rollouts"),
        ("EVALSHA", "rollouts_once"),  # sentinel mode: an XACK's fence field
        ("XADD", "dead"),
        ("EVALSHA", "samples_retired"),
        ("EVALSHA", "retired_recent"),
    ),
    "trainer": (
        ("XADD", "weights"),
        ("XACK", "batches"),
        ("EVALSHA", "batches_once"),  # sentinel mode: an XACK's fence field
        ("XADD", "dead"),
        ("EVALSHA", "samples_retired"),
    ),
}
# each probe changes nothing: XADD with ID 0-0 and XACK of 0-0 in no group fail on their
# arguments, EVALSHA of no script on NOSCRIPT; a missing grant fails first, with NOPERM
_PROBE_ARGS = {
    "XADD": lambda key: (key, "0-0", "probe", "1"),
    "XACK": lambda key: (key, "probe", "0-0"),
    "EVALSHA": lambda key: ("0" * 40, 1, key),
}


SHARDED = ("rollouts", "batches")  # the streams on shards 1.. (pipeline/shards.py)


def check_permissions(
    client: redis.Redis, names: Names, role: str, url: str, shard: bool = False
) -> None:
    """Run each command ``role`` needs once, harmlessly (``_PROBE_ARGS``; Redis checks
    the ACL before the arguments), so a
    user without it stops the pool at start-up with :class:`RedisUnavailable` naming
    the command, the key and deploy/redis/users.acl instead of logging NOPERM later.
    ``shard``: an extra shard, which holds only the sharded work streams."""
    for command, stream in ROLE_PROBES.get(role, ()):
        if shard and stream.removesuffix("_once") not in SHARDED:
            continue
        key = getattr(names, stream)
        args = _PROBE_ARGS[command](key)
        try:
            client.execute_command(command, *args)
        except redis.exceptions.NoPermissionError as e:
            raise RedisRefused(
                f"the redis user of {_redact(url)} may not run {command} on {key} ({e}); the "
                f"{role} needs it: grant +{command.lower()} and that key in the {role} user "
                "of deploy/redis/users.acl (then ACL LOAD) or use a URL with such a user"
            ) from None
        except redis.ResponseError:
            pass  # allowed: the probe's own harmless error (ID 0-0)


def _redact(url: str) -> str:
    if "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


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
    (:func:`pipeline.durable.publish_once`): a re-send of the same token, a retry after
    a lost reply included, returns the first entry's id and adds no copy; in sentinel
    mode it returns once enough replicas have the entry (else NotReplicated).
    ``maxlen`` caps streams whose old entries nobody needs (weight announcements:
    a receiver only acts on the newest); work streams are trimmed by consumption.
    """
    entry: dict[str, Any] = {k: str(v) for k, v in fields.items()}
    entry["data"] = payload
    if token is not None:
        if maxlen is not None:
            raise ValueError("publish: a token (XADD-once) is for work streams, not maxlen")
        return durable.publish_once(client, stream, token, entry)[0]
    return client.xadd(stream, entry, maxlen=maxlen, approximate=maxlen is not None).decode()


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


def ensure_group(client: redis.Redis, stream: str, group: str, start: str = "0") -> None:
    try:
        client.xgroup_create(stream, group, id=start, mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


class DataLost(RuntimeError):
    """The run's Redis came back empty: streams and groups are gone."""


DRAIN_FIELD = "drain"  # in the run marker: set, no actor starts a new group (actor/sync.py)


def run_marker(names: Names) -> str:
    return names.run_marker


def mark_run(client: redis.Redis, names: Names, **info: Any) -> None:
    """Set once per run; its absence later means Redis lost the run's data."""
    client.hsetnx(run_marker(names), "created", str(time.time()))
    if info:
        client.hset(run_marker(names), mapping={k: str(v) for k, v in info.items()})


def check_run(client: redis.Redis, names: Names) -> None:
    if not client.exists(run_marker(names)):
        raise DataLost(
            f"redis has no {run_marker(names)}: the server restarted without the run's data "
            "(AOF missing or a different server). Nothing can be resumed from it; start a "
            "new run or point redis.url at the server that holds this run."
        )


class Consumer:
    """XREADGROUP + XACK with typed decoding and a dead-letter path.

    Recovery: on the first read it re-reads this consumer's own pending
    entries (a restarted process with the same name picks up where it died),
    and every ``claim_every_s`` it XAUTOCLAIMs entries another consumer has
    held for ``claim_idle_s`` (a dead peer). A missing group after a Redis
    restart is recreated when the run's data survived, else DataLost.
    """

    def __init__(
        self,
        client: redis.Redis,
        names: Names,
        stream: str,
        group: str,
        consumer: str,
        cls: type,
        block_ms: int = 1000,
        recover_pending: bool = True,
        claim_idle_s: float = 60.0,
        claim_every_s: float = 10.0,
        dead_maxlen: int = 10000,
        dead_client: redis.Redis | None = None,
        shard: int | None = None,
    ):
        self.client, self.names, self.stream = client, names, stream
        self.dead_client = dead_client or client  # the primary's dead-letter stream
        self.shard = shard  # redis.shards > 1: which shard this consumer reads (dead letters)
        self.group, self.consumer, self.cls, self.block_ms = group, consumer, cls, block_ms
        self.claim_idle_ms, self.claim_every_s = int(claim_idle_s * 1000), claim_every_s
        self.dead_maxlen = dead_maxlen
        self.dead_lettered = 0
        self.claimed = 0
        self._own_pending = recover_pending
        self._next_claim = time.monotonic() + claim_every_s if recover_pending else float("inf")
        ensure_group(client, stream, group)

    def read(self, count: int, wait: bool = True) -> list[tuple[str, Any]]:
        """Up to ``count`` entries (recovered, claimed, then new) as (id, message);
        ``wait=False`` returns at once when nothing waits (no BLOCK)."""
        try:
            entries = self._recover(count) or self._fetch(count, wait)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            check_run(self.client, self.names)
            log.warning("consumer group %s on %s is gone; recreating it", self.group, self.stream)
            ensure_group(self.client, self.stream, self.group)
            return []
        return self._decode(entries)

    def _fetch(self, count: int, wait: bool = True) -> list:
        block = self.block_ms if wait else None  # BLOCK 0 would wait forever: None = no BLOCK
        reply = self.client.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=block
        )
        return [e for _stream, entries in reply or [] for e in entries]

    def _recover(self, count: int) -> list:
        if self._own_pending:
            reply = self.client.xreadgroup(
                self.group, self.consumer, {self.stream: "0"}, count=count
            )
            entries = [e for _s, es in reply or [] for e in es if e[1]]
            if entries:
                log.info("re-reading %d pending entries of %s", len(entries), self.consumer)
                return entries
            self._own_pending = False
        if time.monotonic() >= self._next_claim:
            self._next_claim = time.monotonic() + self.claim_every_s
            reply = self.client.xautoclaim(
                self.stream, self.group, self.consumer, self.claim_idle_ms, count=count
            )
            entries = [e for e in reply[1] if e[1]]
            if entries:
                self.claimed += len(entries)
                log.warning("claimed %d entries a dead consumer left pending", len(entries))
                return entries
        return []

    def _decode(self, entries: list) -> list[tuple[str, Any]]:
        out = []
        for entry_id, fields in entries:
            entry_id = entry_id.decode()
            try:
                if DATA not in fields:
                    raise BadEntry("entry has no 'data' field")
                out.append((entry_id, decode(fields[DATA], self.cls)))
            except BadEntry as e:
                self.dead_letter(entry_id, fields, str(e))
        return out

    def dead_letter(self, entry_id: str, fields: dict, reason: str) -> None:
        log.error("dead-lettering %s %s: %s", self.stream, entry_id, reason)
        entry = {
            "source": self.stream,
            "id": entry_id,
            "consumer": self.consumer,
            "reason": reason,
            "data": fields.get(DATA, b""),
        }
        if self.shard is not None:
            entry["shard"] = str(self.shard)
        for plain in (b"group", b"batch"):  # readable ids, for a payload that does not decode
            if plain in fields:
                entry[plain.decode()] = fields[plain]
        durable.xadd(self.dead_client, self.names.dead, entry, maxlen=self.dead_maxlen)
        self.ack([entry_id])
        self.dead_lettered += 1

    def ack(self, ids: list[str]) -> None:
        if ids:  # with WAIT behind it in sentinel mode (pipeline/durable.py)
            durable.xack(self.client, self.stream, self.group, ids)

    # ---- the position interface ShardedConsumer shares (one shard: plain entry ids)
    def client_for(self, entry_id: str) -> redis.Redis:
        """The Redis holding ``entry_id`` (where its follow-up writes go)."""
        return self.client

    def position(self, previous: str, ids: list[str]) -> str:
        """The read position after ``ids`` (newest entry id), ``previous`` without ids."""
        return ids[-1] if ids else previous

    def set_position(self, position: str) -> None:
        """Deliver again everything after ``position`` (XGROUP SETID)."""
        if "," in position:
            raise ValueError(
                f"read position {position!r} was written with {position.count(',') + 1} "
                "redis.shards but redis.shards=1: resume with the shard count the run was "
                "started with"
            )
        self.client.xgroup_setid(self.stream, self.group, position)

    def trim(self, keep_after: str | None = None) -> int:
        """Trim what every group acknowledged, keeping the entries after ``keep_after``."""
        return trim_consumed(self.client, self.stream, _after(keep_after))


def _after(position: str | None) -> str | None:
    if position is None:
        return None
    ms, seq = _id_tuple(position)
    return f"{ms}-{seq + 1}"


def _id_tuple(entry_id: str | bytes) -> tuple[int, int]:
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def consumed_floor(client: redis.Redis, stream: str) -> str | None:
    """The lowest id some group still needs (unread or pending); None if no group."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return None
    if not groups:
        return None
    floor: tuple[int, int] | None = None
    for g in groups:
        last = _id_tuple(g["last-delivered-id"])
        need = (last[0], last[1] + 1)
        pending = client.xpending(stream, g["name"])
        if pending["pending"]:
            need = min(need, _id_tuple(pending["min"]))
        floor = need if floor is None else min(floor, need)
    return f"{floor[0]}-{floor[1]}"


def trim_consumed(client: redis.Redis, stream: str, keep_from: str | None = None) -> int:
    """XTRIM MINID to what every group has acknowledged (and below ``keep_from``)."""
    floor = consumed_floor(client, stream)
    if floor is None:
        return 0
    if keep_from is not None and _id_tuple(keep_from) < _id_tuple(floor):
        floor = keep_from
    return client.xtrim(stream, minid=floor, approximate=False)


def wait_until(predicate: Callable[[], bool], timeout_s: float, every_s: float = 0.1) -> bool:
    """Poll ``predicate`` until true or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return predicate()
