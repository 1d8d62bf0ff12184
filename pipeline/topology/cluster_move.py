"""Move a partition of a live run to another primary of its Redis Cluster.

::

    python -m pipeline.topology.cluster_move --run NAME --partition K --to HOST:PORT
        [--url redis+cluster://ADMIN:PASS@H:P,.../ | NONSTOP_REDIS_URL] [--prefix nonstop]

A partition (``redis.mode=cluster``, pipeline/streams/names.py) is one hash slot: its
``rollouts`` and ``batches`` streams, their consumer groups and pending entries, and
their XADD-once keys, all tagged ``{<run>.p<k>}``. Moving it is Redis's own slot
migration, one slot, while the pools run:

1. the target primary is told it is ``IMPORTING`` the slot, the source that it is
   ``MIGRATING`` it;
2. the source ``MIGRATE``\\ s the slot's keys to the target, a batch at a time (each key
   atomically, with its consumer groups);
3. every primary is told the slot's new owner (``CLUSTER SETSLOT ... NODE``), the target
   first, and the replicas learn it from their primaries.

Meanwhile the pools' commands on the slot are redirected (ASK: the key has moved;
TRYAGAIN: a script's keys are split between the two) and, once it is done, MOVED; the
pools' client reads the slot map again and sends the write again (its redis.reconnect_s
budget, pipeline/streams/durable.py), so nothing is lost or written twice
(tests/test_redis_cluster.py moves a partition under a writer and a consumer group).

The URL's user must be allowed ``CLUSTER SETSLOT``, ``CLUSTER GETKEYSINSLOT``,
``CLUSTER MYID`` and ``MIGRATE``: an operator's admin user, not a pool's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import redis
from redis.cluster import RedisCluster

from pipeline.streams import Names, RedisRefused, RedisUnavailable, connect
from pipeline.topology.cluster import node_id

BATCH = 100  # keys per MIGRATE


def move_slot(
    client,
    slot: int,
    to: str,
    timeout_ms: int = 10_000,
    batch: int = BATCH,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[str, int]:
    """Move ``slot`` to the primary ``to`` (HOST:PORT) of the cluster ``client`` (a
    redis.cluster.RedisCluster), ``batch`` keys per MIGRATE, calling ``on_batch(keys
    moved so far)`` after each; returns (the source primary, the keys moved). A
    ValueError names a target that is not a primary, or the slot's owner already."""
    client.nodes_manager.initialize()  # the current slot map
    source = client.nodes_manager.get_node_from_slot(slot)
    primaries = {n.name: n for n in client.get_primaries()}
    if to not in primaries:
        raise ValueError(
            f"--to {to} is not a primary of this cluster (primaries: "
            f"{', '.join(sorted(primaries))}); `redis-cli -c ... cluster nodes` lists them"
        )
    if to == source.name:
        raise ValueError(f"slot {slot} is on {to} already: nothing to move")
    target = primaries[to]
    src, dst = client.get_redis_connection(source), client.get_redis_connection(target)
    src_id, dst_id = node_id(src), node_id(dst)
    kwargs = client.nodes_manager.connection_kwargs
    user, password = kwargs.get("username"), kwargs.get("password")
    auth = ["AUTH2", user, password] if user else ["AUTH", password] if password else []
    dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    moved = 0
    while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, batch):
        src.execute_command(
            "MIGRATE", target.host, target.port, "", 0, timeout_ms, *auth, "KEYS", *keys
        )
        moved += len(keys)
        if on_batch is not None:
            on_batch(moved)
    for node in [target, source, *(n for n in primaries.values() if n not in (target, source))]:
        client.get_redis_connection(node).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    client.nodes_manager.initialize()
    return source.name, moved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.topology.cluster_move", description=__doc__
    )
    p.add_argument("--url", default=os.environ.get("NONSTOP_REDIS_URL"))
    p.add_argument("--prefix", default="nonstop", help="the run's redis.prefix")
    p.add_argument("--run", required=True, help="the run's name (run.name)")
    p.add_argument("--partition", type=int, required=True, help="k of redis.shards partitions")
    p.add_argument("--to", required=True, help="HOST:PORT of the primary to move it to")
    args = p.parse_args(argv)
    if not args.url:
        print("error: give --url redis+cluster://... or set NONSTOP_REDIS_URL", file=sys.stderr)
        return 2
    try:
        client = connect(args.url, reconnect_s=5.0, startup_s=10.0)
        if not isinstance(client, RedisCluster):
            raise ValueError(
                f"{args.url.split('://')[0]}:// is not a cluster URL: only a "
                "redis.mode=cluster run has partitions to move"
            )
        names = Names(args.prefix, args.run, cluster=True).part(args.partition)
        slot = client.keyslot(names.rollouts)
        t = time.monotonic()
        progress = lambda n: print(f"\r  {n} keys moved", end="", flush=True)  # noqa: E731
        source, moved = move_slot(client, slot, args.to, on_batch=progress)
        print()
    except (ValueError, RedisUnavailable, RedisRefused, redis.RedisError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"partition {args.partition} of {args.prefix}:{args.run} (slot {slot}): moved from "
        f"{source} to {args.to}, {moved} keys, in {time.monotonic() - t:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
