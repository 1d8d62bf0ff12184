"""Trainer side of the weight transfer: a background thread that sends the
newest snapshot of the weights to every actor that joined, all at once.

::

    reads   <run>:joins (actors asking in), the trainer's submitted snapshots
    writes  <run>:weights announcements, <run>:rendezvous (its address, and each accepted
            join: ``accepted:<actor>`` = the join's entry id), <run>:published_version;
            the buckets over the transport (weights.transport, pipeline/transfer/);
            with ``status``: the trainer status hash's publish counters (HINCRBY)
    blocks  never the training loop: submit() copies and returns; the transport reaches
            all actors in one send (gloo: threads; nccl: one broadcast group;
            cuda_ipc: one export), so a dead or slow actor costs at most
            ``timeout_s`` once (not per actor) and is dropped

When several versions are submitted while one is in flight, only the newest
is sent. An actor that joins (or re-joins after a failure) is sent the
current version at once.

Honest counts: a version is *published* once at least one actor received it
whole; a version that no actor received before a newer one replaced it (or
before close()) is *unreceived*. So ``published + unreceived`` equals the
versions submitted, except the newest one while it is still undecided. Failures
(a send step that raised) and dropped actors are counted, and the last error's
text is kept. With ``status`` (a PoolStatus), these live in the trainer's status
hash as ``weight_updates_published``, ``weight_versions_unreceived``,
``weight_publish_failures``, ``actors_dropped`` (HINCRBY: they survive a
trainer restart) and ``last_publish_error``. A join without the run's secret is
refused: logged, counted (``joins_refused``; ``weight_joins_refused`` in the status
hash) and its actor name kept in ``refused``.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections import deque

import redis
import torch

from pipeline.messages import SCHEMA_VERSION, BucketSpec, WeightAnnouncement, encode
from pipeline.streams import Lua, Names, publish
from pipeline.telemetry import read_statuses
from pipeline.torch_logs import accept_failed
from pipeline.transfer import Sender, make_sender
from pipeline.transfer.buckets import (
    accepted_field,
    bucket_layout,
    bucket_sums,
    flatten,
    join_mac,
    named_tensors,
)

log = logging.getLogger(__name__)

Snapshot = tuple[int, list[BucketSpec], list[torch.Tensor]]
HISTORY = 256  # recent transfer times and dropped actors kept for telemetry
ALIVE_S = 15.0  # an actor whose status hash beat this recently may still join (close())


# the rendezvous hash replaced whole in one step. A script, not MULTI/EXEC: a script goes
# through the client like any command (and, in sentinel or cluster mode, through
# pipeline/streams/durable.py to the slot's primary), so a trainer starting while Redis
# fails over waits out the failover within redis.reconnect_s; redis-py's ClusterPipeline
# has no such budget and failed at once
_SET_RENDEZVOUS = Lua(
    "redis.call('DEL', KEYS[1]) redis.call('HSET', KEYS[1], unpack(ARGV)) return 1"
)


def set_rendezvous(client: redis.Redis, names: Names, fields: dict[str, str]) -> None:
    """Replace the run's rendezvous hash (where actors join the trainer) with ``fields``."""
    args = [x for item in fields.items() for x in item]
    _SET_RENDEZVOUS(client, [names.rendezvous], args, what="the weight rendezvous")


