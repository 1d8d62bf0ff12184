"""The cuda_ipc transport: its offer message, its ack-before-reuse protocol and its
error paths on the CPU (the CUDA export/map/copy replaced by in-memory fakes, the
channel a real TCPStore, the rest of the pipeline real), and the real transfer
between two processes on one GPU (``-m gpu``)."""

import json
import socket
import subprocess
import sys
import threading
import time
import uuid

import msgspec
import pytest
import torch

from actor.engines.hf import HFEngine
from actor.weight_receiver import WeightReceiver
from pipeline.models import load_model, materialize_model
from pipeline.streams import Names, wait_until
from pipeline.transfer.cuda_ipc import (
    IpcBuffer,
    IpcOffer,
    IpcReceiver,
    IpcSender,
    decode_offer,
    encode_offer,
)
from tests.weight_peers import ROOT, SECRET, Lines, digest
from trainer.weight_publisher import WeightPublisher


def _buffer(handle: bytes, numel: int = 4, dtype: str = "float32") -> IpcBuffer:
    ref_counter, event = b"/torch_123_456", b"\x00\xff" * 32  # shapes of real ones
    return IpcBuffer(0, handle, 4 * numel, 512, ref_counter, 8, event, True, numel, dtype)


class FakeBuffers:
    """CudaBuffers' protocol on the CPU: 'handles' are keys of a shared registry."""

    def __init__(self, registry: dict, events: list):
        self.device = torch.device("cpu")
        self.registry, self.events = registry, events
        self.tensors: list[torch.Tensor] = []
        self.handles: list[IpcBuffer] = []
        self.layout = 0

    def load(self, buckets):
        shapes = [(b.numel(), b.dtype) for b in buckets]
        if shapes != [(t.numel(), t.dtype) for t in self.tensors]:
            self.tensors = [torch.empty(n, dtype=d) for n, d in shapes]
            self.handles = []
            for t in self.tensors:
                key = uuid.uuid4().bytes
                self.registry[key] = t
                dtype = str(t.dtype).removeprefix("torch.")
                self.handles.append(_buffer(key, t.numel(), dtype))
            self.layout += 1
        for t, b in zip(self.tensors, buckets, strict=True):
            t.copy_(b.reshape(-1))
        self.events.append("load")


class FakeMapper:
    """CudaMapper's protocol on the CPU: looks the 'handles' up; copies can be slowed."""

    def __init__(self, registry: dict, events: list, copy_s: float = 0.0):
        self.device = torch.device("cpu")
        self.registry, self.events, self.copy_s = registry, events, copy_s
        self.maps = 0

    def map(self, offer: IpcOffer):
        self.maps += 1
        return [self.registry[b.handle] for b in offer.buffers]

    def copy(self, out, src, deadline):
        time.sleep(self.copy_s)  # the trainer must not rewrite src meanwhile
        out.copy_(src)


class AckLog(IpcReceiver):
    """Writes "ack" to the shared event log when it acks a version."""

    def __init__(self, timeout_s, mapper, events):
        super().__init__(timeout_s, mapper=mapper)
        self.events = events

    def finish(self, error):
        self.events.append("ack" if error is None else "nack")
        super().finish(error)


def test_offer_travels_as_json_and_bad_ones_are_refused():
    offer = IpcOffer(version=3, layout=2, buffers=[_buffer(b"\x01" * 64), _buffer(b"\x00" * 64)])
    data = encode_offer(offer)
    assert data.startswith(b"{") and json.loads(data)["version"] == 3  # JSON, never pickle
    assert decode_offer(data) == offer and decode_offer(data.decode()) == offer
    with pytest.raises(ValueError, match="bad cuda_ipc offer"):
        decode_offer(b"\x80\x04K\x01.")  # a pickle is not an offer
    with pytest.raises(ValueError, match="bad cuda_ipc offer"):
        decode_offer(msgspec.json.encode({"version": 1, "layout": 1, "buffers": [[0, "x"]]}))
    with pytest.raises(ValueError, match="unknown dtype 'f99'"):
        decode_offer(encode_offer(IpcOffer(version=1, layout=1, buffers=[_buffer(b"k", 4, "f99")])))


def _fake_pair(copy_s=0.0, timeout_s=5.0):
    registry, events = {}, []
    sender = IpcSender(timeout_s, buffers=FakeBuffers(registry, events))
    mapper = FakeMapper(registry, events, copy_s)
    return sender, AckLog(timeout_s, mapper, events), mapper, events


@pytest.fixture
def tiny(tmp_path):
    path = materialize_model("tiny", cache_dir=str(tmp_path))
    return load_model(path)[0], load_model(path)


