"""The nccl transport's code (pipeline/transfer/nccl.py): one broadcast group of the
trainer and the actors, real processes over real sockets, a real redis-server for the
rendezvous and the signed joins.

Every CPU test here (``test_gloo_backend_*``) runs the GLOO backend
(weights.nccl_backend=gloo): the transport's own code - plans, store barriers, group
re-forming, acks, deadlines - but not one NCCL call. The paths only NCCL takes are in
the ``gpu``-marked tests (``test_nccl_*``, skipped without enough GPUs; written, not yet
run on a GPU): a broken group's communicator aborted (``destroy``), errors raised
rather than the process killed (TORCH_NCCL_ASYNC_ERROR_HANDLING=2), and communicator
set-up bounded by the deadline (TORCH_NCCL_USE_COMM_NONBLOCKING=1).
"""

import os
import threading
import time

import pytest
import torch

from actor.engines.hf import HFEngine
from actor.weight_receiver import WeightReceiver
from pipeline.models import load_model, materialize_model
from pipeline.streams import Names, wait_until
from pipeline.transfer import make_receiver, make_sender
from tests.weight_peers import BUCKET_MB, NAMES, PEER_LINE_S, SECRET, TIMEOUT_S, Peer, params_digest
from trainer.weight_publisher import WeightPublisher


def _publisher(rclient, names=NAMES, timeout_s=TIMEOUT_S, **kw):
    return WeightPublisher(
        rclient, names, "127.0.0.1", BUCKET_MB, timeout_s, SECRET, transport="nccl",
        nccl_backend="gloo", **kw,
    )  # fmt: skip


def _actor(redis_server, path, name, role="real_actor"):
    return Peer(role, redis_server.url, path, name, "nccl")


def _digest_line(peer: Peer, version: int, timeout_s: float = PEER_LINE_S) -> str:
    """The peer's ``digest <version> <digest>`` line (its parameters after that version)."""
    got = peer.line_starting(["digest", str(version)], timeout_s)
    if got is None:
        raise AssertionError(f"peer exited before applying version {version}")
    return got[2]


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
def test_gloo_backend_broadcast_is_bit_exact_across_bucket_boundaries(dtype):
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


def test_gloo_backend_versions_reach_two_actor_processes_whole(tiny, rclient, redis_server):
    path, model = tiny
    publisher = _publisher(rclient)
    actors = [_actor(redis_server, path, f"actor-{i}") for i in range(2)]
    try:
        assert wait_until(lambda: publisher.members() == ["actor-0", "actor-1"], 60)
        for version in (1, 2, 3):
            _bump(model, 0.25)
            publisher.submit(version, model)
            for actor in actors:
                assert _digest_line(actor, version) == params_digest(model), version
        assert wait_until(lambda: publisher.published == 3, 10)
        assert publisher.sender._formed == 1 and publisher.actors_dropped == 0
    finally:
        for actor in actors:
            actor.kill()
        publisher.close(timeout_s=5)


def test_gloo_backend_actor_killed_mid_broadcast_costs_one_deadline_then_rejoins(
    tiny, rclient, redis_server
):
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
        assert _digest_line(good, 1) == params_digest(model)
        _bump(model, 0.5)
        publisher.submit(2, model)  # a new group without the dead actor
        assert _digest_line(good, 2) == params_digest(model)
        rejoined = _actor(redis_server, path, "actor-0")  # restarted under its old name
        assert _digest_line(rejoined, 2) == params_digest(model)  # caught up on joining
        assert wait_until(lambda: publisher.members() == ["actor-0", "actor-1"], 10)
        _bump(model, 0.5)
        publisher.submit(3, model)  # and everyone is in one group again
        assert _digest_line(good, 3) == params_digest(model) == _digest_line(rejoined, 3)
    finally:
        for peer in (hung, good, rejoined):
            if peer is not None:
                peer.kill()
        publisher.close(timeout_s=5)


def test_gloo_backend_trainer_killed_mid_broadcast_leaves_old_weights_whole(
    tiny, rclient, redis_server
):
    path, model = tiny
    before = params_digest(model)
    tok = load_model(path)[1]
    engine = HFEngine(model, tok, temperature=1.0, top_p=1.0, top_k=0)
    receiver = WeightReceiver(
        rclient, NAMES, "actor-0", engine, TIMEOUT_S, SECRET, transport="nccl"
    )
    trainer = Peer("half_trainer", redis_server.url, path, "trainer", "nccl")
    receiver.start()
    try:
        trainer.expect("half")
        trainer.kill()
        assert wait_until(lambda: receiver.failed >= 1, TIMEOUT_S + 10)
        assert receiver.applied == 0 and engine.version == 0
        assert params_digest(model) == before  # staged: the live weights never saw a bucket
    finally:
        trainer.kill()
        receiver.stop()


