"""Peer processes for the weight-transfer fault tests: a real actor, and a
trainer or actor that dies halfway through a transfer.

``python -m tests.weight_peers ROLE REDIS_URL MODEL_DIR NAME [TRANSPORT]`` prints
one line per event (``joined``, ``applied <v>`` then ``digest <v> <digest>``, ``half``;
``names_actor``: ``names <v> <json>``)
and runs until killed. TRANSPORT is gloo (default) or nccl (with the gloo backend: the nccl
transport's code on the CPU). ``<digest>``: :func:`params_digest` of the actor's model, for
bit-exact comparisons with the trainer's. ``ipc_actor`` (GPU): see
tests/test_transfer_cuda_ipc.py.

The test side, imported by the tests: :class:`Peer` starts one of these roles in its own
process and :class:`Lines` reads a child's stdout line by line, each line with a deadline.
"""

import hashlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from actor.engines.hf import HFEngine
from actor.weight_receiver import WeightReceiver
from pipeline.messages import SCHEMA_VERSION, WeightAnnouncement, decode, encode
from pipeline.models import load_model
from pipeline.streams import Names, connect, publish
from pipeline.transfer.buckets import bucket_layout, bucket_sums, flatten
from pipeline.transfer.gloo import broadcast_buckets
from pipeline.transfer.nccl import broadcast as nccl_broadcast
from trainer.weight_publisher import WeightPublisher

NAMES = Names("test", "faults")
BUCKET_MB = 0.05
TIMEOUT_S = 3.0
SECRET = "test-run-secret"


def say(msg: str) -> None:
    print(msg, flush=True)


def name_digests(model) -> dict[str, str]:
    """Every parameter's sha256 (of its dtype, shape and bytes) under its name."""
    return {
        n: digest(p, f"{p.dtype}{tuple(p.shape)}".encode()) for n, p in model.named_parameters()
    }


def params_digest(model) -> str:
    """One sha256 over the names and :func:`name_digests` of every parameter: bit-exact
    whole-model comparisons across processes. Unlike a sum of bit patterns (the
    per-bucket ``checksum``), it changes when two equal-shape tensors trade places or a
    tensor's elements are permuted."""
    lines = sorted(f"{n} {d}" for n, d in name_digests(model).items())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def real_actor(client, model_dir: str, name: str, transport: str = "gloo") -> None:
    model, tok = load_model(model_dir)
    engine = HFEngine(model, tok, temperature=1.0, top_p=1.0, top_k=0)
    receiver = WeightReceiver(
        client, NAMES, name, engine, timeout_s=TIMEOUT_S, secret=SECRET, transport=transport
    )
    receiver.start()
    seen = 0
    while True:
        if receiver.applied > seen:
            seen = receiver.applied
            say(f"applied {engine.version}")
            say(f"digest {engine.version} {params_digest(model)}")
        time.sleep(0.05)


def names_actor(client, model_dir: str, name: str, transport: str = "gloo") -> None:
    """A real actor that prints, after every version it applied and every one that
    failed, ``applied <v>`` or ``failed <n>``, then ``names <v> <json>``: its engine's
    version and every parameter's digest under its name (:func:`name_digests`)."""
    import json

    model, tok = load_model(model_dir)
    engine = HFEngine(model, tok, temperature=1.0, top_p=1.0, top_k=0)
    receiver = WeightReceiver(
        client, NAMES, name, engine, timeout_s=TIMEOUT_S, secret=SECRET, transport=transport
    )
    receiver.start()
    say(f"names {engine.version} {json.dumps(name_digests(model))}")
    applied = failed = 0
    while True:
        if receiver.applied > applied or receiver.failed > failed:
            if receiver.applied > applied:
                applied = receiver.applied
                say(f"applied {engine.version}")
            if receiver.failed > failed:
                failed = receiver.failed
                say(f"failed {failed}")
            say(f"names {engine.version} {json.dumps(name_digests(model))}")
        time.sleep(0.02)


def half_actor(client, model_dir: str, name: str, transport: str = "gloo") -> None:
    """Joins, takes the first bucket of the first announcement, then hangs."""
    receiver = WeightReceiver(
        client, NAMES, name, None, timeout_s=TIMEOUT_S, secret=SECRET, transport=transport
    )
    after = receiver._join()
    say("joined")
    while True:
        for _s, entries in client.xread({NAMES.weights: after}, block=1000) or []:
            ann = decode(entries[0][1][b"data"], WeightAnnouncement)
            import torch

            dtype, device = getattr(torch, ann.dtype), receiver.transport.device  # nccl: cuda
            first = torch.empty(ann.buckets[0].numel, dtype=dtype, device=device)
            receiver.transport.begin(ann.version, len(ann.buckets), time.monotonic() + 30)
            receiver.transport.receive([first], time.monotonic() + 30)
            say("half")
            threading.Event().wait()


