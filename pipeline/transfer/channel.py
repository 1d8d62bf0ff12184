"""The key-value channel the transports rendezvous over: a TCPStore served by the
trainer on ``trainer.transfer_host`` only (never every interface:
pipeline/listeners.py), whose address the trainer writes to the run's Redis
(``<run>:rendezvous``). Only an actor whose signed join the trainer accepted knows
its nonce; the nonce itself never appears in the store.

Anyone who reaches the port can list, read and write the store's keys. So every
join talks through its :class:`SealedStore`: keys under :func:`tag` of the nonce (a
digest), every value HMAC-sealed with the nonce and checked on every read. A value
someone else wrote fails that join or version at once (:class:`StrangerValue`);
the actor keeps its weights and rejoins. What a stranger can still do: delete or
overwrite keys (the join or version fails within its deadline) and fill the
store's memory (nothing here bounds it: keep the port unreachable to others).

Keys of one join (``nccl``, ``cuda_ipc``; the sender deletes a round's keys after it)::

    hello                       actor: "I reached the store" (accept() waits for it)
    plan/<version>              trainer: what the actor needs to take this version
    ack/<version>               actor: "ok" once every bucket arrived and checked, else
                                "error: <why>"

``gloo`` puts its pair group's rendezvous there (gloo.py); ``nccl`` its broadcast
groups' under a per-group seal. Every wait has a deadline (``time.monotonic()``
seconds) and raises TimeoutError naming the key when it passes.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import socket
import time

import torch.distributed as dist

from pipeline.listeners import family, serve_store

OK = "ok"


def _delta(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.05))


def serve(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """The trainer's store on a free port of ``host``, listening on that address only
    (pipeline/listeners.py binds its socket)."""
    return serve_store(host, timeout_s)


def join(host: str, port: int, deadline: float) -> dist.TCPStore:
    """An actor's client of the trainer's store (raises if it cannot be reached in time)."""
    return dist.TCPStore(host, port, is_master=False, timeout=_delta(deadline))


def tag(nonce: str) -> str:
    """The store prefix of one join's keys. Anyone who reaches the store can list its
    keys, so they carry this digest of the nonce, never the nonce (which only travels
    in the run's Redis, in the actor's signed join)."""
    return hashlib.sha256(f"nonstop-rl channel {nonce}".encode()).hexdigest()[:24]


class StrangerValue(ValueError):
    """A value in the transfer store that neither side of the join wrote."""


class SealedStore(dist.Store):
    """One join's view of the trainer's store: keys under :func:`tag` of its nonce, and
    every value sealed with an HMAC keyed by the nonce, checked on every read. A value
    written by anyone else (a stranger on the store) raises :class:`StrangerValue` on
    the read, before torch or gloo parse it, so the join or version fails at once and
    the old weights stay; it never reaches gloo (garbage addresses made it allocate
    whatever length their bytes said: std::bad_alloc). torch's gloo groups take it as
    their store (they set, wait and get)."""

    def __init__(self, store: dist.Store, nonce: str):
        super().__init__()
        self._store = dist.PrefixStore(tag(nonce), store)
        self._key = hashlib.sha256(f"nonstop-rl seal {nonce}".encode()).digest()

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._store.set(key, self._mac(key, data) + data)

    def get(self, key: str) -> bytes:
        raw = self._store.get(key)
        mac, data = raw[:32], raw[32:]
        if len(raw) < 32 or not hmac.compare_digest(mac, self._mac(key, data)):
            raise StrangerValue(
                f"the value under {key!r} in the weight-transfer store is not sealed for "
                "this join: someone else wrote it (a stranger on the store?); the join "
                "fails and the actor rejoins"
            )
        return data

    def wait(self, keys, timeout=None) -> None:
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:  # a counter: not sealable, passed on
        return self._store.add(key, amount)

    def check(self, keys) -> bool:
        return self._store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout) -> None:
        self._store.set_timeout(timeout)


def wait_get(store: dist.Store, key: str, deadline: float) -> str:
    """The value of ``key`` once it is set; TimeoutError at the deadline."""
    try:
        store.wait([key], _delta(deadline))
    except Exception as e:  # torch raises DistStoreError (a RuntimeError) on timeout
        if time.monotonic() >= deadline - 0.01 or "timeout" in str(e).lower():
            raise TimeoutError(f"no {key!r} from the peer by the deadline") from e
        raise
    return store.get(key).decode()


def forget(store: dist.Store, *keys: str) -> None:
    for key in keys:  # best effort: a leftover key costs a few bytes, nothing else
        with contextlib.suppress(Exception):
            store.delete_key(key)


def local_address(peer_host: str, peer_port: int) -> str:
    """This host's address on the route to ``peer_host`` (what a gloo device binds)."""
    if peer_host in ("127.0.0.1", "localhost", "::1"):
        return peer_host
    with socket.socket(family(peer_host), socket.SOCK_DGRAM) as s:
        s.connect((peer_host, peer_port))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def wait_work(work, deadline: float, what: str) -> None:
    """Wait for a collective's completion, polling, so the deadline holds whatever the
    backend's own blocking rules; then order the caller's stream after it."""
    pause = 0.0002
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} passed its deadline")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    work.wait()  # raises the collective's error, if it failed; syncs streams (NCCL)