def test_gloo_backend_join_without_the_run_secret_gets_no_group(tiny, rclient):
    path, model = tiny
    names = Names("test", "nccl-secret")
    actor_model, tok = load_model(path)
    engine = HFEngine(actor_model, tok, temperature=1.0, top_p=1.0, top_k=0)
    publisher = _publisher(rclient, names=names)
    intruder = WeightReceiver(rclient, names, "actor-x", engine, 3, "a-guess", transport="nccl")
    intruder.start()
    try:
        # the publisher read the join and refused it (not merely: has not read it yet)
        assert wait_until(lambda: publisher.joins_refused >= 1, 10), "the join was not refused"
        assert set(publisher.refused) == {"actor-x"}
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
    from tests.config_builders import compose_config

    for name in ("gloo", "nccl", "cuda_ipc"):
        validate(compose_config([f"weights.transport={name}", "weights.nccl_backend=gloo"]))
    for override, key in (
        ("weights.transport=shm", "weights.transport='shm'"),
        ("weights.nccl_backend=mpi", "weights.nccl_backend='mpi'"),
    ):
        with pytest.raises(ValueError, match=f"{key} is not supported; use one of"):
            validate(compose_config([override]))


# -- NCCL itself (gpu): what the gloo backend above never runs -------------------------


def _gpus(n: int) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        pytest.skip(f"needs {n} CUDA GPU(s) (NCCL puts one rank on each); this machine has {have}")


def _nccl_publisher(rclient):
    return WeightPublisher(
        rclient, NAMES, "127.0.0.1", BUCKET_MB, TIMEOUT_S, SECRET, transport="nccl",
        nccl_backend="nccl",
    )  # fmt: skip


@pytest.mark.gpu
def test_nccl_group_is_set_up_non_blocking_raises_errors_and_is_aborted(monkeypatch, caplog):
    """One rank on one GPU: make_group asks NCCL for non-blocking communicator set-up and
    for errors raised to the caller (not the process killed), and destroy() aborts the
    communicator without an error."""
    import datetime
    import logging

    import torch.distributed as dist

    from pipeline.transfer.channel import wait_work
    from pipeline.transfer.nccl import destroy, make_group

    _gpus(1)
    for var in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_USE_COMM_NONBLOCKING"):
        monkeypatch.delenv(var, raising=False)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    group = make_group("nccl", dist.PrefixStore("g0", store), 0, 1, "127.0.0.1", 10)
    assert isinstance(group, dist.ProcessGroupNCCL)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] == "1"
    t = torch.arange(8, dtype=torch.float32, device="cuda")
    wait_work(group.broadcast(t, 0), time.monotonic() + 30, "broadcast")
    with caplog.at_level(logging.DEBUG, logger="pipeline.transfer.nccl"):
        destroy(group)
    assert "group tear-down" not in caplog.text  # abort() itself did not fail


@pytest.mark.gpu
def test_nccl_actor_killed_mid_broadcast_is_aborted_and_a_new_group_forms(
    tiny, rclient, redis_server
):
    """Trainer on GPU 0, actors on GPU 1: an actor dies after the first bucket; the
    trainer (this process) lives on, drops it after one deadline, aborts the group, and
    a new actor then gets the version whole through a new communicator."""
    _gpus(2)
    path, model = tiny
    publisher = _nccl_publisher(rclient)
    gpu1 = {"CUDA_VISIBLE_DEVICES": "1"}
    hung = Peer("half_actor", redis_server.url, path, "actor-0", "nccl", env=gpu1)
    late = None
    try:
        hung.expect("joined", timeout_s=60)
        assert wait_until(lambda: publisher.members() == ["actor-0"], 30)
        _bump(model, 0.5)
        t0 = time.monotonic()
        publisher.submit(1, model)
        hung.expect("half", timeout_s=60)  # communicator set up, one bucket received
        hung.kill()
        assert wait_until(lambda: publisher.idle() and publisher.actors_dropped == 1, 60)
        assert time.monotonic() - t0 < TIMEOUT_S + 30, "the dead actor cost more than a deadline"
        assert publisher.members() == [] and publisher.published == 0
        late = Peer("real_actor", redis_server.url, path, "actor-1", "nccl", env=gpu1)
        assert _digest_line(late, 1, timeout_s=120) == params_digest(model)  # caught up
        assert publisher.sender._formed == 2  # a second communicator after the abort
    finally:
        for peer in (hung, late):
            if peer is not None:
                peer.kill()
        publisher.close(timeout_s=5)


@pytest.mark.gpu
def test_nccl_member_that_never_sets_up_its_communicator_costs_one_deadline(
    tiny, rclient, redis_server
):
    """The actor passes the store barrier and never creates its communicator. Blocking
    NCCL set-up would hold the trainer's first broadcast for ever; non-blocking set-up
    lets the poll give up at the deadline, the actor is dropped, the trainer goes on."""
    _gpus(1)  # the actor never touches NCCL: one GPU is enough
    path, model = tiny
    publisher = _nccl_publisher(rclient)
    actor = Peer("arrive_only_actor", redis_server.url, path, "actor-0", "nccl")
    try:
        actor.expect("joined", timeout_s=60)
        assert wait_until(lambda: publisher.members() == ["actor-0"], 30)
        t0 = time.monotonic()
        publisher.submit(1, model)
        actor.expect("arrived", timeout_s=30)
        assert wait_until(lambda: publisher.idle() and publisher.actors_dropped == 1, 60)
        assert time.monotonic() - t0 < TIMEOUT_S + 20, "communicator set-up was not bounded"
        assert publisher.published == 0 and publisher.members() == []
    finally:
        actor.kill()
        publisher.close(timeout_s=5)
