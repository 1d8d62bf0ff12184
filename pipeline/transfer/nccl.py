"""The ``nccl`` transport: one broadcast group of trainer rank 0 and the actors,
separate from the trainer's own group, re-formed whenever its membership changes.

The group's backend is NCCL on GPUs; ``weights.nccl_backend=gloo`` runs the very
same code on the CPU (CI). Its rendezvous is the trainer's TCPStore
(channel.py), reached through ``<run>:rendezvous`` after a signed join; the
group itself lives under a fresh seal per membership (``g<n>``, a random key sent
to each member in its own sealed plan). Every key below is read and written
through a channel.SealedStore: a join's keys under a digest of its nonce, a group's
under a digest of its seal, every value HMAC-sealed, so another client of the
store can neither learn a nonce nor plant a plan, an ack or a rendezvous value::

    trainer send(targets, v, buckets)           actor (its receiver thread)
      targets differ from the group's members:
        <nonce> plan/<v> = "g<n> <rank> <world> <seal>"   begin(v): read the plan
        wait for <seal> arrived/<rank> of each  <--  set <seal> arrived/<rank>
        <seal> go = 1 (all there) or 0 (give up) -->  go 0: fail this version, rejoin
        form the group on <seal> (rank 0)             form the group (its rank)
      else: the plan names the current group
      broadcast each bucket from rank 0  ------->  receive(bucket) x n (checksummed)
      wait for <nonce> ack/<v> of each     <----   finish(): "ok" or "error: ..."

Outcomes are per actor: an actor that acked got the version whole. Any failure
of a collective (a dead or slow member) costs at most the deadline; the group is
then torn down (aborted under NCCL), the members that did not ack are dropped
and rejoin, and the next send forms a new group of whoever is joined then.

What re-forming costs: every membership change (a join, a catch-up send to a
newly joined actor, a drop) means one store barrier plus a new communicator
(NCCL: ``ncclCommInitRank`` across the members, typically 0.1-2 s; gloo: a
TCP mesh, milliseconds here), during which no member receives. Joins and drops
are rare (start-up, restarts), so steady-state versions reuse one group and pay
one broadcast: the trainer sends the bytes once, not once per actor.

NCCL error handling: the group's own timeout is set past our deadline (we
poll and abort first), and ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 2
(abort the communicator and raise) so a dead actor never tears down the
trainer; ``TORCH_NCCL_USE_COMM_NONBLOCKING=1`` bounds communicator set-up by
the timeout. NCCL cannot place two ranks on one GPU: each actor worker needs
its own device (on a one-GPU host use ``cuda_ipc``). Not yet run on a GPU.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import threading
import time

import torch
import torch.distributed as dist

from pipeline.transfer import channel
from pipeline.transfer.channel import OK, SealedStore, forget, local_address, wait_get, wait_work

log = logging.getLogger(__name__)
BACKENDS = ("nccl", "gloo")
ACK_GRACE_S = 1.0  # after a failed broadcast: how long acks of whole receivers may take


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_group(backend: str, store, rank: int, world: int, host: str, timeout_s: float):
    """A ``world``-rank group of ``backend`` on ``store`` (the group's SealedStore)."""
    timeout = datetime.timedelta(seconds=max(timeout_s, 0.1))
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, world, opts)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # raise, never kill
    os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "1")  # bounded set-up
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = 2 * timeout  # past our deadline: we poll, and abort first
    return dist.ProcessGroupNCCL(store, rank, world, opts)


def destroy(group) -> None:
    """Tear a group down (NCCL: abort its communicator, so nothing waits on it)."""
    if group is None:
        return
    try:
        group.abort() if isinstance(group, _nccl_class()) else group.shutdown()
    except Exception as e:  # a broken group may refuse; it is dropped either way
        log.debug("group tear-down: %s", e)


def _nccl_class():
    return getattr(dist, "ProcessGroupNCCL", ())


