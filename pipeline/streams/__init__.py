"""The Redis Streams layer shared by every pool; this package is its one public face.

Topology (names.py: ``<prefix>:<run>:<name>``)::

    actors --rollouts--> preprocessors --batches--> trainer     work streams: read
            (group "preprocessor")     (group "trainer")         through consumer groups,
                                                                 acknowledged, trimmed
                                                                 by consumption
    trainer --weights--> actors      a WeightAnnouncement per version (MAXLEN: the newest
                                     is the one that counts)
    actors  --joins-->   trainer     signed requests to join the weight-transfer group
    consumers --dead-->  operator    entries that did not decode, with the reason

    keys: the run marker, trainer_version, published_version, samples_produced and
    samples_retired (back-pressure), retired_recent, rendezvous, sync_claims, and a
    status hash per pool

With ``redis.mode=cluster`` the work streams (rollouts, batches) are ``redis.shards``
partitions of one Redis Cluster, each under its own hash tag, the control keys under
the run's (shards.py, names.py, cluster.py).

Layout (module: concern)::

    names.py       Names: every stream and key name; DATA, the payload field; entry ids
    errors.py      RedisUnavailable, RedisRefused: Redis unusable at start-up; redact
    connection.py  connect (bounded start-up, reconnect budget, TLS), the ACL probes
                   (check_permissions), wait_until
    sentinel.py    redis.mode=sentinel: the redis+sentinel:// URL, the client that
                   follows a failover, its start-up probe
    cluster.py     redis.mode=cluster: the redis+cluster:// URL, the Redis Cluster
                   client that follows a failover, its start-up probe
    urls.py        the multi-host URLs both read: scheme, credentials, HOST:PORT list
    durable.py     writes that count once replicas have them (WAIT), XADD-once,
                   publish, the Lua script runner
    counters.py    count-once counters: samples_produced, samples_retired (and the
                   trainer's rejected_held, which back-pressure subtracts)
    consumer.py    Consumer: consumer groups, pending recovery and claims, dead
                   letters; the run marker (DataLost)
    trimming.py    trimming what every group has acknowledged
    shards.py      the work streams over cluster partitions (Shards,
                   ShardedConsumer)

Import what a pool needs from here (``from pipeline.streams import Names, connect``);
the partitioning, sentinel, cluster and durable-write machinery from its own module
(``pipeline.streams.shards``, ``.sentinel``, ``.cluster``, ``.durable``).
"""

from pipeline.streams.connection import check_permissions, cli_command, connect, wait_until
from pipeline.streams.consumer import (
    DRAIN_FIELD,
    Consumer,
    DataLost,
    check_run,
    ensure_group,
    mark_run,
)
from pipeline.streams.counters import (
    CORES_CLAIMED,
    REJECTED_HELD,
    add_once,
    count_produced,
    retire_groups,
)
from pipeline.streams.durable import Lua, publish
from pipeline.streams.errors import RedisRefused, RedisUnavailable, redact
from pipeline.streams.names import DATA, SHARDED, Names
from pipeline.streams.trimming import consumed_floor, trim_consumed

__all__ = [
    "CORES_CLAIMED",
    "REJECTED_HELD",
    "DATA",
    "SHARDED",
    "Consumer",
    "DRAIN_FIELD",
    "DataLost",
    "Lua",
    "Names",
    "RedisRefused",
    "RedisUnavailable",
    "add_once",
    "check_permissions",
    "check_run",
    "cli_command",
    "connect",
    "consumed_floor",
    "count_produced",
    "ensure_group",
    "mark_run",
    "publish",
    "redact",
    "retire_groups",
    "trim_consumed",
    "wait_until",
]
