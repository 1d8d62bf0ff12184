"""The ``cuda_ipc`` transport: trainer and actor on one host; the actor maps the
trainer's GPU buffers and copies them into its staging on a side stream.

The trainer keeps one persistent export buffer per bucket (re-made only when
the layout changes) and shares each with ``UntypedStorage._share_cuda_()``
(the call torch.multiprocessing's reductions use). Its handle tuple travels as
JSON (msgspec, never pickle) on the channel of channel.py, whose TCPStore
listens on 127.0.0.1 only: no other host can read a handle. Every key goes through
the join's channel.SealedStore (under a digest of its nonce, values HMAC-sealed), so
another local client of the store can neither plant an offer nor an ack::

    trainer send(targets, v, buckets)              actor (its receiver thread)
      copy buckets -> export buffers, sync
      plan/<nonce>/<v> = IpcOffer (version,   -->  begin(v): read the offer; a new
        layout id, one handle per bucket)          layout id: map its buffers (once)
                                                   receive(bucket i): copy mapped[i] ->
                                                   staging on a side stream, wait for it
      wait for ack/<nonce>/<v>                <--  finish(): "ok" or "error: ..."
      (only then may the buffers be rewritten)

The export buffers are overwritten by the next send only after this one
returned: every target acked, failed or passed the deadline (and was dropped).
A dropped actor still copying would read a mix; its checksums catch that.
The ack is sent after the last bucket passed its checksum, so ``ok`` means the
actor holds the version whole. The CUDA parts (export, map, copy) sit behind
:class:`CudaBuffers` and :class:`CudaMapper` so CPU tests drive the protocol
with fakes; the real copy is tested on a GPU (``-m gpu``). Not yet run on a GPU.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import msgspec
import torch

from pipeline.transfer import channel
from pipeline.transfer.channel import OK, SealedStore, forget, wait_get

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"


class IpcBuffer(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """One shared CUDA storage: the tuple of ``UntypedStorage._share_cuda_()``, plus
    what the actor needs to view it as a flat bucket."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    numel: int
    dtype: str