def broadcast(group, buckets: list[torch.Tensor], deadline: float) -> None:
    """Each bucket from rank 0, one in flight at a time, all within the deadline."""
    for i, bucket in enumerate(buckets):
        work = group.broadcast(bucket, 0)
        wait_work(work, deadline, f"broadcast of bucket {i}")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"weights.nccl_backend={backend!r}; use one of {BACKENDS}")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError(
            "weights.transport=nccl needs CUDA GPUs and a torch built with NCCL, and this "
            "machine has none; use weights.transport=gloo (CPU), or cuda_ipc on one GPU host "
            "(weights.nccl_backend=gloo runs the nccl transport's code on the CPU, for tests)"
        )


class NcclSender:
    name = "nccl"

    def __init__(self, host: str, timeout_s: float, backend: str = "nccl"):
        check_backend(backend)
        self.host, self.timeout_s, self.backend = host, timeout_s, backend
        self.device = _device(backend)
        self.store, self.port = channel.serve(host, timeout_s)
        self._nonces: dict[str, str] = {}
        self._lock = threading.Lock()  # members() is read from other threads
        self._group, self._key, self._name, self._seal = None, None, "", ""
        self._formed = 0  # groups formed so far (names g0, g1, ...)

    def rendezvous(self) -> dict[str, str]:
        return {
            "transport": self.name,
            "backend": self.backend,
            "host": self.host,
            "port": str(self.port),
        }

    def accept(self, actor: str, nonce: str, deadline: float) -> None:
        wait_get(SealedStore(self.store, nonce), "hello", deadline)  # it reached the store
        with self._lock:
            self._nonces[actor] = nonce

    def members(self) -> list[str]:
        with self._lock:
            return sorted(self._nonces)

    def drop(self, actor: str) -> None:
        with self._lock:
            self._nonces.pop(actor, None)

    def close(self) -> None:
        destroy(self._group)
        self._group, self._key = None, None
        with self._lock:
            self._nonces.clear()

    def send(
        self, targets: list[str], version: int, buckets: list[torch.Tensor], deadline: float
    ) -> dict[str, float | Exception]:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the publisher thread's own current device
        t0 = time.monotonic()
        with self._lock:
            nonces = {a: self._nonces[a] for a in targets if a in self._nonces}
        failed: dict[str, Exception] = {
            a: KeyError(f"{a} has no open channel") for a in targets if a not in nonces
        }
        members = sorted(nonces)
        if not members:  # nobody to send to: no group (a one-rank group would be a waste)
            return failed
        try:
            self._ensure_group(members, nonces, version, deadline)
            broadcast(self._group, buckets, deadline)
            ack_by = deadline
        except Exception as e:
            log.error("broadcast of version %d failed: %s", version, e)
            self._teardown()
            failed.update({a: e for a in members})  # unless their ack says otherwise
            ack_by = min(deadline, time.monotonic() + ACK_GRACE_S)
        results = self._acks(members, nonces, version, ack_by, t0, failed)
        for a in members:
            forget(SealedStore(self.store, nonces[a]), f"plan/{version}", f"ack/{version}")
        return {a: results.get(a, failed.get(a)) for a in targets}

    def _teardown(self) -> None:
        destroy(self._group)
        self._group, self._key = None, None

    def _ensure_group(self, members, nonces, version: int, deadline: float) -> None:
        """The broadcast group of exactly these members (formed anew if they changed)."""
        key = tuple((a, nonces[a]) for a in members)
        world = len(members) + 1
        if key == self._key:
            for rank, a in enumerate(members, start=1):
                plan = f"{self._name} {rank} {world} {self._seal}"
                SealedStore(self.store, nonces[a]).set(f"plan/{version}", plan)
            return
        self._teardown()
        name, seal = f"g{self._formed}", secrets.token_hex(16)
        self._formed += 1
        for rank, a in enumerate(members, start=1):  # the group's seal, to members only
            SealedStore(self.store, nonces[a]).set(
                f"plan/{version}", f"{name} {rank} {world} {seal}"
            )
        group_store = SealedStore(self.store, seal)
        missing = []
        for rank, a in enumerate(members, start=1):
            try:
                wait_get(group_store, f"arrived/{rank}", deadline)
            except TimeoutError:
                missing.append(a)
        if missing:
            group_store.set("go", "0")
            raise RuntimeError(f"group {name} did not form: {missing} never arrived")
        group_store.set("go", "1")
        self._group = make_group(
            self.backend, group_store, 0, world, self.host, deadline - time.monotonic()
        )
        self._key, self._name, self._seal = key, name, seal
        log.info("formed broadcast group %s of %s (%d ranks)", name, members, world)

    def _acks(self, members, nonces, version, ack_by, t0, failed) -> dict:
        """Each member's ack (all by ``ack_by``): ok, its error, or the failure it met."""
        results: dict[str, float | Exception] = {}
        for a in members:
            try:
                got = wait_get(SealedStore(self.store, nonces[a]), f"ack/{version}", ack_by)
            except TimeoutError as e:
                results[a] = failed.get(a, e)
                continue
            if got == OK:  # whole, even if the broadcast broke for someone else later
                results[a] = 1000 * (time.monotonic() - t0)
            else:
                results[a] = RuntimeError(f"{a} could not take version {version}: {got}")
        return results


