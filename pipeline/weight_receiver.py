"""Actor side of the weight transfer: a thread that takes every announced
version and installs it in the engine without stopping generation.

::

    reads   <run>:rendezvous, <run>:weights announcements, buckets over the gloo group
    writes  <run>:joins (asking in, again after any failure); the engine's weights
    blocks  only itself; generation waits just for the swap (staged mode)

Staged mode (default): receive into a staging copy while the engine keeps
generating, check the checksums, then ``target.swap`` under the engine's
per-forward-pass lock. In-place mode (``staged=False``, for memory-tight
GPUs): hold the lock and receive straight into the weights; if that transfer
fails, the weights are marked invalid and the engine generates nothing until
the next whole version has arrived. Either way no token is ever produced by
a mix of two versions.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Protocol

import redis
import torch
import torch.distributed as dist

from pipeline.messages import BucketSpec, WeightAnnouncement, decode
from pipeline.streams import Names
from pipeline.weights import broadcast_buckets, checksum, join_mac, pair_group

log = logging.getLogger(__name__)


class SwapTarget(Protocol):
    """What an engine offers the receiver (actor/engine.py implements it)."""

    lock: threading.Condition

    def swap(
        self, version: int, layout: list[BucketSpec], buckets: list[torch.Tensor]
    ) -> list[torch.Tensor] | None: ...

    def weight_views(self, layout: list[BucketSpec]) -> list[list[tuple[torch.Tensor, int]]]: ...

    def set_version(self, version: int | None) -> None: ...


class WeightReceiver:
    def __init__(
        self,
        client: redis.Redis,
        names: Names,
        actor: str,
        target: SwapTarget,
        timeout_s: float,
        secret: str,
        staged: bool = True,
        on_error: Callable[[str], None] | None = None,
    ):
        self.client, self.names, self.actor = client, names, actor
        self.target, self.timeout_s, self.staged = target, timeout_s, staged
        self.on_error = on_error or (lambda msg: None)
        self.applied = 0
        self.failed = 0
        self.transfer_ms: list[float] = []
        self.group = None
        self.secret, self.epoch = secret, ""
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
        join = {"actor": self.actor, "nonce": secrets.token_hex(8), "epoch": info.get("epoch", "")}
        join["mac"] = join_mac(self.secret, join)
        self.client.xadd(self.names.stream("joins"), join)
        self.group = pair_group(store, join["nonce"], 1, info["host"], self.timeout_s)
        self.epoch = join["epoch"]
        log.info("joined the weight transfer as %s (trainer epoch %s)", self.actor, self.epoch)
        return after

    def _trainer_changed(self) -> bool:
        """A new trainer process (restart) published a new epoch: join it."""
        epoch = self.client.hget(self.names.key("rendezvous"), "epoch")
        return epoch is not None and epoch.decode() != self.epoch

    def _run(self) -> None:
        after = None
        while not self._stop.is_set():
            try:
                if self.group is None or self._trainer_changed():
                    after = self._join()
                reply = self.client.xread({self.names.weights: after}, count=1, block=500)
                for _s, entries in reply or []:
                    for entry_id, fields in entries:
                        after = entry_id.decode()
                        ann = decode(fields[b"data"], WeightAnnouncement)
                        if self.actor in ann.targets:
                            self._receive(ann)
            except Exception as e:  # keep the current weights; rejoin and take the next
                if self._stop.is_set():
                    return
                self.failed += 1
                log.error("weight update failed, keeping the current weights: %s", e)
                self.on_error(str(e))
                self.group = None
                time.sleep(0.5)

    def _receive(self, ann: WeightAnnouncement) -> None:
        t0 = time.monotonic()
        if self.staged:
            self._receive_staged(ann, t0 + self.timeout_s)
        else:
            self._receive_in_place(ann, t0 + self.timeout_s)
        self.transfer_ms.append(1000 * (time.monotonic() - t0))
        self.applied += 1
        log.info("applied version %d (%.0f ms)", ann.version, self.transfer_ms[-1])

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

    def _receive_staged(self, ann: WeightAnnouncement, deadline: float) -> None:
        staging = self._staging(ann)
        broadcast_buckets(self.group, staging, deadline)
        if checksum(staging) != ann.checksums:
            raise RuntimeError(f"version {ann.version} failed its checksum; not applied")
        self._spare = self.target.swap(ann.version, ann.buckets, staging)

    def _receive_in_place(self, ann: WeightAnnouncement, deadline: float) -> None:
        dtype = getattr(torch, ann.dtype)
        scratch = torch.empty(max(b.numel for b in ann.buckets), dtype=dtype)
        with self.target.lock:
            self.target.set_version(None)  # from here until success, the weights are partial
            views = self.target.weight_views(ann.buckets)
            for i, (spec, params) in enumerate(zip(ann.buckets, views, strict=True)):
                bucket = scratch[: spec.numel]
                broadcast_buckets(self.group, [bucket], deadline)
                if checksum([bucket])[0] != ann.checksums[i]:
                    raise RuntimeError(f"version {ann.version} failed its checksum")
                for param, offset in params:
                    param.copy_(bucket[offset : offset + param.numel()].view_as(param))
            self.target.set_version(ann.version)