class IpcOffer(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    version: int
    layout: int  # changes whenever the trainer re-made its export buffers
    buffers: list[IpcBuffer]


def encode_offer(offer: IpcOffer) -> bytes:
    return msgspec.json.encode(offer)


def decode_offer(data: bytes | str) -> IpcOffer:
    """The offer, or ValueError saying what is wrong with the message."""
    try:
        offer = msgspec.json.decode(data, type=IpcOffer)
    except msgspec.DecodeError as e:
        raise ValueError(f"bad cuda_ipc offer from the trainer: {e}") from e
    for b in offer.buffers:
        if not isinstance(getattr(torch, b.dtype, None), torch.dtype):
            raise ValueError(f"bad cuda_ipc offer: unknown dtype {b.dtype!r}")
    return offer


def check_cuda() -> None:
    if not torch.cuda.is_available():
        raise ValueError(
            "weights.transport=cuda_ipc needs a CUDA GPU shared by the trainer and the "
            "actor on one host, and this machine has none; use weights.transport=gloo "
            "(CPU, any hosts) or nccl (GPUs on several hosts)"
        )


class CudaBuffers:
    """The trainer's export buffers on its current GPU, shared by CUDA IPC handle."""

    def __init__(self):
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.tensors: list[torch.Tensor] = []
        self.handles: list[IpcBuffer] = []
        self.layout = 0

    def load(self, buckets: list[torch.Tensor]) -> None:
        """Copy the buckets in (re-making and re-sharing the buffers on a new layout)."""
        torch.cuda.set_device(self.device)
        shapes = [(b.numel(), b.dtype) for b in buckets]
        if shapes != [(t.numel(), t.dtype) for t in self.tensors]:
            self.tensors = [torch.empty(n, dtype=d, device=self.device) for n, d in shapes]
            self.handles = [self._share(t) for t in self.tensors]
            self.layout += 1
        for t, b in zip(self.tensors, buckets, strict=True):
            t.copy_(b.reshape(-1), non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # in place before any ack wait

    @staticmethod
    def _share(t: torch.Tensor) -> IpcBuffer:
        dev, handle, size, offset, rc_handle, rc_offset, ev, ev_sync = (
            t.untyped_storage()._share_cuda_()
        )
        return IpcBuffer(
            dev, handle, size, offset, rc_handle, rc_offset, ev, bool(ev_sync), t.numel(),
            str(t.dtype).removeprefix("torch."),
        )  # fmt: skip


class CudaMapper:
    """The actor's side: map an offer's buffers (once per layout), copy on a side stream."""

    def __init__(self):
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device)

    def map(self, offer: IpcOffer) -> list[torch.Tensor]:
        out = []
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for b in offer.buffers:  # a pending producer event is waited for on our stream
                storage = torch.UntypedStorage._new_shared_cuda(
                    b.device, b.handle, b.size_bytes, b.offset_bytes,
                    b.ref_counter_handle, b.ref_counter_offset,
                    b.event_handle, b.event_sync_required,
                )  # fmt: skip
                view = torch.empty(0, dtype=getattr(torch, b.dtype), device=self.device)
                out.append(view.set_(storage, 0, (b.numel,), (1,)))
        return out

    def copy(self, out: torch.Tensor, src: torch.Tensor, deadline: float) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        while not done.query():
            if time.monotonic() >= deadline:
                raise TimeoutError("cuda_ipc copy into staging passed its deadline")
            time.sleep(0.0002)


class IpcSender:
    name = "cuda_ipc"

    def __init__(self, timeout_s: float, buffers=None):
        if buffers is None:
            check_cuda()
            buffers = CudaBuffers()
        self.buffers, self.device, self.timeout_s = buffers, buffers.device, timeout_s
        self.store, self.port = channel.serve(LOOPBACK, timeout_s)
        self._nonces: dict[str, str] = {}
        self._lock = threading.Lock()

    def rendezvous(self) -> dict[str, str]:
        return {
            "transport": self.name,
            "host": LOOPBACK,
            "port": str(self.port),
            "hostname": socket.gethostname(),
        }

    def accept(self, actor: str, nonce: str, deadline: float) -> None:
        wait_get(SealedStore(self.store, nonce), "hello", deadline)
        with self._lock:
            self._nonces[actor] = nonce

    def members(self) -> list[str]:
        with self._lock:
            return sorted(self._nonces)

    def drop(self, actor: str) -> None:
        with self._lock:
            self._nonces.pop(actor, None)

    def close(self) -> None:
        with self._lock:
            self._nonces.clear()

    def send(
        self, targets: list[str], version: int, buckets: list[torch.Tensor], deadline: float
    ) -> dict[str, float | Exception]:
        if not targets:
            return {}
        t0 = time.monotonic()
        self.buffers.load(buckets)
        offer = encode_offer(
            IpcOffer(version=version, layout=self.buffers.layout, buffers=self.buffers.handles)
        )
        with self._lock:
            nonces = {a: self._nonces.get(a) for a in targets}
        for nonce in filter(None, nonces.values()):
            SealedStore(self.store, nonce).set(f"plan/{version}", offer)
        results: dict[str, float | Exception] = {}
        for actor, nonce in nonces.items():
            if nonce is None:
                results[actor] = KeyError(f"{actor} has no open channel")
                continue
            try:
                got = wait_get(SealedStore(self.store, nonce), f"ack/{version}", deadline)
                ok = got == OK
                results[actor] = 1000 * (time.monotonic() - t0) if ok else RuntimeError(got)
            except TimeoutError as e:
                results[actor] = e
            forget(SealedStore(self.store, nonce), f"plan/{version}", f"ack/{version}")
        return results


class IpcReceiver:
    name = "cuda_ipc"

    def __init__(self, timeout_s: float, mapper=None):
        self.timeout_s, self._mapper = timeout_s, mapper
        self.device = mapper.device if mapper is not None else torch.device("cpu")
        self.store, self.nonce = None, ""
        self.layout, self.mapped = 0, []
        self._version, self._next = None, 0

    def connect(self, rendezvous: dict[str, str], nonce: str, deadline: float) -> None:
        self.close()
        theirs = rendezvous.get("hostname", "")
        if theirs != socket.gethostname():
            raise ValueError(
                f"weights.transport=cuda_ipc needs the actor on the trainer's host "
                f"({theirs!r}), but this is {socket.gethostname()!r}; use weights.transport=nccl"
            )
        if self._mapper is None:
            check_cuda()
            self._mapper = CudaMapper()
        self.device = self._mapper.device
        self.store = channel.join(rendezvous["host"], int(rendezvous["port"]), deadline)
        self.nonce = nonce
        self.store = SealedStore(self.store, nonce)  # this join's keys, sealed
        self.store.set("hello", "1")

    def begin(self, version: int, buckets: int, deadline: float) -> None:
        if self.store is None:
            raise RuntimeError("receive before connect(): join the transfer first")
        self._version, self._next = version, 0
        offer = decode_offer(wait_get(self.store, f"plan/{version}", deadline))
        if offer.version != version or len(offer.buffers) != buckets:
            raise ValueError(
                f"cuda_ipc offer for version {offer.version} with {len(offer.buffers)} "
                f"buffers does not match the announced version {version} ({buckets} buckets)"
            )
        if offer.layout != self.layout:
            self.mapped = []  # release the old mappings before taking new ones
            self.mapped, self.layout = self._mapper.map(offer), offer.layout

    def receive(self, buckets: list[torch.Tensor], deadline: float) -> None:
        if self._version is None:
            raise RuntimeError("receive() outside a version: begin() first")
        for out in buckets:
            if self._next >= len(self.mapped):
                raise ValueError(f"more buckets received than the offer's {len(self.mapped)}")
            src = self.mapped[self._next]
            if src.numel() != out.numel() or src.dtype != out.dtype:
                raise ValueError(
                    f"bucket {self._next}: the trainer shares {src.numel()} {src.dtype}, "
                    f"the actor expects {out.numel()} {out.dtype}"
                )
            self._mapper.copy(out.view(-1), src, deadline)
            self._next += 1

    def finish(self, error: str | None) -> None:
        if self.store is None or self._version is None:
            return
        try:
            self.store.set(f"ack/{self._version}", error and f"error: {error}" or OK)
        except Exception as e:  # the trainer then drops us at its deadline
            log.warning("could not ack version %s: %s", self._version, e)
        self._version = None

    def close(self) -> None:
        self.mapped, self.layout = [], 0
        self.store, self._version = None, None
