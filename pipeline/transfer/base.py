"""The weight-transfer interface: how buckets travel from the trainer to an actor.

The Redis side is the same for every transport and lives in the publisher and
the receiver (trainer/weight_publisher.py, actor/weight_receiver.py): the
trainer writes ``<run>:rendezvous`` (its epoch plus the transport's own fields),
an actor XADDs a join signed with the run's secret to ``<run>:joins``, the
trainer checks the signature and both sides then open the transport's channel
for that join's nonce. A transport only moves tensors::

    trainer: Sender                                actor: Receiver
      rendezvous() -> fields for <run>:rendezvous
                                                     connect(rendezvous, nonce, deadline)
      accept(actor, nonce, deadline)   <-------->    (the channel is up on both sides)
      send(targets, version,           -------->     begin(version, n, deadline)
           buckets, deadline)                         receive([bucket], deadline) x n
        -> {actor: ms | error}         <--------     finish(error or None)
      drop(actor)                                    close()

Every call takes a deadline (``time.monotonic()`` seconds) and raises when it
passes, so a dead peer costs at most that. ``send`` reaches every target in one
call (the transport decides how: a pair group per actor in threads, one
broadcast group, IPC handles) and reports each target's outcome, so the
publisher can drop the failed ones. Implementations: ``gloo`` (gloo.py, CPU),
``nccl`` (nccl.py: one broadcast group; backend nccl on GPUs or gloo for CI)
and ``cuda_ipc`` (cuda_ipc.py: same host, the actor maps the trainer's buffers).
``device`` says where a side's buckets must live.

Engines take a version through a :class:`BucketSource` (``fetch(i, out, deadline)``,
buckets in order): :class:`ReceiverSource` reads one from a transport and checks
each bucket's checksum; :class:`TensorSource` serves buckets already in memory.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pipeline.messages import WeightAnnouncement
from pipeline.transfer.buckets import checksum


class Sender(Protocol):
    """Trainer side: one channel per joined actor."""

    name: str
    device: torch.device  # where the flat buckets handed to send() must live

    def rendezvous(self) -> dict[str, str]:
        """Fields an actor needs to connect (written to ``<run>:rendezvous``)."""
        ...

    def accept(self, actor: str, nonce: str, deadline: float) -> None:
        """Open the channel for a verified join; raise if the actor never connects."""
        ...

    def send(
        self, targets: list[str], version: int, buckets: list[torch.Tensor], deadline: float
    ) -> dict[str, float | Exception]:
        """Send every bucket of ``version`` to each target before ``deadline``; per
        target the milliseconds it took, or the error that stopped it."""
        ...

    def drop(self, actor: str) -> None:
        """Forget the actor's channel (it failed or left)."""
        ...

    def members(self) -> list[str]:
        """Actors with an open channel, sorted."""
        ...

    def close(self) -> None: ...


class Receiver(Protocol):
    """Actor side: one channel to the trainer."""

    name: str
    device: torch.device  # where the buckets handed to receive() must live

    def connect(self, rendezvous: dict[str, str], nonce: str, deadline: float) -> None:
        """Open the channel announced in ``rendezvous`` for the join ``nonce``."""
        ...

    def begin(self, version: int, buckets: int, deadline: float) -> None:
        """A version of ``buckets`` buckets starts (before its first receive)."""
        ...

    def receive(self, buckets: list[torch.Tensor], deadline: float) -> None:
        """Fill ``buckets`` (preallocated, in order) before ``deadline``; raise otherwise."""
        ...

    def finish(self, error: str | None) -> None:
        """The version ended: every bucket arrived and passed its checksum (None), or not."""
        ...

    def close(self) -> None: ...


class BucketSource(Protocol):
    """Fills bucket ``index`` of one announced version (in order, 0 to n-1)."""

    def fetch(self, index: int, out: torch.Tensor, deadline: float) -> None: ...


class ReceiverSource:
    """Bucket ``i`` of ``ann`` from a transport, checked against its checksum; staged
    through host buffers when ``out`` lives where the transport cannot write."""

    def __init__(self, receiver: Receiver, ann: WeightAnnouncement):
        self.receiver, self.ann = receiver, ann

    def fetch(self, index: int, out: torch.Tensor, deadline: float) -> None:
        try:
            if index == 0:
                self.receiver.begin(self.ann.version, len(self.ann.buckets), deadline)
            self._fetch(index, out, deadline)
        except Exception as e:  # tell the trainer now rather than at its deadline
            self.receiver.finish(f"{type(e).__name__}: {e}")
            raise
        if index == len(self.ann.buckets) - 1:
            self.receiver.finish(None)

    def _fetch(self, index: int, out: torch.Tensor, deadline: float) -> None:
        if out.device == self.receiver.device:
            self.receiver.receive([out], deadline)
        else:
            bounce = torch.empty(out.shape, dtype=out.dtype, device=self.receiver.device)
            self.receiver.receive([bounce], deadline)
            out.copy_(bounce)
        if checksum([out], self.ann.checksum_kind)[0] != self.ann.checksums[index]:
            raise RuntimeError(f"version {self.ann.version} bucket {index} failed its checksum")


class TensorSource:
    """Buckets already in memory (tests, benchmarks, a same-process copy)."""

    def __init__(self, buckets: list[torch.Tensor]):
        self.buckets = buckets

    def fetch(self, index: int, out: torch.Tensor, deadline: float) -> None:
        out.copy_(self.buckets[index])


def file_source(path: str) -> TensorSource:
    """The buckets ``b0``, ``b1``, ... of a safetensors file (what the vllm engine's
    ``stage`` writes for its worker when the buckets are already in the actor's memory)."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    return TensorSource([tensors[f"b{i}"] for i in range(len(tensors))])
