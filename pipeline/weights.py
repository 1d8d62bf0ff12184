"""Weight transfer from the trainer to every actor, over gloo pair groups.

::

    trainer (WeightPublisher thread)              actor (WeightReceiver thread)
      reads  <run>:joins  (actor asks in)   <--     XADD joins {actor, nonce}
      builds a 2-rank gloo group per actor  <-->    builds its side (rank 1)
      XADD <run>:weights  announcement      -->     XREAD weights (version, layout, sums)
      broadcast bucket by bucket            -->     receive into a staging copy,
                                                    check sums, engine.swap() under the
                                                    per-forward-pass lock

Each actor has its own two-rank group, found through a TCPStore whose address
is in the run's Redis, so one dead or slow actor is dropped within the
deadline without touching the others, and a restarted actor simply joins
again. Every broadcast has a deadline; a transfer that fails leaves the old
weights whole (the swap happens only after all buckets arrived and their
checksums match).
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading
import time
from collections.abc import Callable

import redis
import torch
import torch.distributed as dist

from pipeline.messages import (
    SCHEMA_VERSION,
    BucketSpec,
    ParamSpec,
    WeightAnnouncement,
    decode,
    encode,
)
from pipeline.redis_server import free_port
from pipeline.streams import Names, publish

log = logging.getLogger(__name__)


def bucket_layout(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[BucketSpec]:
    """Group parameters, in order, into buckets of about ``bucket_bytes``."""
    buckets, current, numel = [], [], 0
    for name, p in named:
        if current and (numel + p.numel()) * p.element_size() > bucket_bytes:
            buckets.append(BucketSpec(numel=numel, params=current))
            current, numel = [], 0
        current.append(ParamSpec(name=name, shape=list(p.shape), offset=numel))
        numel += p.numel()
    if current:
        buckets.append(BucketSpec(numel=numel, params=current))
    return buckets


def flatten(params: dict[str, torch.Tensor], layout: list[BucketSpec]) -> list[torch.Tensor]:
    """Copy parameters into fresh flat bucket tensors."""
    return [torch.cat([params[s.name].detach().reshape(-1) for s in b.params]) for b in layout]


_INT_VIEW = {4: torch.int32, 2: torch.int16, 1: torch.int8, 8: torch.int64}


def checksum(buckets: list[torch.Tensor]) -> list[int]:
    """Exact, order-independent sum of each bucket's bit patterns."""
    return [int(b.view(_INT_VIEW[b.element_size()]).sum(dtype=torch.int64)) for b in buckets]


def _pair_group(store: dist.Store, nonce: str, rank: int, host: str, timeout_s: float):
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore(nonce, store), rank, 2, opts)


class WeightPublisher:
    """Trainer side: a background thread that sends the newest version to every actor."""

    def __init__(
        self, client: redis.Redis, names: Names, host: str, bucket_mb: int, timeout_s: float
    ):
        self.client, self.names, self.host = client, names, host
        self.bucket_bytes, self.timeout_s = bucket_mb * 1024 * 1024, timeout_s
        port = free_port(host)
        self.store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.secret = secrets.token_hex(8)
        client.hset(
            names.key("rendezvous"), mapping={"host": host, "port": port, "secret": self.secret}
        )
        self.groups: dict[str, object] = {}
        self.joins_id = "0"
        self.published = 0
        self.failures = 0
        self._pending: tuple[int, list[BucketSpec], list[torch.Tensor]] | None = None
        self._cv = threading.Condition()
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="weight-publisher", daemon=True)
        self._thread.start()

    def submit(self, version: int, model: torch.nn.Module) -> None:
        """Snapshot the weights now (cheap copy); the thread sends the latest snapshot."""
        named = [(n, p) for n, p in model.named_parameters()]
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
                self._busy = job is not None
            try:
                if job is None:
                    self._accept_joins()
                else:
                    self._send(*job)
            except Exception:  # the trainer must go on; the failure is logged and counted
                log.exception("weight publisher step failed")
                self.failures += 1
            finally:
                with self._cv:
                    self._busy = False

    def _accept_joins(self) -> None:
        reply = self.client.xread({self.names.stream("joins"): self.joins_id}, count=100)
        for _s, entries in reply or []:
            for entry_id, fields in entries:
                self.joins_id = entry_id.decode()
                actor, nonce = fields[b"actor"].decode(), fields[b"nonce"].decode()
                try:
                    self.groups[actor] = _pair_group(
                        self.store, nonce, 0, self.host, self.timeout_s
                    )
                    log.info("actor %s joined the weight transfer", actor)
                except Exception as e:
                    log.error("actor %s could not join the weight transfer: %s", actor, e)

    def _send(self, version: int, layout: list[BucketSpec], flat: list[torch.Tensor]) -> None:
        self._accept_joins()
        sums = checksum(flat)
        targets = sorted(self.groups)
        ann = WeightAnnouncement(
            schema=SCHEMA_VERSION,
            version=version,
            dtype=str(flat[0].dtype).removeprefix("torch."),
            buckets=layout,
            checksums=sums,
            targets=targets,
            created=time.time(),
        )
        publish(
            self.client,
            self.names.weights,
            encode(ann),
            version=version,
            targets=",".join(targets),
            buckets=len(layout),
            bytes=sum(b.numel() * b.element_size() for b in flat),
        )
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for actor in targets:
            t0 = time.monotonic()
            try:
                for bucket in flat:
                    self.groups[actor].broadcast(bucket, 0, timeout).wait()
            except Exception as e:  # a dead or slow actor is dropped, the others go on
                log.error("dropping actor %s from the weight transfer: %s", actor, e)
                self.groups.pop(actor, None)
                continue
            log.info(
                "sent version %d to %s in %.0f ms", version, actor, 1000 * (time.monotonic() - t0)
            )
        self.published += 1
        self.client.set(self.names.key("published_version"), version)


