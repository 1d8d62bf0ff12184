"""Sharded work streams: ``rollouts`` and ``batches`` over several Redis instances.

::

    redis.shards = N  ->  shard 0: the primary (redis.url): control keys (versions,
                          counters, status hashes, run marker), weights, joins, dead
                          letters, and its part of rollouts and batches
                          shards 1..N-1 (redis.shard_urls / NONSTOP_REDIS_SHARD_URLS):
                          their part of rollouts and batches, nothing else

Independent instances, not a Redis Cluster: a stream is one key, and a Cluster
puts one key on one node, so sharding a stream there also means several keys
(one per shard, hash-tagged apart) read by per-shard consumer groups - which
is what this module does, without cluster mode, its slot bookkeeping, or a
client that must follow MOVED redirections. The streams and groups keep their
names on every shard (same ACL patterns, same ``redis-cli`` habits).

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

from pipeline.streams.consumer import Consumer
from pipeline.streams.names import Names, id_tuple

SEP = "@"


class Shards:
    """The run's Redis clients, the primary first; ``next()`` rotates over them."""

    def __init__(self, clients: list[redis.Redis], start: int = 0):
        if not clients:
            raise ValueError("Shards needs at least the primary Redis client")
        self.clients = list(clients)
        self._turn = start

    def __len__(self) -> int:
        return len(self.clients)

    @property
    def primary(self) -> redis.Redis:
        return self.clients[0]

    def next(self) -> redis.Redis:
        """The shard for the next entry a producer writes (round robin)."""
        client = self.clients[self._turn % len(self.clients)]
        self._turn += 1
        return client

    @classmethod
    def for_producer(cls, clients: list[redis.Redis], name: str) -> Shards:
        """Producers start their rotation at different shards (by name)."""
        return cls(clients, start=zlib.crc32(name.encode()) % len(clients))


def open_consumer(
    shards: Shards, names: Names, stream: str, group: str, consumer: str, cls: type, **kw: Any
) -> Consumer | ShardedConsumer:
    """A Consumer on the primary with one shard, a ShardedConsumer over all with more."""
    if len(shards) == 1:
        return Consumer(shards.primary, names, stream, group, consumer, cls, **kw)
    return ShardedConsumer(shards, names, stream, group, consumer, cls, **kw)


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
        self.parts = [
            Consumer(
                c,
                names,
                stream,
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
