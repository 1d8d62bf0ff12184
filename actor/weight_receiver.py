"""Actor side of the weight transfer: a thread that takes every announced version
and installs it in the engine without stopping generation.

::

    reads   <run>:rendezvous, <run>:weights announcements, buckets over the transport
    writes  <run>:joins (asking in, again after any failure: a join counts once the
            trainer confirmed it in the rendezvous hash); the engine's weights;
            the actor's status hash: ``weight_versions_offered`` (announcements naming
            it) and ``weight_versions_failed`` (those it did not apply), HINCRBY;
            each applied version's timings to ``on_applied`` (staging, whole transfer)
    blocks  only itself; generation waits just for the swap (staged mode)

Staged mode (default): ``target.stage`` receives into the engine's staging copy
while it keeps generating (every bucket checked against its checksum), then
``target.swap`` installs it under the engine's per-forward-pass lock. In-place
mode (``staged=False``, for memory-tight GPUs): ``target.update_in_place``
holds the lock while each bucket is received and copied straight into the
weights (the engine records that whole hold as the swap); if that transfer
fails, the weights are marked partial and the engine generates nothing until
the next whole version has arrived. Either way no token is ever produced by a
mix of two versions.

A failed version is logged, counted (``failed``) and the next one taken; an error no
retry can fix (:data:`PERMANENT`: the trainer's ``weights.transport`` or weight kind,
full vs LoRA, differs from this actor's) ends the receiver at once and calls
``on_fatal`` (the actor stops with EXIT_MISMATCH and that one line) instead of
retrying every 0.5 s while the actor generates on old weights.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import redis

from pipeline.lora import KindMismatch
from pipeline.messages import WeightAnnouncement, decode
from pipeline.streams import Names
from pipeline.torch_logs import is_join_failure, join_failed, one_line
from pipeline.transfer import BucketSource, Receiver, ReceiverSource, make_receiver
from pipeline.transfer.buckets import accepted_field, join_mac

log = logging.getLogger(__name__)
HISTORY = 256  # recent transfer times kept for telemetry


class TransportMismatch(ValueError):
    """The trainer sends over another ``weights.transport`` than this actor's."""


# errors no retry can fix (the pools' settings disagree): the receiver stops at the
# first and the actor exits with EXIT_MISMATCH; any other error keeps the current
# weights, rejoins and takes the next version
PERMANENT = (TransportMismatch, KindMismatch)


