"""The nccl transport's code with the gloo backend (weights.nccl_backend=gloo): one
broadcast group of the trainer and the actors, real processes over real sockets,
a real redis-server for the rendezvous and the signed joins."""

import subprocess
import sys
import threading
import time

import pytest
import torch

from actor.engine import HFEngine
from pipeline.models import load_model, materialize_model
from pipeline.streams import Names, wait_until
from pipeline.transfer import make_receiver, make_sender
from pipeline.weight_publisher import WeightPublisher
from pipeline.weight_receiver import WeightReceiver
from tests.test_weights import ROOT, Peer
from tests.weight_peers import BUCKET_MB, NAMES, SECRET, TIMEOUT_S, params_sum


def _publisher(rclient, names=NAMES, timeout_s=TIMEOUT_S, **kw):
    return WeightPublisher(
        rclient, names, "127.0.0.1", BUCKET_MB, timeout_s, SECRET, transport="nccl",
        nccl_backend="gloo", **kw,
    )  # fmt: skip


class NcclPeer(Peer):
    """A peer process of tests/weight_peers.py on the nccl transport (gloo backend)."""

    def __init__(self, role: str, url: str, model_dir: str, name: str):
        cmd = [sys.executable, "-m", "tests.weight_peers", role, url, model_dir, name, "nccl"]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )


def _actor(redis_server, path, name, role="real_actor"):
    return NcclPeer(role, redis_server.url, path, name)


