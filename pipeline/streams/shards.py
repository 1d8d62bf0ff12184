"""Sharded work streams: ``rollouts`` and ``batches`` over several Redis instances.

::

    redis.shards = N  ->  shard 0: the primary (redis.url): control keys (versions,
                          counters, status hashes, run marker), weights, joins, dead
                          letters, and its part of rollouts and batches
                          shards 1..N-1 (redis.shard_urls / NONSTOP_REDIS_SHARD_URLS):
                          their part of rollouts and batches, nothing else

    redis.mode=cluster, redis.shards = N  ->  N partitions on one Redis Cluster
                          (pipeline/streams/cluster.py): partition k's rollouts and
                          batches are ``<prefix>:{<run>.p<k>}:...`` (their own hash tag,
                          so their slot and node), the control keys ``<prefix>:{<run>}:...``

One implementation for both: a shard is a *part*, a (client, Names) pair
(:class:`Part`). With independent instances every part has its own client and the
same names (same ACL patterns, same ``redis-cli`` habits on every instance); in
cluster mode every part shares the one cluster client and has its own names
(:meth:`pipeline.streams.names.Names.part`). The routing, the ``k@`` ids and the
positions below do not know which.

Who writes where: an actor sends each group to the next shard in turn (from a
start that differs per actor), a preprocessor writes a read's batches to the
shard the read's rollouts came from, and the trainer reads batches from every
shard. Entry ids of a sharded consumer carry their shard (``k@ms-seq``); a
read position (the trainer's checkpoint) is one id per shard, comma-joined.
With one shard nothing changes: plain :class:`~pipeline.streams.consumer.Consumer`,
plain ids, one client.
"""

from __future__ import annotations

import zlib
from typing import Any

import redis

from pipeline.streams.consumer import Consumer, Part
from pipeline.streams.names import SHARDED, Names, id_tuple

SEP = "@"


class Shards:
    """The run's parts (shards or cluster partitions), the primary's first; ``next()``
    rotates over them. ``names``: the run's names (each part's are ``names.part(k)``);
    ``clients``: one per part (the same cluster client for every partition)."""

    def __init__(self, clients: list[redis.Redis], start: int = 0, names: Names | None = None):
        if not clients:
            raise ValueError("Shards needs at least the primary Redis client")
        self.clients = list(clients)
        self.names = [names.part(k) if names else None for k in range(len(clients))]
        self._turn = start

    @classmethod
    def of(cls, client: redis.Redis, shards: Any = ()) -> Shards:
        """``shards`` if it is a :class:`Shards`, else the primary ``client`` and the
        clients of independent shards 1.. as one."""
        return shards if isinstance(shards, Shards) else cls([client, *shards])

    @classmethod
    def cluster(cls, client: redis.Redis, names: Names, partitions: int, start: int = 0) -> Shards:
        """``partitions`` partitions of one Redis Cluster client (redis.mode=cluster)."""
        return cls([client] * partitions, start, names)

    def __len__(self) -> int:
        return len(self.clients)

    @property
    def primary(self) -> redis.Redis:
        return self.clients[0]

    @property
    def instances(self) -> list[redis.Redis]:
        """The distinct clients (one for a cluster, one per independent shard)."""
        out: list[redis.Redis] = []
        for c in self.clients:
            if not any(c is o for o in out):
                out.append(c)
        return out

    def part(self, k: int) -> Part:
        names = self.names[k]
        if names is None:
            raise ValueError("Shards was made without the run's Names: pass names=")
        return Part(k, self.clients[k], names)

    @property
    def parts(self) -> list[Part]:
        return [self.part(k) for k in range(len(self))]

    def next(self) -> Part:
        """The part for the next entry a producer writes (round robin)."""
        part = self.part(self._turn % len(self.clients))
        self._turn += 1
        return part

    @classmethod
    def for_producer(
        cls, clients: list[redis.Redis], name: str, names: Names | None = None
    ) -> Shards:
        """Producers start their rotation at different shards (by name)."""
        return cls(clients, start=start_for(name, len(clients)), names=names)


def start_for(name: str, parts: int) -> int:
    """Where a producer named ``name`` starts its rotation over ``parts`` parts."""
    return zlib.crc32(name.encode()) % parts


def parts_of(client: redis.Redis, names: Names, shards: Any = ()) -> list[Part]:
    """Every part of a run: ``shards`` a :class:`Shards` (its parts), or the clients of
    independent shards 1.. beside the primary ``client`` (the same names on each)."""
    if isinstance(shards, Shards):
        return shards.parts
    return [Part(k, c, names) for k, c in enumerate([client, *shards])]


def open_consumer(
    shards: Shards, names: Names, stream: str, group: str, consumer: str, cls: type, **kw: Any
) -> Consumer | ShardedConsumer:
    """A Consumer on the primary with one shard, a ShardedConsumer over all with more."""
    if len(shards) == 1:  # partition 0's names (cluster mode) for a work stream
        part = shards.names[0] or names
        if stream in (getattr(names, s) for s in SHARDED):
            stream = getattr(part, _logical(names, stream))
        return Consumer(shards.primary, part, stream, group, consumer, cls, **kw)
    return ShardedConsumer(shards, names, stream, group, consumer, cls, **kw)