class WeightPublisher:
    def __init__(
        self,
        client: redis.Redis,
        names: Names,
        host: str,
        bucket_mb: float,
        timeout_s: float,
        secret: str,
        *,
        status=None,
        transport: str = "gloo",
        nccl_backend: str = "nccl",
        sender: Sender | None = None,
        kind: str = "full",
    ):
        self.client, self.names, self.status = client, names, status
        self.kind = kind  # announced: "full" weights, or a "lora" adapter (model.lora)
        self.bucket_bytes, self.timeout_s = int(bucket_mb * 1024 * 1024), timeout_s
        # ``sender``: a ready transport end (tests inject fakes); else weights.transport's
        self.sender = sender or make_sender(transport, host, timeout_s, nccl_backend=nccl_backend)
        self.secret, self.epoch = secret, secrets.token_hex(8)
        # an epoch per trainer process: actors that joined an earlier trainer see it
        # change and join again; joins addressed to earlier trainers are skipped
        last_join = client.xrevrange(names.joins, count=1)
        self.joins_id = last_join[0][0].decode() if last_join else "0"
        rendezvous = {"epoch": self.epoch, **self.sender.rendezvous()}
        set_rendezvous(client, names, rendezvous)
        self.published = 0  # versions received whole by at least one actor
        self.unreceived = 0  # versions no actor received
        self.failures = 0
        self.actors_dropped = 0
        self.joins_refused = 0  # joins read and refused: bad or missing run secret
        self.last_error = ""
        self.refused: deque[str] = deque(maxlen=HISTORY)  # the actors those joins named
        self.dropped: deque[str] = deque(maxlen=HISTORY)  # recent dropped actors
        self.transfer_ms: deque[float] = deque(maxlen=HISTORY)  # recent per-actor transfers
        self._latest: Snapshot | None = None
        self._latest_received = False
        self._pending: Snapshot | None = None
        self._cv = threading.Condition()
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="weight-publisher", daemon=True)
        self._thread.start()

    # -- the trainer's side ---------------------------------------------------
    def submit(self, version: int, params) -> None:
        """Snapshot the weights now (one copy); the thread sends the newest snapshot.

        ``params``: an nn.Module, a ``{HF name: tensor}`` mapping or (name, tensor)
        pairs (a backend's full parameter set; under ZeRO-3 the gathered dict).
        """
        named = named_tensors(params)
        layout = bucket_layout(named, self.bucket_bytes)
        flat = flatten(dict(named), layout, self.sender.device)
        with self._cv:
            replaced, self._pending = self._pending, (version, layout, flat)
            self._cv.notify()
        if replaced is not None:  # never sent: a newer version took its place
            log.info("version %d replaced by %d before it was sent", replaced[0], version)
            self._count("unreceived", "weight_versions_unreceived")

    def members(self) -> list[str]:
        """Actors with an open transfer channel."""
        return self.sender.members()

    def idle(self) -> bool:
        with self._cv:
            return self._pending is None and not self._busy

    def close(self, timeout_s: float = 30.0) -> None:
        """Let the last submitted version go out (bounded), then stop the thread.

        While no actor has received that version and some actor is alive (its status
        hash beat within :data:`ALIVE_S`), keep accepting joins until ``timeout_s``:
        an actor that joins late (a short run, a loaded machine) is sent the last
        version then, instead of the trainer leaving with it unreceived."""
        deadline = time.monotonic() + timeout_s
        while not self.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        waited = False
        while self._last_unreceived() and time.monotonic() < deadline and self._actors_alive():
            if not waited:
                log.info(
                    "waiting up to %.0f s for an actor to join for the last version",
                    deadline - time.monotonic(),
                )
                waited = True
            time.sleep(0.2)
        with self._cv:
            self._stop = True
            left, self._pending = self._pending, None
            self._cv.notify()
        self._thread.join(timeout=self.timeout_s + 5)
        if left is not None:
            self._count("unreceived", "weight_versions_unreceived")
        self._retire_latest()
        self.sender.close()

    def _last_unreceived(self) -> bool:
        with self._cv:
            pending = self._pending is not None or self._busy
        return pending or (self._latest is not None and not self._latest_received)

    def _actors_alive(self) -> bool:
        """Some actor's status hash beat within ALIVE_S (and it has not stopped)."""
        try:
            statuses = read_statuses(self.client, self.names)
        except redis.RedisError:
            return False  # no Redis: nothing to wait for
        return any(
            st.get("role") == "actor"
            and st.get("state") != "stopped"
            and time.time() - float(st.get("heartbeat", 0)) < ALIVE_S
            for st in statuses.values()
        )

    # -- the thread -------------------------------------------------------------
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
                    self._retire_latest()
                    self._latest, self._latest_received = job, False
                    self._send(job, self.sender.members())
                elif joined and self._latest is not None:
                    self._send(self._latest, joined)  # catch a (re)joined actor up at once
            except (redis.ConnectionError, redis.TimeoutError) as e:  # after the retries
                log.error("weight publisher step failed: redis did not answer (%s)", e)
                self._error(f"publish step failed: {type(e).__name__}: {e}")
            except Exception as e:  # the trainer must go on; the failure is logged and counted
                log.exception("weight publisher step failed")
                self._error(f"publish step failed: {type(e).__name__}: {e}")
            finally:
                with self._cv:
                    self._busy = False

    def _retire_latest(self) -> None:
        """The current version's outcome is final: count it if nobody received it."""
        if self._latest is not None and not self._latest_received:
            log.warning("version %d was received by no actor", self._latest[0])
            self._count("unreceived", "weight_versions_unreceived")
        self._latest_received = True  # counted once

    def _accept_joins(self) -> list[str]:
        """Accept the joins that came in since the last look, each actor's newest only
        (an older one of the same actor was given up: accepting it would cost a whole
        deadline), and confirm each accepted one to its actor (:func:`accepted_field`)."""
        newest: dict[str, tuple[str, str]] = {}  # actor -> (entry id, nonce)
        reply = self.client.xread({self.names.joins: self.joins_id}, count=100)
        for _s, entries in reply or []:
            for entry_id, fields in entries:
                self.joins_id = entry_id.decode()
                f = {k.decode(): v.decode() for k, v in fields.items()}
                actor, nonce = f.get("actor", "?"), f.get("nonce", "")
                if f.get("epoch") != self.epoch:
                    continue  # addressed to an earlier trainer
                if not hmac.compare_digest(f.get("mac", ""), join_mac(self.secret, f)):
                    log.error("rejected a join as %r: bad or missing run secret", actor)
                    self.refused.append(actor)
                    self._count("joins_refused", "weight_joins_refused")
                    continue
                if actor in newest:
                    log.info("skipping join %s of %s: it joined again", newest[actor][0], actor)
                newest[actor] = (self.joins_id, nonce)
        joined = []
        for actor, (entry, nonce) in newest.items():
            try:
                self.sender.accept(actor, nonce, time.monotonic() + self.timeout_s)
            except Exception as e:  # one line naming the address, not torch's C++ trace
                where = self.sender.rendezvous()
                why = accept_failed(actor, where.get("host"), where.get("port"), self.timeout_s, e)
                log.error("%s", why)
                self._error(why)
                continue
            # a Redis error here propagates (_run logs it): the actor, unconfirmed, rejoins
            self.client.hset(self.names.rendezvous, accepted_field(actor), entry)
            joined.append(actor)
            log.info("actor %s joined the weight transfer", actor)
        return joined

    def _announce(self, snapshot: Snapshot, targets: list[str]) -> None:
        version, layout, flat = snapshot
        ann = WeightAnnouncement(
            schema=SCHEMA_VERSION,
            version=version,
            dtype=str(flat[0].dtype).removeprefix("torch."),
            buckets=layout,
            **bucket_sums(flat),
            targets=targets,
            created=time.time(),
            kind=self.kind,
        )
        publish(
            self.client,
            self.names.weights,
            encode(ann),
            maxlen=100,
            version=version,
            kind=self.kind,
            targets=",".join(targets),
            buckets=len(layout),
            bytes=sum(b.numel() * b.element_size() for b in flat),
        )

    def _send(self, snapshot: Snapshot, targets: list[str]) -> None:
        """Send to every target at once; drop the ones that fail or miss the deadline."""
        version, _, flat = snapshot
        self._announce(snapshot, targets)
        deadline = time.monotonic() + self.timeout_s
        results = self.sender.send(targets, version, flat, deadline)
        received = []
        for actor in targets:
            outcome = results.get(actor, TimeoutError("no answer by the deadline"))
            if isinstance(outcome, Exception):  # a dead or slow actor is dropped
                log.error("dropping actor %s from the weight transfer: %s", actor, outcome)
                self.sender.drop(actor)
                self.dropped.append(actor)
                self._count("actors_dropped", "actors_dropped")
                self._error(f"actor {actor} dropped at version {version}: {outcome}", failure=False)
                continue
            received.append(actor)
            self.transfer_ms.append(outcome)
            log.info("sent version %d to %s in %.0f ms", version, actor, outcome)
        if received and not self._latest_received and self._latest is snapshot:
            self._latest_received = True
            self._count("published", "weight_updates_published")
            self.client.set(self.names.published_version, version)

    # -- counters -----------------------------------------------------------------
    def _count(self, attr: str, field: str) -> None:
        setattr(self, attr, getattr(self, attr) + 1)
        if self.status is not None:
            try:
                self.status.incr(field)
            except redis.RedisError as e:  # the count stays local; the next one retries Redis
                log.warning("could not count %s in the status hash: %s", field, e)

    def _error(self, text: str, failure: bool = True) -> None:
        """Keep the text; count a failure (a publish step or a join that raised)."""
        self.last_error = text[:500]
        if failure:
            self._count("failures", "weight_publish_failures")
        if self.status is not None:
            try:
                self.status.set(last_publish_error=self.last_error)
            except redis.RedisError as e:
                log.warning("could not record the publish error in the status hash: %s", e)
