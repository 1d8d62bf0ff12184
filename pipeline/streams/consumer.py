"""Reading a work stream: :class:`Consumer` (XREADGROUP + XACK through a consumer group,
typed decoding, pending-entry recovery and claims, the dead-letter path) and the run
marker that tells a Redis that lost the run's data from one that restarted with it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import redis

from pipeline.messages import BadEntry, decode
from pipeline.streams import durable
from pipeline.streams.names import DATA, Names, id_tuple
from pipeline.streams.trimming import trim_consumed

log = logging.getLogger(__name__)


def ensure_group(client: redis.Redis, stream: str, group: str, start: str = "0") -> None:
    try:
        client.xgroup_create(stream, group, id=start, mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


class Part(NamedTuple):
    """One cluster partition of the work streams, or a run's only part
    (pipeline/streams/shards.py):
    its index, the client that reaches it and the names of its streams."""

    k: int
    client: redis.Redis
    names: Names


class DataLost(RuntimeError):
    """The run's Redis came back empty: streams and groups are gone."""


DRAIN_FIELD = "drain"  # in the run marker: set, no actor starts a new group (actor/room.py)


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

    Lost replies: an ``XREADGROUP >`` the server carried out but whose reply never
    came back (Redis killed or the connection cut after the command ran, and the
    client's retry read the entries after them) leaves entries pending for this
    consumer that this process never saw. The consumer keeps the ids it handed out
    and that are not yet acknowledged or dead-lettered; every ``lost_every_s``
    (whatever ``recover_pending`` says) it lists its own pending entries up to the
    newest id a read gave it (XPENDING) and hands out the ones it never handed out
    (XRANGE), a warning in the log. An id it still holds is never handed out twice.
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
        shard: int | None = None,
        lost_every_s: float = 2.0,
    ):
        self.client, self.names, self.stream = client, names, stream
        self.shard = shard  # a cluster partition: which one this consumer reads (dead letters)
        self.group, self.consumer, self.cls, self.block_ms = group, consumer, cls, block_ms
        self.claim_idle_ms, self.claim_every_s = int(claim_idle_s * 1000), claim_every_s
        self.dead_maxlen = dead_maxlen
        self.dead_lettered = 0
        self.claimed = 0
        self.lost_replies = 0  # entries re-read because a read's reply was lost
        self._own_pending = recover_pending
        self._pending_from = "0"  # the first read's walk through its own pending entries
        self._next_claim = time.monotonic() + claim_every_s if recover_pending else float("inf")
        self.lost_every_s = lost_every_s  # how often it looks for lost replies (XPENDING)
        self._next_orphans = time.monotonic() + lost_every_s
        self._handed: set[str] = set()  # given to the caller, not yet acked or dead-lettered
        self._newest: str | None = None  # the newest id a read gave this process
        self._gone: set[str] = set()  # pending here, but no longer in the stream (reported)
        ensure_group(client, stream, group)

    def read(self, count: int, wait: bool = True) -> list[tuple[str, Any]]:
        """Up to ``count`` entries (recovered, claimed, then new) as (id, message);
        ``wait=False`` returns at once when nothing waits (no BLOCK)."""
        try:
            entries = (
                self._unheld(self._recover(count))
                or self._unheld(self._orphans(count))
                or self._unheld(self._fetch(count, wait))
            )
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            check_run(self.client, self.names)
            log.warning("consumer group %s on %s is gone; recreating it", self.group, self.stream)
            ensure_group(self.client, self.stream, self.group)
            return []
        return self._decode(entries)

    def _unheld(self, entries: list) -> list:
        """``entries`` (ids decoded) less those the caller still holds (claimed back from
        this consumer itself, or read again after a read position was set back); the
        others are the caller's from now on."""
        fresh = []
        for entry_id, fields in entries:
            entry_id = entry_id.decode()
            if entry_id in self._handed:
                continue
            self._handed.add(entry_id)
            if self._newest is None or id_tuple(entry_id) > id_tuple(self._newest):
                self._newest = entry_id
            fresh.append((entry_id, fields))
        return fresh

    def _fetch(self, count: int, wait: bool = True) -> list:
        block = self.block_ms if wait else None  # BLOCK 0 would wait forever: None = no BLOCK
        reply = self.client.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=block
        )
        return [e for _stream, entries in reply or [] for e in entries]

    def _orphans(self, count: int) -> list:
        """This consumer's pending entries up to the newest id it was given that it never
        handed out: delivered by a read whose reply was lost (see the class)."""
        if self._newest is None or time.monotonic() < self._next_orphans:
            return []
        self._next_orphans = time.monotonic() + self.lost_every_s
        rows = self.client.xpending_range(
            self.stream,
            self.group,
            min="-",
            max=self._newest,
            count=len(self._handed) + count,
            consumername=self.consumer,
        )
        ids = [r["message_id"].decode() for r in rows]
        lost = [i for i in ids if i not in self._handed and i not in self._gone][:count]
        entries = []
        for entry_id in lost:
            found = self.client.xrange(self.stream, entry_id, entry_id)
            if found and found[0][1]:
                entries.append(found[0])
            else:  # trimmed or deleted while pending: nothing left to hand out
                self._gone.add(entry_id)
                log.error(
                    "%s %s is pending for %s but no longer in the stream; it stays pending "
                    "(XPENDING shows it) and is not handed out",
                    self.stream,
                    entry_id,
                    self.consumer,
                )
        if entries:
            self.lost_replies += len(entries)
            log.warning(
                "re-reading %d entries of %s delivered to %s whose read reply was lost "
                "(a Redis restart or a cut connection): %s",
                len(entries),
                self.stream,
                self.consumer,
                ", ".join(e[0].decode() for e in entries),
            )
        return entries

    def _recover(self, count: int) -> list:
        if self._own_pending:
            reply = self.client.xreadgroup(
                self.group, self.consumer, {self.stream: self._pending_from}, count=count
            )
            listed = [e for _s, es in reply or [] for e in es]
            if listed:
                self._pending_from = listed[-1][0]  # the next read walks on from here
            entries = [e for e in listed if e[1]]
            if entries:
                log.info("re-reading %d pending entries of %s", len(entries), self.consumer)
                return entries
            if not listed:
                self._own_pending = False
        if time.monotonic() >= self._next_claim:
            self._next_claim = time.monotonic() + self.claim_every_s
            reply = self.client.xautoclaim(
                self.stream, self.group, self.consumer, self.claim_idle_ms, count=count
            )
            # this consumer's own entries come back too once idle: those it holds are not news
            entries = [e for e in reply[1] if e[1] and e[0].decode() not in self._handed]
            if entries:
                self.claimed += len(entries)
                log.warning("claimed %d entries a dead consumer left pending", len(entries))
                return entries
        return []

    def _decode(self, entries: list) -> list[tuple[str, Any]]:
        out = []
        for entry_id, fields in entries:
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
        durable.xadd(self.client, self.names.dead, entry, maxlen=self.dead_maxlen)
        self.ack([entry_id])
        self.dead_lettered += 1

    def ack(self, ids: list[str]) -> None:
        if ids:  # with WAIT behind it in sentinel and cluster mode (durable.py)
            durable.xack(self.client, self.stream, self.group, ids)
            self._handed.difference_update(ids)

    # ---- the position interface ShardedConsumer shares (one part: plain entry ids)
    def part_for(self, entry_id: str) -> Part:
        """The part holding ``entry_id``: this consumer's (where follow-up writes go)."""
        return Part(0, self.client, self.names)

    def position(self, previous: str, ids: list[str]) -> str:
        """The read position after ``ids``: the newest of them and ``previous`` (an entry
        re-read after a lost reply is older than ones read before it)."""
        return max([previous, *ids], key=id_tuple)

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
    """The entry id just after ``position`` (None: none)."""
    if position is None:
        return None
    ms, seq = id_tuple(position)
    return f"{ms}-{seq + 1}"
