"""Trainer side of the weight transfer: a background thread that sends the
newest snapshot of the weights to every actor that joined.

::

    reads   <run>:joins (actors asking in), the trainer's submitted snapshots
    writes  <run>:weights announcements, <run>:rendezvous, <run>:published_version;
            the buckets over one gloo pair group per actor
    blocks  never the training loop: submit() copies and returns; a dead or
            slow actor costs at most trainer.transfer_timeout_s and is dropped

When several versions are submitted while one is in flight, only the newest
is sent. An actor that joins (or re-joins after a failure) is sent the
current version at once.
"""

from __future__ import annotations

import datetime
import hmac
import logging
import secrets
import threading
import time

import redis
import torch
import torch.distributed as dist

from pipeline.messages import SCHEMA_VERSION, BucketSpec, WeightAnnouncement, encode
from pipeline.redis_server import free_port
from pipeline.streams import Names, publish
from pipeline.weights import (
    broadcast_buckets,
    bucket_layout,
    checksum,
    flatten,
    join_mac,
    pair_group,
)

log = logging.getLogger(__name__)

Snapshot = tuple[int, list[BucketSpec], list[torch.Tensor]]


class WeightPublisher:
    def __init__(
        self,
        client: redis.Redis,
        names: Names,
        host: str,
        bucket_mb: float,
        timeout_s: float,
        secret: str,
    ):
        self.client, self.names, self.host = client, names, host
        self.bucket_bytes, self.timeout_s = int(bucket_mb * 1024 * 1024), timeout_s
        port = free_port(host)
        self.store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.secret, self.epoch = secret, secrets.token_hex(8)
        # an epoch per trainer process: actors that joined an earlier trainer see it
        # change and join again; joins addressed to earlier trainers are skipped
        last_join = client.xrevrange(names.stream("joins"), count=1)
        self.joins_id = last_join[0][0].decode() if last_join else "0"
        client.hset(
            names.key("rendezvous"),
            mapping={"host": host, "port": port, "epoch": self.epoch},
        )
        self.groups: dict[str, object] = {}
        self.published = 0
        self.failures = 0
        self.dropped: list[str] = []
        self.transfer_ms: list[float] = []
        self._latest: Snapshot | None = None
        self._pending: Snapshot | None = None
        self._cv = threading.Condition()
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="weight-publisher", daemon=True)
        self._thread.start()

    def submit(self, version: int, model: torch.nn.Module) -> None:
        """Snapshot the weights now (one copy); the thread sends the newest snapshot."""
        named = list(model.named_parameters())
        layout = bucket_layout(named, self.bucket_bytes)
        flat = flatten(dict(named), layout)
        with self._cv:
            self._pending = (version, layout, flat)
            self._cv.notify()

    def idle(self) -> bool:
        with self._cv:
            return self._pending is None and not self._busy

    def close(self, timeout_s: float = 30.0) -> None:
        """Let the last submitted version go out (bounded), then stop the thread."""
        deadline = time.monotonic() + timeout_s
        while not self.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._pending is None and not self._stop:
                    self._cv.wait(timeout=0.5)
                if self._stop:
                    return
                job, self._pending = self._pending, None
                self._busy = True
            try:
                joined = self._accept_joins()
                if job is not None:
                    self._send(job, sorted(self.groups))
                    self._latest = job
                    self.published += 1
                elif joined and self._latest is not None:
                    self._send(self._latest, joined)  # catch a (re)joined actor up at once
            except Exception:  # the trainer must go on; the failure is logged and counted
                log.exception("weight publisher step failed")
                self.failures += 1
            finally:
                with self._cv:
                    self._busy = False

    def _accept_joins(self) -> list[str]:
        joined = []
        reply = self.client.xread({self.names.stream("joins"): self.joins_id}, count=100)
        for _s, entries in reply or []:
            for entry_id, fields in entries:
                self.joins_id = entry_id.decode()
                f = {k.decode(): v.decode() for k, v in fields.items()}
                actor, nonce = f.get("actor", "?"), f.get("nonce", "")
                if f.get("epoch") != self.epoch:
                    continue  # addressed to an earlier trainer
                if not hmac.compare_digest(f.get("mac", ""), join_mac(self.secret, f)):
                    log.error("rejected a join as %r: bad or missing run secret", actor)
                    continue
                try:
                    self.groups[actor] = pair_group(self.store, nonce, 0, self.host, self.timeout_s)
                    joined.append(actor)
                    log.info("actor %s joined the weight transfer", actor)
                except Exception as e:
                    log.error("actor %s could not join the weight transfer: %s", actor, e)
        return joined

    def _send(self, snapshot: Snapshot, targets: list[str]) -> None:
        version, layout, flat = snapshot
        ann = WeightAnnouncement(
            schema=SCHEMA_VERSION,
            version=version,
            dtype=str(flat[0].dtype).removeprefix("torch."),
            buckets=layout,
            checksums=checksum(flat),
            targets=targets,
            created=time.time(),
        )
        publish(
            self.client,
            self.names.weights,
            encode(ann),
            maxlen=100,
            version=version,
            targets=",".join(targets),
            buckets=len(layout),
            bytes=sum(b.numel() * b.element_size() for b in flat),
        )
        for actor in targets:
            t0 = time.monotonic()
            try:
                broadcast_buckets(self.groups[actor], flat, t0 + self.timeout_s)
            except Exception as e:  # a dead or slow actor is dropped, the others go on
                log.error("dropping actor %s from the weight transfer: %s", actor, e)
                self.groups.pop(actor, None)
                self.dropped.append(actor)
                continue
            self.transfer_ms.append(1000 * (time.monotonic() - t0))
            log.info("sent version %d to %s in %.0f ms", version, actor, self.transfer_ms[-1])
        self.client.set(self.names.key("published_version"), version)