def _sum_line(peer: Peer, version: int, timeout_s: float = 30) -> int:
    """The peer's ``sum <version> <sum>`` line (its parameters after that version)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = peer.proc.stdout.readline().split()
        if got[:2] == ["sum", str(version)]:
            return int(got[2])
        if not got and peer.proc.poll() is not None:
            break
    raise AssertionError(f"peer never applied version {version}")


def _bump(model, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


@pytest.fixture
def tiny(tmp_path):
    path = materialize_model("tiny", cache_dir=str(tmp_path))
    return path, load_model(path)[0]


def _random_bits(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern is fair game (NaNs, infinities, denormals): bit-exact or bust."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, (n,), dtype=ints).view(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_broadcast_is_bit_exact_across_bucket_boundaries(dtype):
    """Two actors in one group; odd bucket sizes; three versions through one group."""
    sender = make_sender("nccl", "127.0.0.1", 10, nccl_backend="gloo")
    sizes = [1, 3, 4097, 65541]
    got: dict[tuple[str, int], list[torch.Tensor]] = {}

    def actor(name: str) -> None:
        r = make_receiver("nccl", 10)
        r.connect(sender.rendezvous(), f"nonce-{name}", time.monotonic() + 10)
        for version in (1, 2, 3):
            r.begin(version, len(sizes), time.monotonic() + 10)
            outs = [torch.empty(n, dtype=dtype) for n in sizes]
            for out in outs:
                r.receive([out], time.monotonic() + 10)
            r.finish(None)
            got[(name, version)] = outs
        r.close()

    threads = [threading.Thread(target=actor, args=(a,)) for a in ("a0", "a1")]
    for t in threads:
        t.start()
    for a in ("a0", "a1"):
        sender.accept(a, f"nonce-{a}", time.monotonic() + 10)
    sent = {}
    for version in (1, 2, 3):
        sent[version] = [_random_bits(n, dtype) for n in sizes]
        results = sender.send(["a0", "a1"], version, sent[version], time.monotonic() + 10)
        assert all(isinstance(r, float) for r in results.values()), results
    for t in threads:
        t.join(timeout=20)
    assert sender._formed == 1  # the same members: one group, reused for every version
    sender.close()
    for (_, version), outs in got.items():
        for out, ref in zip(outs, sent[version], strict=True):
            assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    assert len(got) == 6


def test_versions_reach_two_actor_processes_whole(tiny, rclient, redis_server):
    path, model = tiny
    publisher = _publisher(rclient)
    actors = [_actor(redis_server, path, f"actor-{i}") for i in range(2)]
    try:
        assert wait_until(lambda: publisher.members() == ["actor-0", "actor-1"], 60)
        for version in (1, 2, 3):
            _bump(model, 0.25)
            publisher.submit(version, model)
            for actor in actors:
                assert _sum_line(actor, version) == params_sum(model), version
        assert wait_until(lambda: publisher.published == 3, 10)
        assert publisher.sender._formed == 1 and publisher.actors_dropped == 0
    finally:
        for actor in actors:
            actor.kill()
        publisher.close(timeout_s=5)


def test_actor_killed_mid_broadcast_costs_one_deadline_then_rejoins(tiny, rclient, redis_server):
    path, model = tiny
    publisher = _publisher(rclient)
    hung = _actor(redis_server, path, "actor-0", role="half_actor")
    good = _actor(redis_server, path, "actor-1")
    rejoined = None
    try:
        assert wait_until(lambda: publisher.members() == ["actor-0", "actor-1"], 60)
        _bump(model, 0.5)
        t0 = time.monotonic()
        publisher.submit(1, model)
        hung.expect("half")
        hung.kill()
        assert wait_until(lambda: publisher.idle() and publisher.actors_dropped >= 1, 20)
        assert time.monotonic() - t0 < TIMEOUT_S + 5, "the dead actor cost more than a deadline"
        assert "actor-0" in publisher.dropped and "actor-0" not in publisher.members()
        # actor-1 took version 1, now or (if the broadcast broke before its last
        # bucket) after rejoining, when the trainer catches it up
        assert _sum_line(good, 1) == params_sum(model)
        _bump(model, 0.5)
        publisher.submit(2, model)  # a new group without the dead actor
        assert _sum_line(good, 2) == params_sum(model)
        rejoined = _actor(redis_server, path, "actor-0")  # restarted under its old name
        assert _sum_line(rejoined, 2) == params_sum(model)  # caught up on joining
        assert wait_until(lambda: publisher.members() == ["actor-0", "actor-1"], 10)
        _bump(model, 0.5)
        publisher.submit(3, model)  # and everyone is in one group again
        assert _sum_line(good, 3) == params_sum(model) == _sum_line(rejoined, 3)
    finally:
        for peer in (hung, good, rejoined):
            if peer is not None:
                peer.kill()
        publisher.close(timeout_s=5)


def test_trainer_killed_mid_broadcast_leaves_old_weights_whole(tiny, rclient, redis_server):
    path, model = tiny
    before = params_sum(model)
    tok = load_model(path)[1]
    engine = HFEngine(model, tok, temperature=1.0, top_p=1.0, top_k=0)
    receiver = WeightReceiver(
        rclient, NAMES, "actor-0", engine, TIMEOUT_S, SECRET, transport="nccl"
    )
    trainer = NcclPeer("half_trainer", redis_server.url, path, "trainer")
    receiver.start()
    try:
        trainer.expect("half")
        trainer.kill()
        assert wait_until(lambda: receiver.failed >= 1, TIMEOUT_S + 10)
        assert receiver.applied == 0 and engine.version == 0
        assert params_sum(model) == before  # staged: the live weights never saw a bucket
    finally:
        trainer.kill()
        receiver.stop()


def test_join_without_the_run_secret_gets_no_group(tiny, rclient):
    path, model = tiny
    names = Names("test", "nccl-secret")
    actor_model, tok = load_model(path)
    engine = HFEngine(actor_model, tok, temperature=1.0, top_p=1.0, top_k=0)
    publisher = _publisher(rclient, names=names)
    intruder = WeightReceiver(rclient, names, "actor-x", engine, 3, "a-guess", transport="nccl")
    intruder.start()
    try:
        assert wait_until(lambda: rclient.xlen(names.joins) >= 1, 10)
        time.sleep(1.5)  # the publisher has read (and refused) the join by now
        publisher.submit(1, model)
        assert wait_until(publisher.idle, 10)
        assert publisher.members() == [] and engine.version == 0
        assert publisher.sender._formed == 0
    finally:
        intruder.stop()
        publisher.close(timeout_s=5)


def test_transports_that_need_cuda_say_so_at_start_up():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for name, kw in (("nccl", {"nccl_backend": "nccl"}), ("cuda_ipc", {})):
        with pytest.raises(ValueError, match=rf"weights.transport={name} needs .* use weights"):
            make_sender(name, "127.0.0.1", 1, **kw)
    with pytest.raises(ValueError, match="weights.transport=cuda_ipc needs"):
        make_receiver("cuda_ipc", 1)
    with pytest.raises(ValueError, match="weights.nccl_backend='mpi'"):
        make_sender("nccl", "127.0.0.1", 1, nccl_backend="mpi")
    with pytest.raises(ValueError, match=r"weights.transport='rdma' .* \('gloo', 'nccl'"):
        make_receiver("rdma", 1)


def test_config_takes_the_transports_and_names_bad_values():
    from pipeline.config import validate
    from tests.test_config import _compose

    for name in ("gloo", "nccl", "cuda_ipc"):
        validate(_compose([f"weights.transport={name}", "weights.nccl_backend=gloo"]))
    for override, key in (
        ("weights.transport=shm", "weights.transport='shm'"),
        ("weights.nccl_backend=mpi", "weights.nccl_backend='mpi'"),
    ):
        with pytest.raises(ValueError, match=f"{key} is not supported; use one of"):
            validate(_compose([override]))