def arrive_only_actor(client, model_dir: str, name: str, transport: str = "nccl") -> None:
    """Joins, takes its place in the first group the trainer plans (says it arrived at
    the store barrier), then never creates its communicator: under NCCL the trainer's
    non-blocking communicator set-up must still give up at its deadline (GPU test)."""
    from pipeline.transfer.channel import SealedStore, wait_get

    receiver = WeightReceiver(
        client, NAMES, name, None, timeout_s=TIMEOUT_S, secret=SECRET, transport=transport
    )
    after, t = receiver._join(), receiver.transport
    say("joined")
    while True:
        for _s, entries in client.xread({NAMES.weights: after}, block=1000) or []:
            ann = decode(entries[0][1][b"data"], WeightAnnouncement)
            plan = wait_get(t.channel, f"plan/{ann.version}", time.monotonic() + 30)
            _group, rank, _world, seal = plan.split()
            SealedStore(t.store, seal).set(f"arrived/{rank}", "1")
            say("arrived")
            threading.Event().wait()


def half_trainer(client, model_dir: str, name: str, transport: str = "gloo") -> None:
    """Waits for one actor, announces a version, sends half its buckets, then hangs."""
    model, _ = load_model(model_dir)
    publisher = WeightPublisher(
        client, NAMES, "127.0.0.1", BUCKET_MB, 30, SECRET, transport=transport, nccl_backend="gloo"
    )
    publisher.close(timeout_s=0)  # drive it by hand below
    while not publisher.members():
        publisher._accept_joins()
        time.sleep(0.1)
    named = list(model.named_parameters())
    layout = bucket_layout(named, int(BUCKET_MB * 1024 * 1024))
    flat = flatten({n: p.detach() + 1.0 for n, p in named}, layout)
    ann = WeightAnnouncement(
        schema=SCHEMA_VERSION,
        version=1,
        dtype="float32",
        buckets=layout,
        **bucket_sums(flat),
        targets=publisher.members(),
    )
    publish(client, NAMES.weights, encode(ann), version=1)
    deadline, half = time.monotonic() + 30, flat[: len(flat) // 2]
    sender = publisher.sender
    if transport == "nccl":  # form the broadcast group as send() would, then stop halfway
        sender._ensure_group(sender.members(), dict(sender._nonces), 1, deadline)
        nccl_broadcast(sender._group, half, deadline)
    else:
        broadcast_buckets(sender._groups[publisher.members()[0]], half, deadline)
    say("half")
    threading.Event().wait()


def digest(t, prefix: bytes = b"") -> str:
    """sha256 of ``prefix`` and a tensor's bytes (bit-exact comparisons across processes)."""
    import torch

    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(prefix + data.tobytes()).hexdigest()


def ipc_actor(rendezvous_json: str, nonce: str, count: str) -> None:
    """GPU: receive ``count`` buckets of version 1 over cuda_ipc, print their digests."""
    import json

    import torch

    from pipeline.transfer.cuda_ipc import IpcReceiver

    spec = json.loads(rendezvous_json)
    receiver = IpcReceiver(TIMEOUT_S * 10)
    receiver.connect(spec["rendezvous"], nonce, time.monotonic() + 30)
    say("joined")
    receiver.begin(1, int(count), time.monotonic() + 30)
    outs = [
        torch.empty(n, dtype=getattr(torch, d), device=receiver.device) for n, d in spec["buckets"]
    ]
    for out in outs:
        receiver.receive([out], time.monotonic() + 30)
    receiver.finish(None)
    say("digests " + " ".join(digest(out) for out in outs))
    threading.Event().wait()


# ---- the test side: a peer in its own process and its stdout, line by line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the default wait for a peer's line: a fresh peer imports torch and loads a model before
# its first line, which took over 30 s on 2 cores shared at load 18
PEER_LINE_S = 120.0


class Lines:
    """A child's stdout, line by line, each line waited for with a deadline: a peer that
    hangs without a word fails the test at the deadline instead of blocking readline()
    for ever (a reader thread does the blocking reads)."""

    def __init__(self, stream):
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)  # end of the stream: the child exited or closed it

    def next(self, deadline: float) -> str | None:
        """The next line (None once the stream ended); AssertionError at the deadline."""
        try:
            return self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError("the peer printed nothing before the deadline") from None


class Peer:
    """A weight-transfer peer in its own process (a role above); ``transport``:
    gloo (default) or nccl; ``env``: extra environment (e.g. CUDA_VISIBLE_DEVICES)."""

    def __init__(
        self, role: str, url: str, model_dir: str, name: str, transport: str = "gloo", env=None
    ):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.weight_peers", role, url, model_dir, name, transport],
            cwd=ROOT,
            env=None if env is None else {**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.lines = Lines(self.proc.stdout)

    def line_starting(self, words: list[str], timeout_s: float = PEER_LINE_S) -> list[str] | None:
        """The first line whose words start with ``words`` (None if the peer exited)."""
        deadline = time.monotonic() + timeout_s
        while (got := self.lines.next(deadline)) is not None:
            if got.split()[: len(words)] == words:
                return got.split()
        return None

    def expect(self, line: str, timeout_s: float = PEER_LINE_S) -> None:
        if self.line_starting(line.split(), timeout_s) is None:
            raise AssertionError(f"peer exited without saying {line!r}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


if __name__ == "__main__":
    if sys.argv[1] == "ipc_actor":
        ipc_actor(*sys.argv[2:5])
        sys.exit(0)
    role, url, model_dir, name = sys.argv[1:5]
    roles = {
        "real_actor": real_actor,
        "names_actor": names_actor,
        "half_actor": half_actor,
        "half_trainer": half_trainer,
        "arrive_only_actor": arrive_only_actor,
    }
    roles[role](connect(url), model_dir, name, *sys.argv[5:6])