def _logical(names: Names, stream: str) -> str:
    """Which work stream ``stream`` is (``rollouts`` or ``batches``) by its name."""
    for logical in SHARDED:
        if getattr(names, logical) == stream:
            return logical
    raise ValueError(f"{stream!r} is not a sharded work stream ({', '.join(SHARDED)})")


def parse_position(position: str, shards: int) -> list[str]:
    """Per-shard ids of a read position (one entry id per shard, comma-joined); a plain
    id (a one-shard run's checkpoint) is shard 0's. A position of another shard count is
    refused: entries cannot be mapped between shard layouts."""
    parts = position.split(",")
    if len(parts) == 1 and SEP not in position:
        return [position] + ["0-0"] * (shards - 1)
    if len(parts) != shards:
        raise ValueError(
            f"read position {position!r} has {len(parts)} shards but redis.shards="
            f"{shards}: resume with the shard count the run was started with"
        )
    return parts


def split_id(entry_id: str) -> tuple[int, str]:
    """``k@ms-seq`` -> (k, ``ms-seq``)."""
    shard, sep, plain = entry_id.partition(SEP)
    if not sep:
        raise ValueError(f"entry id {entry_id!r} names no shard (expected k{SEP}ms-seq)")
    return int(shard), plain


class ShardedConsumer:
    """One :class:`Consumer` per shard (group and consumer name the same on each)
    behind the Consumer interface. ``read`` returns entries of one shard only: the
    first, in turn from the shard after the last one read, that has some (one
    non-blocking pass, then a short block on the next shard), so a preprocessor
    writes a read's batches to one shard (:meth:`client_for`)."""

    def __init__(
        self,
        shards: Shards,
        names: Names,
        stream: str,
        group: str,
        consumer: str,
        cls: type,
        block_ms: int = 1000,
        **kw: Any,
    ):
        self.shards, self.stream, self.group = shards, stream, group
        wait_ms = max(10, block_ms // len(shards))  # a blocked read leaves the others waiting
        logical = _logical(names, stream)  # "rollouts" or "batches": each part's own name
        part_names = [n or names for n in shards.names]
        self.parts = [
            Consumer(
                c,
                part_names[k],
                getattr(part_names[k], logical),
                group,
                consumer,
                cls,
                block_ms=wait_ms,
                **kw,
                dead_client=shards.primary,
                shard=k,
            )
            for k, c in enumerate(shards.clients)
        ]
        self._next = 0

    @property
    def dead_lettered(self) -> int:
        return sum(p.dead_lettered for p in self.parts)

    @property
    def claimed(self) -> int:
        return sum(p.claimed for p in self.parts)

    def read(self, count: int) -> list[tuple[str, Any]]:
        n = len(self.parts)
        for i in range(n):
            k = (self._next + i) % n
            entries = self.parts[k].read(count, wait=False)
            if entries:
                self._next = k + 1
                return [(f"{k}{SEP}{entry_id}", msg) for entry_id, msg in entries]
        k = self._next % n
        self._next = k + 1
        return [(f"{k}{SEP}{entry_id}", msg) for entry_id, msg in self.parts[k].read(count)]

    def _by_shard(self, ids: list[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for entry_id in ids:
            k, plain = split_id(entry_id)
            out.setdefault(k, []).append(plain)
        return out

    def ack(self, ids: list[str]) -> None:
        for k, plain in self._by_shard(ids).items():
            self.parts[k].ack(plain)

    def dead_letter(self, entry_id: str, fields: dict, reason: str) -> None:
        k, plain = split_id(entry_id)
        self.parts[k].dead_letter(plain, fields, reason)

    def client_for(self, entry_id: str) -> redis.Redis:
        return self.shards.clients[split_id(entry_id)[0]]

    def part_for(self, entry_id: str) -> Part:
        """The part holding ``entry_id`` (a preprocessor writes its batches there)."""
        k = split_id(entry_id)[0]
        part = self.parts[k]
        return Part(k, part.client, part.names)

    # ---- positions: one entry id per shard, comma-joined
    def parse(self, position: str) -> list[str]:
        return parse_position(position, len(self.parts))

    def position(self, previous: str, ids: list[str]) -> str:
        current = self.parse(previous)
        for k, plains in self._by_shard(ids).items():
            newest = max(plains, key=id_tuple)
            if id_tuple(newest) > id_tuple(current[k]):
                current[k] = newest
        return ",".join(current)

    def set_position(self, position: str) -> None:
        for part, plain in zip(self.parts, self.parse(position), strict=True):
            part.set_position(plain)

    def trim(self, keep_after: str | None = None) -> int:
        after = self.parse(keep_after) if keep_after is not None else [None] * len(self.parts)
        return sum(part.trim(a) for part, a in zip(self.parts, after, strict=True))
