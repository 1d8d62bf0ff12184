"""Partitioned work streams: ``rollouts`` and ``batches`` in ``redis.shards`` partitions
of one Redis Cluster (redis.mode=cluster).

::

    redis.mode=cluster, redis.shards = N  ->  N partitions on one Redis Cluster
                          (pipeline/streams/cluster.py): partition k's rollouts and
                          batches are ``<prefix>:{<run>.p<k>}:...`` (their own hash tag,
                          so their slot and node), the control keys ``<prefix>:{<run>}:...``
                          (versions, counters, status hashes, run marker, weights,
                          joins, dead letters)

    redis.shards = 1 (single, sentinel or cluster mode)  ->  one part: the run's
                          names on the one client

A partition is a *part*, a (client, Names) pair (:class:`Part`): every part shares the
one client and has its own names (:meth:`pipeline.streams.names.Names.part`).
(Independent Redis instances as shards, ``redis.shard_urls``, were replaced by this:
pipeline/config/redis.py ``validate_shards`` refuses them, naming the move.)

Who writes where: an actor sends each group to the next partition in turn (from a
start that differs per actor), a preprocessor writes a read's batches to the
partition the read's rollouts came from, and the trainer reads batches from every
partition. Entry ids of a partitioned consumer carry their partition (``k@ms-seq``); a
read position (the trainer's checkpoint) is one id per partition, comma-joined.
With one part nothing changes: plain :class:`~pipeline.streams.consumer.Consumer`,
plain ids.
"""

from __future__ import annotations

import zlib
from typing import Any

import redis

from pipeline.streams.consumer import Consumer, Part
from pipeline.streams.names import SHARDED, Names, id_tuple

SEP = "@"


class Shards:
    """The run's parts (cluster partitions; one part without partitions) on the one
    ``client``; ``next()`` rotates over them from ``start``. ``names``: the run's names
    (each part's are ``names.part(k)``)."""

    def __init__(
        self, client: redis.Redis, names: Names | None = None, parts: int = 1, start: int = 0
    ):
        if parts < 1:
            raise ValueError(f"Shards needs at least one part, got {parts}")
        self.client = client
        self.names = [names.part(k) if names else None for k in range(parts)]
        self._turn = start

    @classmethod
    def cluster(cls, client: redis.Redis, names: Names, partitions: int, start: int = 0) -> Shards:
        """``partitions`` partitions of one Redis Cluster client (redis.mode=cluster)."""
        return cls(client, names, partitions, start)

    @classmethod
    def of(cls, cfg: Any, client: redis.Redis, names: Names, name: str = "") -> Shards:
        """The run's parts by its config: ``redis.shards`` partitions of the cluster
        ``client`` in redis.mode=cluster, else the one part; a producer ``name`` starts
        its rotation at a part of its own (:func:`start_for`)."""
        n = int(cfg.redis.shards) if cfg.redis.mode == "cluster" else 1
        return cls(client, names, n, start_for(name, n) if name else 0)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def primary(self) -> redis.Redis:
        return self.client

    def part(self, k: int) -> Part:
        names = self.names[k]
        if names is None:
            raise ValueError("Shards was made without the run's Names: pass names=")
        return Part(k, self.client, names)

    @property
    def parts(self) -> list[Part]:
        return [self.part(k) for k in range(len(self))]

    def next(self) -> Part:
        """The part for the next entry a producer writes (round robin)."""
        part = self.part(self._turn % len(self))
        self._turn += 1
        return part


def start_for(name: str, parts: int) -> int:
    """Where a producer named ``name`` starts its rotation over ``parts`` parts."""
    return zlib.crc32(name.encode()) % parts


def parts_of(client: redis.Redis, names: Names, shards: Shards | None = None) -> list[Part]:
    """Every part of a run: ``shards``'s (cluster partitions), or the one part of
    ``client`` with the run's ``names`` when None."""
    return shards.parts if shards is not None else [Part(0, client, names)]


def open_consumer(
    shards: Shards, names: Names, stream: str, group: str, consumer: str, cls: type, **kw: Any
) -> Consumer | ShardedConsumer:
    """A Consumer with one part, a ShardedConsumer over every partition with more."""
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
    """Per-partition ids of a read position (one entry id per partition, comma-joined); a
    plain id (a one-part run's checkpoint) is partition 0's. A position of another
    partition count is refused: entries cannot be mapped between layouts."""
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
    """One :class:`Consumer` per partition (group and consumer name the same on each)
    behind the Consumer interface. ``read`` returns entries of one partition only: the
    first, in turn from the partition after the last one read, that has some (one
    non-blocking pass, then a short block on the next), so a preprocessor writes a
    read's batches to one partition (:meth:`part_for`)."""

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
                shards.client,
                part_names[k],
                getattr(part_names[k], logical),
                group,
                consumer,
                cls,
                block_ms=wait_ms,
                **kw,
                shard=k,
            )
            for k in range(len(shards))
        ]
        self._next = 0

    @property
    def dead_lettered(self) -> int:
        return sum(p.dead_lettered for p in self.parts)

    @property
    def claimed(self) -> int:
        return sum(p.claimed for p in self.parts)

    @property
    def lost_replies(self) -> int:
        return sum(p.lost_replies for p in self.parts)

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

    def part_for(self, entry_id: str) -> Part:
        """The part holding ``entry_id`` (a preprocessor writes its batches there)."""
        k = split_id(entry_id)[0]
        part = self.parts[k]
        return Part(k, part.client, part.names)

    # ---- positions: one entry id per partition, comma-joined
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