class WeightReceiver:
    """Actor side: receives each announced version into staging and swaps it in.

    ``swap(version, layout, buckets)`` is the engine's callback; it runs under
    the engine's per-forward-pass lock and must return the buffers it
    released (for reuse as the next staging copy) or None.
    """

    def __init__(
        self,
        client: redis.Redis,
        names: Names,
        actor: str,
        swap: Callable[[int, list[BucketSpec], list[torch.Tensor]], object],
        timeout_s: float,
        on_error: Callable[[str], None] | None = None,
    ):
        self.client, self.names, self.actor = client, names, actor
        self.swap, self.timeout_s = swap, timeout_s
        self.on_error = on_error or (lambda msg: None)
        self.applied = 0
        self.failed = 0
        self.group = None
        self._spare: list[torch.Tensor] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-receiver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 5)

    def _join(self) -> str:
        """Join the transfer; return the weights-stream id to read after."""
        key = self.names.key("rendezvous")
        while not self._stop.is_set() and not self.client.exists(key):
            time.sleep(0.2)
        info = {k.decode(): v.decode() for k, v in self.client.hgetall(key).items()}
        store = dist.TCPStore(
            info["host"],
            int(info["port"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        last = self.client.xrevrange(self.names.weights, count=1)
        after = last[0][0].decode() if last else "0"
        nonce = f"{self.actor}:{secrets.token_hex(6)}"
        self.client.xadd(self.names.stream("joins"), {"actor": self.actor, "nonce": nonce})
        self.group = _pair_group(store, nonce, 1, info["host"], self.timeout_s)
        log.info("joined the weight transfer as %s", self.actor)
        return after

    def _run(self) -> None:
        after = None
        while not self._stop.is_set():
            try:
                if self.group is None:
                    after = self._join()
                reply = self.client.xread({self.names.weights: after}, count=1, block=500)
                for _s, entries in reply or []:
                    for entry_id, fields in entries:
                        after = entry_id.decode()
                        ann = decode(fields[b"data"], WeightAnnouncement)
                        if self.actor in ann.targets:
                            self._receive(ann)
            except Exception as e:  # old weights stay in place; rejoin and take the next
                if self._stop.is_set():
                    return
                self.failed += 1
                log.error("weight update failed, keeping the current weights: %s", e)
                self.on_error(str(e))
                self.group = None
                time.sleep(0.5)

    def _staging(self, ann: WeightAnnouncement) -> list[torch.Tensor]:
        dtype = getattr(torch, ann.dtype)
        spare = self._spare
        if (
            spare
            and [b.numel() for b in spare] == [b.numel for b in ann.buckets]
            and spare[0].dtype == dtype
        ):
            return spare
        return [torch.empty(b.numel, dtype=dtype) for b in ann.buckets]

    def _receive(self, ann: WeightAnnouncement) -> None:
        staging = self._staging(ann)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        t0 = time.monotonic()
        for bucket in staging:
            self.group.broadcast(bucket, 0, timeout).wait()
        if checksum(staging) != ann.checksums:
            raise RuntimeError(f"version {ann.version} failed its checksum")
        transfer_ms = 1000 * (time.monotonic() - t0)
        self._spare = self.swap(ann.version, ann.buckets, staging)
        self.applied += 1
        log.info("applied version %d (transfer %.0f ms)", ann.version, transfer_ms)
