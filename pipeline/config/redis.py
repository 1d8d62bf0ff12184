"""``redis``: where the run's streams live - one Redis, Sentinel, a Redis Cluster and its
partitions, TLS - and the
checks of those settings. What a process actually connects to (the environment wins
over these settings) is resolved in pipeline/config/env.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.config.checks import check_choice
from pipeline.config.checks import get as _get


@dataclass
class TLSConfig:
    """``redis.tls``: Redis over TLS (pipeline/redisd/tls.py). ``redis.tls=true`` is short
    for ``redis.tls.enabled=true``."""

    # true with no redis.url: the embedded redis-server (redis=ha: the nodes and sentinels;
    # redis=cluster: the nodes, cluster bus included) listens on TLS only, with a CA and
    # server and client certificates made per run in RUN_DIR/redis/tls; with redis.url:
    # the URL must be rediss:// (rediss+sentinel://, rediss+cluster://)
    enabled: bool = False
    # an operator's rediss:// Redis (NONSTOP_REDIS_TLS_CA/_CERT/_KEY override these): the
    # CA file that signs its certificate ("": the system's CAs), and a client certificate
    # and its key when the server asks for one (tls-auth-clients)
    ca: str = ""
    cert: str = ""
    key: str = ""


@dataclass
class RedisConfig:
    url: str | None = None  # None: the launcher starts an embedded redis-server
    prefix: str = "nonstop"
    block_ms: int = 1000  # longest single blocking read
    dead_letter_maxlen: int = 10000
    reconnect_s: float = 60.0  # retry commands this long while redis-server restarts
    claim_idle_s: float = 60.0  # claim entries a consumer has held this long (it died)
    # always: the embedded redis-server fsyncs its AOF before it replies, so every
    # acknowledged XADD/XACK/INCRBY survives a SIGKILL; everysec: faster, a hard
    # kill can lose up to the last second of writes (pipeline/redisd/server.py)
    embedded_appendfsync: str = "always"
    # redis.mode=cluster: the work streams (rollouts, batches) in this many partitions
    # (hash-tagged key sets, pipeline/streams/shards.py) on the one cluster (redis=cluster
    # sets 3); 1 in single and sentinel mode (independent-instance shards were replaced by
    # Redis Cluster: validate_shards says how to move)
    shards: int = 1
    tls: TLSConfig = field(default_factory=TLSConfig)
    # single: one primary (redis://, or the embedded redis-server); sentinel: a primary
    # with replicas found through Redis Sentinel (redis.url=redis+sentinel://..., or
    # redis=ha: the launcher starts a primary, a replica and three sentinels,
    # pipeline/topology/ha.py); cluster: a Redis Cluster (redis.url=redis+cluster://..., or
    # redis=cluster: the launcher starts 3 primaries with a replica each,
    # pipeline/topology/cluster.py), the work streams in redis.shards partitions
    mode: str = "single"
    sentinel_service: str = "nonstop"  # the sentinels' name for the primary (redis=ha)
    # sentinel and cluster mode: a write that creates or retires work counts once WAIT says
    # this many replicas have it, waiting at most wait_timeout_ms (None: 1 in sentinel and
    # cluster mode, else 0)
    min_replicas_acked: int | None = None
    wait_timeout_ms: int = 2000
    # redis=cluster and redis=ha: an ACL file of per-role users (deploy/redis/users.acl)
    # every node the launcher starts loads, with per-run passwords (the sentinels get the
    # same users, allowed only to find the primary); each pool connects as its role's user
    acl_file: str | None = None


REDIS_MODES = ("single", "sentinel", "cluster")


def validate_redis(cfg: Any) -> None:
    """The ``redis`` section: the embedded server's fsync, partitions, TLS and mode."""
    check_choice(cfg, "redis.embedded_appendfsync", ("always", "everysec"))
    validate_shards(cfg)
    validate_tls(cfg)
    validate_mode(cfg)


def validate_mode(cfg: Any) -> None:
    """``redis.mode`` against ``redis.url`` and the settings sentinel mode uses."""
    mode, url = _get(cfg, "redis.mode"), _get(cfg, "redis.url")
    if mode not in REDIS_MODES:
        raise ValueError(f"redis.mode={mode!r} is not supported; use one of {REDIS_MODES}")
    validate_cluster(cfg)
    if mode == "cluster":
        return
    sentinel_url = bool(url) and url.split("://", 1)[0].endswith("+sentinel")
    if mode == "sentinel" and url and not sentinel_url:
        raise ValueError(
            "redis.mode=sentinel needs redis.url=redis[s]+sentinel://[USER:PASSWORD@]HOST:PORT,"
            "HOST:PORT,.../SERVICE[/DB] (the sentinels, not a node), or no redis.url "
            "(redis=ha starts a local one)"
        )
    if url and url.split("://", 1)[0].endswith("+cluster"):
        raise ValueError(
            f"redis.url is a redis+cluster:// URL but redis.mode={mode}: set "
            "redis.mode=cluster (or redis=cluster), or give a redis:// URL"
        )
    if mode == "single" and sentinel_url:
        raise ValueError(
            "redis.url is a redis+sentinel:// URL but redis.mode=single: set "
            "redis.mode=sentinel (or redis=ha), or give a redis:// URL"
        )
    if mode == "sentinel" and _get(cfg, "redis.shards") != 1:
        raise ValueError(
            "redis.shards > 1 is not supported with redis.mode=sentinel (it is the partition "
            "count of a Redis Cluster): use redis.shards=1, or redis=cluster"
        )
    service = _get(cfg, "redis.sentinel_service")
    if not service or "/" in service or " " in service:
        raise ValueError(f"redis.sentinel_service={service!r} must be a name without '/' or spaces")
    acked = _get(cfg, "redis.min_replicas_acked")
    if acked is not None and (not isinstance(acked, int) or acked < 0):
        raise ValueError(f"redis.min_replicas_acked={acked!r} must be an integer >= 0")
    if mode == "single" and acked:
        raise ValueError(
            f"redis.min_replicas_acked={acked} needs replicas: set redis.mode=sentinel "
            "(or redis=ha), or drop it"
        )
    if _get(cfg, "redis.wait_timeout_ms") <= 0:
        raise ValueError(
            f"redis.wait_timeout_ms={_get(cfg, 'redis.wait_timeout_ms')} must be > 0 "
            "(how long a write waits for replicas)"
        )


