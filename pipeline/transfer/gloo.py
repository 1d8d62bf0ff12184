"""The ``gloo`` transport: one two-rank gloo group per actor, found through a
TCPStore whose address the trainer writes to the run's Redis.

Each actor has its own pair group (rank 0 the trainer, rank 1 the actor), so
one dead or slow actor times out alone while the others receive, and sends to
several actors run at once from separate threads (the trainer sends the bytes
once per actor; ``nccl`` broadcasts them once). Buckets live on the CPU.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from pipeline.transfer.channel import SealedStore, local_address, serve


def pair_group(store: dist.Store, nonce: str, rank: int, host: str, timeout_s: float):
    """The two-rank group of one join (blocks until both ranks are in, or the timeout).
    Its rendezvous goes through the join's :class:`SealedStore`: a value another client
    of the store wrote fails the join (StrangerValue) instead of reaching gloo."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = datetime.timedelta(seconds=max(timeout_s, 0.1))
    return dist.ProcessGroupGloo(SealedStore(store, nonce), rank, 2, opts)


def broadcast_buckets(group, buckets: list[torch.Tensor], deadline: float) -> None:
    """Broadcast every bucket from rank 0, all within one deadline (monotonic seconds)."""
    for bucket in buckets:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("weight transfer passed its deadline")
        group.broadcast(bucket, 0, datetime.timedelta(seconds=remaining)).wait()


class GlooSender:
    name = "gloo"
    device = torch.device("cpu")

    def __init__(self, host: str, timeout_s: float):
        self.host = host
        self.store, self.port = serve(host, timeout_s)  # listens on ``host`` only
        self._groups: dict[str, object] = {}
        self._lock = threading.Lock()  # send() threads read while the publisher drops

    def rendezvous(self) -> dict[str, str]:
        return {"transport": self.name, "host": self.host, "port": str(self.port)}

    def accept(self, actor: str, nonce: str, deadline: float) -> None:
        group = pair_group(self.store, nonce, 0, self.host, deadline - time.monotonic())
        with self._lock:
            self._groups[actor] = group

    def send(
        self, targets: list[str], version: int, buckets: list[torch.Tensor], deadline: float
    ) -> dict[str, float | Exception]:
        """One thread per target, all at once: a hung actor holds back only itself."""
        t0, results = time.monotonic(), {}

        def send_one(actor: str) -> None:
            try:
                with self._lock:
                    group = self._groups[actor]
                broadcast_buckets(group, buckets, deadline)
                results[actor] = 1000 * (time.monotonic() - t0)
            except Exception as e:
                results[actor] = e

        threads = [
            threading.Thread(target=send_one, args=(a,), name=f"send-{a}", daemon=True)
            for a in targets
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(deadline - time.monotonic(), 0.0) + 2.0)
        return {a: results.get(a, TimeoutError("no answer by the deadline")) for a in targets}

    def drop(self, actor: str) -> None:
        with self._lock:
            self._groups.pop(actor, None)

    def members(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def close(self) -> None:
        with self._lock:
            self._groups.clear()


class GlooReceiver:
    name = "gloo"
    device = torch.device("cpu")

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.group = None

    def connect(self, rendezvous: dict[str, str], nonce: str, deadline: float) -> None:
        remaining = max(deadline - time.monotonic(), 0.1)
        store = dist.TCPStore(
            rendezvous["host"],
            int(rendezvous["port"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=remaining),
        )
        here = local_address(rendezvous["host"], int(rendezvous["port"]))
        self.group = pair_group(store, nonce, 1, here, remaining)

    def begin(self, version: int, buckets: int, deadline: float) -> None:
        pass  # the pair group carries nothing but the buckets

    def finish(self, error: str | None) -> None:
        pass  # the trainer learns the outcome from the broadcast itself

    def receive(self, buckets: list[torch.Tensor], deadline: float) -> None:
        if self.group is None:
            raise RuntimeError("receive() before connect(): join the transfer first")
        broadcast_buckets(self.group, buckets, deadline)

    def close(self) -> None:
        self.group = None