class SwapTarget(Protocol):
    """What an engine offers the receiver (actor/engines/base.py implements it)."""

    version: int | None

    def stage(self, ann: WeightAnnouncement, source: BucketSource, deadline: float) -> None: ...

    def swap(self, version: int) -> None: ...

    def update_in_place(
        self, ann: WeightAnnouncement, source: BucketSource, deadline: float
    ) -> None: ...


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
        transport: str = "gloo",
        nccl_backend: str | None = None,
        receiver: Receiver | None = None,
        on_fatal: Callable[[str], None] | None = None,
        on_applied: Callable[..., None] | None = None,
    ):
        self.client, self.names, self.actor = client, names, actor
        self.target, self.timeout_s, self.staged = target, timeout_s, staged
        self.on_error = on_error or (lambda msg: None)
        # a permanent error (PERMANENT): the receiver ends and calls on_fatal(message)
        self.on_fatal = on_fatal or (lambda msg: None)
        # each applied version's timings: on_applied(version=, stage_ms=, transfer_ms=)
        # (stage_ms: staged mode only); the actor records them as ``weights`` records
        self.on_applied = on_applied or (lambda **timings: None)
        self.fatal: str | None = None
        # ``receiver``: a ready transport end (tests inject fakes); else weights.transport's
        self.transport = receiver or make_receiver(transport, timeout_s, nccl_backend=nccl_backend)
        self.applied = 0
        self.failed = 0
        self.transfer_ms: deque[float] = deque(maxlen=HISTORY)
        self.joined = False
        self.secret, self.epoch = secret, ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-receiver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 5)
        self.transport.close()

    def _join(self) -> str:
        """Join the transfer; return the weights-stream id to read after."""
        key = self.names.rendezvous
        while not self._stop.is_set() and not self.client.exists(key):
            time.sleep(0.2)
        info = {k.decode(): v.decode() for k, v in self.client.hgetall(key).items()}
        theirs = info.get("transport", "gloo")
        if theirs != self.transport.name:
            raise TransportMismatch(
                f"the trainer sends weights over {theirs!r} but this actor expects "
                f"{self.transport.name!r}; set the same weights.transport for every pool"
            )
        last = self.client.xrevrange(self.names.weights, count=1)
        after = last[0][0].decode() if last else "0"
        join = {"actor": self.actor, "nonce": secrets.token_hex(8), "epoch": info.get("epoch", "")}
        join["mac"] = join_mac(self.secret, join)
        entry = self.client.xadd(self.names.joins, join).decode()
        deadline = time.monotonic() + self.timeout_s
        try:
            self.transport.connect(info, join["nonce"], deadline)
        except Exception as e:  # one line naming the address, not torch's C++ trace
            if not is_join_failure(e):
                raise
            host, port = info.get("host", "?"), info.get("port", "?")
            raise ConnectionError(join_failed(host, port, self.timeout_s, e)) from None
        self._await_accepted(entry, deadline + max(1.0, self.timeout_s / 2))  # + its write
        self.joined, self.epoch = True, join["epoch"]
        log.info("joined the weight transfer as %s (trainer epoch %s)", self.actor, self.epoch)
        return after

    def _await_accepted(self, entry: str, deadline: float) -> None:
        """Wait for the trainer to confirm this join (:func:`accepted_field`): this side of
        the transport can be done while the trainer's failed, and a join counted then
        would wait for versions never sent to it. Unconfirmed by ``deadline``, the join
        fails and the actor joins again."""
        field = accepted_field(self.actor)
        while not self._stop.is_set():
            got = self.client.hget(self.names.rendezvous, field)
            if got is not None and got.decode() == entry:
                return
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"the trainer did not confirm join {entry} of {self.actor} in time "
                    f"(trainer.transfer_timeout_s={self.timeout_s:g} and half as long again):"
                    " this side connected, the trainer's side failed (see its log) or was "
                    "busy past the deadline; joining again"
                )
            time.sleep(0.05)

    def _trainer_changed(self) -> bool:
        """A new trainer process (restart) published a new epoch: join it."""
        epoch = self.client.hget(self.names.rendezvous, "epoch")
        return epoch is not None and epoch.decode() != self.epoch

    def _run(self) -> None:
        after = None
        while not self._stop.is_set():
            try:
                if not self.joined or self._trainer_changed():
                    after = self._join()
                reply = self.client.xread({self.names.weights: after}, count=1, block=500)
                for _s, entries in reply or []:
                    for entry_id, fields in entries:
                        after = entry_id.decode()
                        ann = decode(fields[b"data"], WeightAnnouncement)
                        if self.actor in ann.targets:
                            self._receive_counted(ann)
            except PERMANENT as e:  # retrying cannot help: the actor stops (EXIT_MISMATCH)
                self.failed += 1
                self.fatal = one_line(e)
                log.error("weights refused, the actor stops: %s", self.fatal)
                self._report(self.fatal)
                self.on_fatal(self.fatal)
                return
            except Exception as e:  # keep the current weights; rejoin and take the next
                if self._stop.is_set():
                    return
                self.failed += 1
                log.error("weight update failed, keeping the current weights: %s", one_line(e))
                self._report(one_line(e))
                self.joined = False
                try:
                    self.transport.close()
                except Exception as closing:  # a dead engine (vLLM's channel is an RPC)
                    log.error("closing the weight channel failed: %s", one_line(closing))
                time.sleep(0.5)

    def _receive_counted(self, ann: WeightAnnouncement) -> None:
        """Receive a version announced to this actor, counting it offered and, when it
        fails, failed (pipeline/run/summary.py: an actor whose versions fail more often than
        they apply is not getting its weights)."""
        self._count("weight_versions_offered")
        try:
            self._receive(ann)
        except Exception:
            if not self._stop.is_set():
                self._count("weight_versions_failed")
            raise

    def _report(self, text: str) -> None:
        """``on_error(text)`` (the actor's status hash); with Redis down (an outage, or a
        machine shutting down) a line says so, and the thread goes on instead of dying."""
        try:
            self.on_error(text)
        except redis.RedisError as e:
            log.warning("could not record the error in the status hash: %s", e)

    def _count(self, field: str) -> None:
        try:
            self.client.hincrby(self.names.status(self.actor), field, 1)
        except redis.RedisError as e:  # an outage: the transfer goes on uncounted
            log.warning("could not count %s in the status hash: %s", field, e)

    def _receive(self, ann: WeightAnnouncement) -> None:
        t0 = time.monotonic()
        timings = {}
        if self.staged:
            timings["stage_ms"] = self._receive_staged(ann, t0 + self.timeout_s)
        else:
            self._receive_in_place(ann, t0 + self.timeout_s)
        self.transfer_ms.append(1000 * (time.monotonic() - t0))
        self.applied += 1
        log.info("applied version %d (%.0f ms)", ann.version, self.transfer_ms[-1])
        try:
            self.on_applied(version=ann.version, transfer_ms=self.transfer_ms[-1], **timings)
        except Exception as e:  # a record not written never undoes an applied version
            log.warning("could not record version %d's timings: %s", ann.version, e)

    def _receive_staged(self, ann: WeightAnnouncement, deadline: float) -> float:
        """Stage, then swap; returns the staging time (ms)."""
        t0 = time.monotonic()
        self.target.stage(ann, ReceiverSource(self.transport, ann), deadline)
        stage_ms = 1000 * (time.monotonic() - t0)
        self.target.swap(ann.version)
        return stage_ms

    def _receive_in_place(self, ann: WeightAnnouncement, deadline: float) -> None:
        self.target.update_in_place(ann, ReceiverSource(self.transport, ann), deadline)