class NcclReceiver:
    name = "nccl"

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.device = torch.device("cpu")  # set by connect() from the trainer's backend
        self.store, self.nonce, self.backend, self.here = None, "", "", ""
        self.channel: SealedStore | None = None  # this join's keys on the store
        self.group, self.group_name = None, ""
        self._version: int | None = None

    def connect(self, rendezvous: dict[str, str], nonce: str, deadline: float) -> None:
        self.close()
        self.backend = rendezvous.get("backend", "nccl")
        check_backend(self.backend)
        self.device = _device(self.backend)
        host, port = rendezvous["host"], int(rendezvous["port"])
        self.store = channel.join(host, port, deadline)
        self.here = local_address(host, port)
        self.nonce = nonce
        self.channel = SealedStore(self.store, nonce)
        self.channel.set("hello", "1")

    def begin(self, version: int, buckets: int, deadline: float) -> None:
        if self.channel is None:
            raise RuntimeError("receive before connect(): join the transfer first")
        self._version = version
        name, rank, world, seal = wait_get(self.channel, f"plan/{version}", deadline).split()
        if name == self.group_name:
            return
        destroy(self.group)
        self.group, self.group_name = None, ""
        group_store = SealedStore(self.store, seal)
        group_store.set(f"arrived/{rank}", "1")
        if wait_get(group_store, "go", deadline) != "1":
            raise RuntimeError(f"the trainer gave up forming group {name}: a member was missing")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.group = make_group(
            self.backend, group_store, int(rank), int(world), self.here, deadline - time.monotonic()
        )
        self.group_name = name

    def receive(self, buckets: list[torch.Tensor], deadline: float) -> None:
        if self.group is None:
            raise RuntimeError("receive() outside a version: begin() first")
        try:
            broadcast(self.group, buckets, deadline)
        except Exception:
            self._leave()  # out of step with the group now: the next version re-forms it
            raise

    def finish(self, error: str | None) -> None:
        if self.channel is None or self._version is None:
            return
        try:
            self.channel.set(f"ack/{self._version}", error and f"error: {error}" or OK)
        except Exception as e:  # the trainer then drops us at its deadline
            log.warning("could not ack version %s: %s", self._version, e)
        if error:
            self._leave()
        self._version = None

    def _leave(self) -> None:
        destroy(self.group)
        self.group, self.group_name = None, ""

    def close(self) -> None:
        self._leave()
        self.store, self.channel, self._version = None, None, None
