"""Weight-transfer transports (``weights.transport``): see base.py for the interface.

``gloo``: pair groups over TCP, CPU buckets, any hosts (the default).
``nccl``: one broadcast group over NCCL, GPU buckets, one GPU per rank
(``weights.nccl_backend=gloo`` runs its code on the CPU, for tests).
``cuda_ipc``: the actor maps the trainer's GPU buffers; same host only.
"""

from __future__ import annotations

from pipeline.transfer.base import (
    BucketSource,
    Receiver,
    ReceiverSource,
    Sender,
    TensorSource,
    file_source,
)

TRANSPORTS = ("gloo", "nccl", "cuda_ipc")
__all__ = [
    "TRANSPORTS",
    "BucketSource",
    "Receiver",
    "ReceiverSource",
    "Sender",
    "TensorSource",
    "file_source",
    "make_receiver",
    "make_sender",
]


def _check(name: str, nccl_backend: str | None) -> None:
    """At start-up: the transport exists and this machine can run it."""
    if name not in TRANSPORTS:
        raise ValueError(f"weights.transport={name!r} is not available; use one of {TRANSPORTS}")
    if name == "nccl" and nccl_backend is not None:
        from pipeline.transfer.nccl import check_backend

        check_backend(nccl_backend)
    if name == "cuda_ipc":
        from pipeline.transfer.cuda_ipc import check_cuda

        check_cuda()


def make_sender(name: str, host: str, timeout_s: float, *, nccl_backend: str = "nccl") -> Sender:
    """The trainer side of transport ``name``; ``host`` is the address actors reach.
    Raises ValueError naming ``weights.transport`` when this machine cannot run it."""
    _check(name, nccl_backend)
    if name == "nccl":
        from pipeline.transfer.nccl import NcclSender

        return NcclSender(host, timeout_s, backend=nccl_backend)
    if name == "cuda_ipc":
        from pipeline.transfer.cuda_ipc import IpcSender

        return IpcSender(timeout_s)
    from pipeline.transfer.gloo import GlooSender

    return GlooSender(host, timeout_s)


def make_receiver(name: str, timeout_s: float, *, nccl_backend: str | None = None) -> Receiver:
    """The actor side of transport ``name``. The nccl backend in use comes with the
    trainer's rendezvous; ``nccl_backend`` (the actor's config) checks this machine early."""
    _check(name, nccl_backend)
    if name == "nccl":
        from pipeline.transfer.nccl import NcclReceiver

        return NcclReceiver(timeout_s)
    if name == "cuda_ipc":
        from pipeline.transfer.cuda_ipc import IpcReceiver

        return IpcReceiver(timeout_s)
    from pipeline.transfer.gloo import GlooReceiver

    return GlooReceiver(timeout_s)
