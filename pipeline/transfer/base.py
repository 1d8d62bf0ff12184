"""The weight-transfer interface: how buckets travel from the trainer to an actor.

The Redis side is the same for every transport and lives in the publisher and
the receiver (pipeline/weight_publisher.py, pipeline/weight_receiver.py): the
trainer writes ``<run>:rendezvous`` (its epoch plus the transport's own fields),
an actor XADDs a join signed with the run's secret to ``<run>:joins``, the
trainer checks the signature and both sides then open the transport's channel
for that join's nonce. A transport only moves tensors::

    trainer: Sender                                actor: Receiver
      rendezvous() -> fields for <run>:rendezvous
                                                     connect(rendezvous, nonce, deadline)
      accept(actor, nonce, deadline)   <-------->    (the channel is up on both sides)
      send(actor, buckets, deadline)   -------->     receive(buckets, deadline)
      drop(actor)                                    close()

Every call takes a deadline (``time.monotonic()`` seconds) and raises when it
passes, so a dead peer costs at most that. ``send`` may run for several actors
at once from different threads; each actor has its own channel.
Implementations: ``gloo`` (pipeline/transfer/gloo.py). ``nccl`` and ``cuda_ipc``
plug in here (issue 12); ``device`` says where their buckets must live.
"""

from __future__ import annotations

from typing import Protocol

import torch


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

    def send(self, actor: str, buckets: list[torch.Tensor], deadline: float) -> None:
        """Send every bucket to ``actor`` before ``deadline``; raise otherwise."""
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

    def receive(self, buckets: list[torch.Tensor], deadline: float) -> None:
        """Fill ``buckets`` (preallocated, in order) before ``deadline``; raise otherwise."""
        ...

    def close(self) -> None: ...