def test_versions_reach_the_actor_whole_and_buffers_wait_for_the_ack(tiny, rclient):
    """Through the real publisher and receiver: the export buffers are mapped once, and
    rewritten for the next version only after the actor acked the last one (with slow
    copies and versions submitted back to back, a rewrite mid-copy would fail a checksum)."""
    trainer_model, (actor_model, tok) = tiny
    sender, receiver_end, mapper, events = _fake_pair(copy_s=0.05)
    names = Names("test", "ipc")
    engine = HFEngine(actor_model, tok, temperature=1.0, top_p=1.0, top_k=0)
    publisher = WeightPublisher(rclient, names, "127.0.0.1", 0.05, 10, SECRET, sender=sender)
    receiver = WeightReceiver(rclient, names, "actor-0", engine, 10, SECRET, receiver=receiver_end)
    receiver.start()
    try:
        assert wait_until(lambda: publisher.members() == ["actor-0"], 10)
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in trainer_model.parameters():
                    p.add_(0.5)
            publisher.submit(version, trainer_model)
            time.sleep(0.02)  # the next one arrives while this one is being copied
        assert wait_until(lambda: engine.version == 3, 30), receiver.failed
        assert wait_until(publisher.idle, 10)
    finally:
        receiver.stop()
        publisher.close(timeout_s=5)
    for (n, p), (_, q) in zip(
        trainer_model.named_parameters(), actor_model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), n
    assert receiver.failed == 0 and mapper.maps == 1  # one layout, mapped once
    sent = events.count("load")
    assert sent >= 2 and events == ["load", "ack"] * sent  # never two loads without an ack
    assert publisher.published == sent and publisher.actors_dropped == 0


def _join(sender, receiver, actor, deadline):
    t = threading.Thread(target=receiver.connect, args=(sender.rendezvous(), actor, deadline))
    t.start()
    sender.accept(actor, actor, deadline)
    t.join()


def test_a_silent_actor_costs_the_deadline_and_a_failing_one_is_told_at_once():
    sender, good, _, _ = _fake_pair()
    registry = sender.buffers.registry
    silent = IpcReceiver(5, mapper=FakeMapper(registry, []))
    failing = IpcReceiver(5, mapper=FakeMapper(registry, []))
    deadline = time.monotonic() + 5
    for name, end in (("good", good), ("silent", silent), ("failing", failing)):
        _join(sender, end, name, deadline)
    assert sender.members() == ["failing", "good", "silent"]
    buckets = [torch.arange(6.0), torch.ones(3)]

    def take(end, fail: bool):
        end.begin(1, 2, time.monotonic() + 5)
        outs = [torch.empty(6), torch.empty(3)]
        for out in outs:
            end.receive([out], time.monotonic() + 5)
        if fail:
            end.finish("RuntimeError: bucket 1 failed its checksum")
        else:
            end.finish(None)
            assert torch.equal(outs[0], buckets[0]) and torch.equal(outs[1], buckets[1])

    threads = [threading.Thread(target=take, args=(good, False))]
    threads.append(threading.Thread(target=take, args=(failing, True)))
    threads.append(threading.Thread(target=silent.begin, args=(1, 2, time.monotonic() + 5)))
    for t in threads:
        t.start()
    t0 = time.monotonic()
    results = sender.send(["failing", "good", "silent"], 1, buckets, time.monotonic() + 2)
    took = time.monotonic() - t0
    for t in threads:
        t.join()
    assert isinstance(results["good"], float)
    assert isinstance(results["failing"], RuntimeError) and "checksum" in str(results["failing"])
    assert isinstance(results["silent"], TimeoutError)
    assert 1.5 < took < 3.5  # the silent one cost the 2 s deadline, no more


def test_offer_that_does_not_match_the_announcement_fails_the_version():
    sender, end, _, _ = _fake_pair()
    _join(sender, end, "a", time.monotonic() + 5)
    t = threading.Thread(
        target=sender.send, args=(["a"], 4, [torch.zeros(2)] * 2, time.monotonic() + 2)
    )
    t.start()
    with pytest.raises(ValueError, match="2 buffers does not match .* version 4 \\(3 buckets\\)"):
        end.begin(4, 3, time.monotonic() + 5)
    end.finish("ValueError: mismatch")  # what ReceiverSource does on the way out
    t.join()
    with pytest.raises(RuntimeError, match="begin\\(\\) first"):
        end.receive([torch.zeros(2)], time.monotonic() + 1)


def test_an_actor_on_another_host_is_told_to_use_nccl():
    sender, end, _, _ = _fake_pair()
    elsewhere = {**sender.rendezvous(), "hostname": socket.gethostname() + "-not"}
    with pytest.raises(ValueError, match="cuda_ipc needs the actor on the trainer's host"):
        end.connect(elsewhere, "n", time.monotonic() + 2)
    assert sender.rendezvous()["host"] == "127.0.0.1"  # the handles never leave this host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_copy_between_two_processes_is_bit_exact():
    sender = IpcSender(30)
    gen = torch.Generator(device="cuda").manual_seed(0)
    buckets = [
        torch.randn(1000, device="cuda", generator=gen),
        torch.randn(4097, device="cuda", generator=gen).to(torch.bfloat16),
        torch.randint(-(2**31), 2**31 - 1, (333,), device="cuda").view(torch.float32),
    ]
    spec = {
        "rendezvous": sender.rendezvous(),
        "buckets": [[b.numel(), str(b.dtype).removeprefix("torch.")] for b in buckets],
    }
    cmd = [sys.executable, "-m", "tests.weight_peers", "ipc_actor", json.dumps(spec), "n1", "3"]
    actor = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    lines = Lines(actor.stdout)  # each line waited for with a deadline, never for ever
    try:
        assert (lines.next(time.monotonic() + 120) or "").strip() == "joined"
        sender.accept("a", "n1", time.monotonic() + 30)
        # the trainer may rewrite its buffers only after the ack: send() returns then
        results = sender.send(["a"], 1, buckets, time.monotonic() + 60)
        assert isinstance(results["a"], float), results
        line = (lines.next(time.monotonic() + 60) or "").split()
        assert line[0] == "digests" and line[1:] == [digest(b) for b in buckets]
    finally:
        actor.kill()
        actor.wait()
        sender.close()
