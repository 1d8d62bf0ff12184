"""Weight-transfer transports (``weights.transport``): see base.py for the interface."""

from __future__ import annotations

from pipeline.transfer.base import (
    BucketSource,
    Receiver,
    ReceiverSource,
    Sender,
    TensorSource,
)

TRANSPORTS = ("gloo",)
__all__ = [
    "BucketSource",
    "Receiver",
    "ReceiverSource",
    "Sender",
    "TensorSource",
    "make_receiver",
    "make_sender",
]


def _check(name: str) -> None:
    if name not in TRANSPORTS:
        raise ValueError(
            f"weights.transport={name!r} is not available; use one of {TRANSPORTS} "
            "(nccl and cuda_ipc are planned, see issue 12)"
        )


def make_sender(name: str, host: str, timeout_s: float) -> Sender:
    """The trainer side of transport ``name``; ``host`` is the address actors reach."""
    _check(name)
    from pipeline.transfer.gloo import GlooSender

    return GlooSender(host, timeout_s)


def make_receiver(name: str, timeout_s: float) -> Receiver:
    """The actor side of transport ``name``."""
    _check(name)
    from pipeline.transfer.gloo import GlooReceiver

    return GlooReceiver(timeout_s)