def validate_cluster(cfg: Any) -> None:
    """``redis.mode=cluster`` (pipeline/streams/cluster.py): a redis+cluster:// URL or none
    (redis=cluster), ``redis.shards`` partitions; WAIT settings."""
    url = _get(cfg, "redis.url")
    if _get(cfg, "redis.acl_file") and (_get(cfg, "redis.mode") == "single" or url):
        raise ValueError(
            "redis.acl_file is for redis=cluster and redis=ha (the nodes and sentinels the "
            "launcher starts); a Redis of your own loads its ACL itself (aclfile, "
            "deploy/redis/users.acl; NONSTOP_REDIS_ACL_FILE in deploy/bin/nonstop-redis-start "
            "and nonstop-sentinel-start) and each pool takes its user's URL from "
            "NONSTOP_REDIS_URL_<ROLE>: drop redis.acl_file"
        )
    if _get(cfg, "redis.mode") != "cluster":
        return
    if url and not url.split("://", 1)[0].endswith("+cluster"):
        raise ValueError(
            "redis.mode=cluster needs redis.url=redis[s]+cluster://[USER:PASSWORD@]HOST:PORT,"
            "HOST:PORT,.../ (cluster nodes), or no redis.url (redis=cluster starts a local one)"
        )
    acked = _get(cfg, "redis.min_replicas_acked")
    if acked is not None and (not isinstance(acked, int) or acked < 0):
        raise ValueError(f"redis.min_replicas_acked={acked!r} must be an integer >= 0")
    if _get(cfg, "redis.wait_timeout_ms") <= 0:
        raise ValueError(
            f"redis.wait_timeout_ms={_get(cfg, 'redis.wait_timeout_ms')} must be > 0 "
            "(how long a write waits for replicas)"
        )
    run = str(_get(cfg, "run.name"))
    if "{" in run or "}" in run:
        raise ValueError(
            f"run.name={run!r} may not contain '{{' or '}}' with redis.mode=cluster: the key "
            "names carry the run as a hash tag; rename the run"
        )


def min_replicas_acked(cfg: Any) -> int:
    """The replicas a work write waits for with WAIT: ``redis.min_replicas_acked``, or
    1 in sentinel and cluster mode and 0 (no WAIT) in single mode when it is not set."""
    acked = _get(cfg, "redis.min_replicas_acked")
    if acked is not None:
        return acked
    return 1 if _get(cfg, "redis.mode") in ("sentinel", "cluster") else 0


MIGRATE_SHARDS = (
    "independent-instance shards were replaced by Redis Cluster; use redis=cluster (a local "
    "cluster) or redis.mode=cluster with redis.url=redis+cluster://... (redis.shards stays "
    "the partition count); see deploy/README.md 'Redis Cluster', migrating from shards"
)


def validate_shards(cfg: Any) -> None:
    """``redis.shards``: the partitions of a Redis Cluster (pipeline/streams/shards.py);
    more than 1 with redis.mode=single is refused with :data:`MIGRATE_SHARDS`."""
    n = _get(cfg, "redis.shards")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"redis.shards={n!r} must be an integer >= 1 (1: no partitions)")
    if n > 1 and _get(cfg, "redis.mode") == "single":
        raise ValueError(f"redis.shards={n} with redis.mode=single: {MIGRATE_SHARDS}")


def validate_tls(cfg: Any) -> None:
    """``redis.tls`` on its own (against the URL a process uses: pipeline/config/env.py's
    ``redis_tls``; the embedded server: :func:`check_embedded_tls`; the files:
    ``tls_files``)."""
    tls = _get(cfg, "redis.tls")
    if not isinstance(tls.enabled, bool):
        raise ValueError(f"redis.tls.enabled={tls.enabled!r} must be true or false")
    if bool(tls.cert) != bool(tls.key):
        only = "redis.tls.cert" if tls.cert else "redis.tls.key"
        raise ValueError(
            "redis.tls.cert and redis.tls.key go together (a client certificate and its "
            f"private key); only {only} is set: set both, or neither"
        )


def check_embedded_tls(cfg: Any) -> None:
    """The launcher starts the embedded redis-server (no ``redis.url``): it makes its own
    TLS files, so ``redis.tls.ca``/``cert``/``key`` would go unused."""
    given = [k for k in ("redis.tls.ca", "redis.tls.cert", "redis.tls.key") if _get(cfg, k)]
    if given:
        raise ValueError(
            f"{', '.join(given)} name files for an external Redis (redis.url=rediss://"
            "host:port/0); the embedded redis-server makes its own CA and certificates "
            "per run with redis.tls=true: drop them, or set redis.url"
        )
