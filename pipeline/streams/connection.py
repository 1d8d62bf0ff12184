"""Connecting to the run's Redis: :func:`connect` with bounded start-up retries and a
reconnect budget, one clear line for each way it fails (errors.py), and the ACL probes
that stop a pool at start-up when its Redis user lacks a command it needs
(:func:`check_permissions`); :func:`wait_until`, the bounded poll the tools and tests
use to wait for a state of the server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from pipeline.redisd.tls import TLSFiles, explain, is_tls, settled
from pipeline.streams import cluster, sentinel
from pipeline.streams.errors import RedisRefused, RedisUnavailable, redact
from pipeline.streams.names import SHARDED, Names

log = logging.getLogger(__name__)


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

    ``redis+sentinel://`` URLs (redis.mode=sentinel; sentinel.py; ``rediss+sentinel://``
    over TLS with ``tls``'s files, to the sentinels and the nodes) give a client
    of the primary the sentinels name, found again on every reconnect, so it follows a
    failover with the same reconnect budget.

    ``redis+cluster://`` URLs (redis.mode=cluster; cluster.py; ``rediss+cluster://`` over
    TLS) give a Redis Cluster
    client (redis-py's RedisCluster), which follows a failover within the same budget.
    """
    if sentinel.is_sentinel(url):
        return _connect_sentinel(url, startup_s, reconnect_s, tls)
    if cluster.is_cluster(url):
        return _connect_cluster(url, startup_s, reconnect_s, tls)
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


def _connect_sentinel(
    url: str, startup_s: float, reconnect_s: float, tls: TLSFiles | None
) -> redis.Redis:
    """:func:`connect` for a ``redis+sentinel://`` URL (sentinel.py)."""
    parsed = sentinel.parse(url)  # ValueError: the form to use
    parsed.files, _ = _tls(url, tls)
    sentinel.probe(parsed, startup_s)
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=max(1, int(reconnect_s / 2)))
    client = sentinel.sentinel_client(
        parsed, retry, socket_timeout=30, socket_connect_timeout=5, health_check_interval=30
    )
    client.ping()
    return client


def _connect_cluster(
    url: str, startup_s: float, reconnect_s: float, tls: TLSFiles | None
) -> redis.Redis:
    """:func:`connect` for a ``redis+cluster://`` URL (cluster.py)."""
    parsed = cluster.parse(url)  # ValueError: the form to use
    parsed.files, _ = _tls(url, tls)
    cluster.probe(parsed, startup_s)
    client = cluster.cluster_client(parsed, reconnect_s, health_check_interval=30)
    client.ping()
    return client


def _tls(url: str, tls: TLSFiles | None) -> tuple[TLSFiles | None, dict[str, str]]:
    """The TLS files for ``url`` and redis-py's arguments for them ({} for redis://)."""
    if not is_tls(url):
        if tls is not None and (tls.ca or tls.cert):
            raise ValueError(
                f"TLS files ({tls.named('ca')}, ...) given for the plain-text URL "
                f"{redact(url)}: use rediss:// (rediss+sentinel://, rediss+cluster://) for "
                "TLS, or drop them"
            )
        return None, {}
    if tls is None:
        from pipeline.config import tls_files

        tls = tls_files(None)
    return tls, tls.client_kwargs()


def cli_command(url: str, tls: TLSFiles | None = None) -> str:
    """``redis-cli`` reaching ``url`` (password hidden), with ``--tls --cacert ...``
    for a ``rediss://`` URL (redis-cli's -u takes no TLS files)."""
    base = f"redis-cli -u {redact(url)}"
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
                f"redis at {redact(url)} refused the credentials ({e}): check the user and "
                "password in the URL (redis://USER:PASSWORD@host:port/db) against the "
                "server's ACL (deploy/redis/users.acl)"
            ) from None
        except (redis.ConnectionError, redis.TimeoutError) as e:
            last, seen = e, why
            why = explain(url, e, tls, redact(url))
            if why is not None and (why == seen or settled(e)):
                raise RedisRefused(why) from None
            log.debug("redis at %s not reachable (%s), try %d/%d", redact(url), e, i + 1, attempts)
        finally:
            probe.close()
        time.sleep(max(0.0, min(delay_s * 2**i, 2.0, deadline - time.monotonic())))
    if why is not None:
        raise RedisRefused(why)
    raise RedisUnavailable(
        f"cannot reach redis at {redact(url)} within {startup_s:.0f} s ({last}): check that "
        "redis-server is running there, the host and port in redis.url (or NONSTOP_REDIS_URL), "
        f"any firewall between, and try `{cli_command(url, tls)} ping`"
    )


# what each role writes, probed at start-up against its own keys: (command, Names property)
ROLE_PROBES = {
    "actor": (
        ("XADD", "rollouts"),
        ("EVALSHA", "rollouts"),  # XADD-once (durable.py): the stream and
        ("EVALSHA", "rollouts_once"),  # its once keys, as a script's keys (RW)
        ("EVALSHA", "samples_produced"),
        ("EVALSHA", "episode_claims"),  # the episode journal (actor/journal.py)
        ("EVALSHA", "dead"),  # a group the journal refuses whole, dead-lettered once
        ("EVALSHA", "dead_once"),
        ("EVALSHA", "samples_retired"),  # a group too big to publish (publish.py)
        ("EVALSHA", "retired_recent"),
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


def check_permissions(
    client: redis.Redis, names: Names, role: str, url: str, shard: bool = False
) -> None:
    """Run each command ``role`` needs once, harmlessly (``_PROBE_ARGS``; Redis checks
    the ACL before the arguments), so a
    user without it stops the pool at start-up with :class:`RedisUnavailable` naming
    the command, the key and deploy/redis/users.acl instead of logging NOPERM later.
    ``shard``: a cluster partition after the first (``names.part(k)``), whose only keys
    are the partitioned work streams. On a Redis Cluster each probe goes to the node
    serving its key's slot (named in the line); the runtime probes every partition
    (``shard=True`` for 1..), so every primary holding the run's keys is asked."""
    for command, stream in ROLE_PROBES.get(role, ()):
        if shard and stream.removesuffix("_once") not in SHARDED:
            continue
        key = getattr(names, stream)
        args = _PROBE_ARGS[command](key)
        try:
            client.execute_command(command, *args)
        except redis.exceptions.NoPermissionError as e:
            node = client.get_node_from_key(key) if cluster.is_cluster(url) else None
            where = f" (cluster node {node.name})" if node is not None else ""
            raise RedisRefused(
                f"the redis user of {redact(url)}{where} may not run {command} on {key} ({e}); the "
                f"{role} needs it: grant +{command.lower()} and that key in the {role} user "
                "of deploy/redis/users.acl (then ACL LOAD) or use a URL with such a user"
            ) from None
        except redis.ResponseError:
            pass  # allowed: the probe's own harmless error (ID 0-0)


def wait_until(predicate: Callable[[], bool], timeout_s: float, every_s: float = 0.1) -> bool:
    """Poll ``predicate`` until true or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return predicate()
