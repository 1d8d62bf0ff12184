"""Weight transfer over a real redis-server and a gloo pair group."""

import threading
import time

import msgspec
import pytest
import torch

from actor.engines.hf import HFEngine
from actor.weight_receiver import WeightReceiver
from pipeline.messages import SCHEMA_VERSION, WeightAnnouncement, decode, encode
from pipeline.models import load_model, materialize_model
from pipeline.streams import Names, wait_until
from pipeline.telemetry import PoolStatus
from pipeline.transfer.buckets import SUM32, SUM64, bucket_layout, bucket_sums, checksum, flatten
from tests.weight_peers import BUCKET_MB, NAMES, SECRET, TIMEOUT_S, Peer, params_digest
from trainer.weight_publisher import WeightPublisher


def _models(tmp_path):
    path = materialize_model("tiny", cache_dir=str(tmp_path))
    trainer_model, tok = load_model(path)
    actor_model, _ = load_model(path)
    return trainer_model, actor_model, tok


def test_layout_and_checksum_cover_every_parameter(tmp_path):
    model, _, _ = _models(tmp_path)
    named = list(model.named_parameters())
    layout = bucket_layout(named, bucket_bytes=4096)
    assert len(layout) > 1
    assert sum(b.numel for b in layout) == sum(p.numel() for _, p in named)
    flat = flatten(dict(named), layout)
    sums = checksum(flat)
    flat[0][0] += 1.0
    assert checksum(flat)[0] != sums[0] and checksum(flat)[1:] == sums[1:]


def test_whole_model_digest_sees_swapped_and_permuted_tensors(tmp_path):
    """params_digest (tests/weight_peers.py) is what the multi-process tests compare; a
    sum of bit patterns (``checksum``, the transfer's per-bucket check) cannot see two
    equal-shape tensors trade places or a tensor's elements permuted: the digest must."""
    model, _, _ = _models(tmp_path)
    before, sum_before = params_digest(model), sum(checksum(list(model.parameters())))
    by_shape: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        by_shape.setdefault(tuple(p.shape), []).append(p)
    a, b = next(ps for ps in by_shape.values() if len(ps) >= 2 and not torch.equal(*ps[:2]))[:2]
    with torch.no_grad():
        saved = a.clone()
        a.copy_(b)
        b.copy_(saved)  # two equal-shape tensors swapped
    assert sum(checksum(list(model.parameters()))) == sum_before  # blind to it
    assert params_digest(model) != before
    with torch.no_grad():
        b.copy_(a)
        a.copy_(saved)  # back as they were
    assert params_digest(model) == before
    assert a.numel() % 2 == 0  # float32: two elements per 64-bit word that sum64 adds
    with torch.no_grad():  # a permutation of its words within one tensor
        a.copy_(a.reshape(-1).view(torch.int64).flip(0).view(a.dtype).reshape(a.shape))
    assert sum(checksum(list(model.parameters()))) == sum_before
    assert params_digest(model) != before


@pytest.mark.parametrize("n", [1, 2, 3, 1001])
def test_both_checksum_kinds_are_exact_sums_of_their_words(n):
    """sum64: the bytes as 64-bit words, the last zero-padded, summed modulo 2**64 (as a
    signed 64-bit value); sum32: each float32's 32-bit pattern widened and summed: both
    equal the same sums done here in Python integers, for bucket sizes with and without a
    partial last word; an unknown kind (a newer trainer's) is refused naming the kinds."""
    g = torch.Generator().manual_seed(n)
    b = torch.randn(n, generator=g) * 1e30  # large bit patterns: the sum wraps
    raw = b.numpy().tobytes()
    padded = raw + b"\0" * (-len(raw) % 8)
    words64 = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    want64 = sum(words64) % 2**64
    want64 -= 2**64 if want64 >= 2**63 else 0
    words32 = [int.from_bytes(raw[i : i + 4], "little", signed=True) for i in range(0, len(raw), 4)]
    assert checksum([b], SUM64) == [want64] == checksum([b])  # sum64: this build's default
    assert checksum([b], SUM32) == [sum(words32)]
    assert bucket_sums([b]) == {"checksums": [want64], "checksum_kind": SUM64}
    with pytest.raises(ValueError, match="sum64, sum32.*one build in every pool"):
        checksum([b], "sum128")


def test_an_announcement_without_a_checksum_kind_is_an_older_trainers_sum32():
    """An older trainer's announcement has no ``checksum_kind``: read, it says sum32, and
    its sums check against a sum32 receiver (pipeline/transfer/base.py ReceiverSource)."""
    ann = WeightAnnouncement(
        schema=SCHEMA_VERSION, version=1, dtype="float32", buckets=[], checksums=[],
        targets=["actor-0"],
    )  # fmt: skip
    old = {k: v for k, v in msgspec.to_builtins(ann).items() if k != "checksum_kind"}
    assert decode(msgspec.msgpack.encode(old), WeightAnnouncement).checksum_kind == SUM32


def test_an_older_build_refuses_a_new_announcement_naming_the_field():
    """SCHEMA_VERSION stayed 4 (pipeline/messages.py says why): an older build's
    WeightAnnouncement (this one less ``checksum_kind``, unknown fields forbidden as
    everywhere) refuses this build's announcement, naming the field it does not know,
    rather than checking its sums the wrong way."""
    fields = [
        (f.name, f.type) if f.required else (f.name, f.type, f.default)
        for f in msgspec.structs.fields(WeightAnnouncement)
        if f.name != "checksum_kind"
    ]
    older = msgspec.defstruct(
        "WeightAnnouncement", fields, forbid_unknown_fields=True, kw_only=True
    )
    ann = WeightAnnouncement(
        schema=SCHEMA_VERSION, version=1, dtype="float32", buckets=[], targets=["actor-0"],
        **bucket_sums([torch.ones(3)]),
    )  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match="unknown field `checksum_kind`"):
        msgspec.msgpack.Decoder(older).decode(encode(ann))


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in-place"])
def test_published_version_reaches_the_actor_whole(tmp_path, rclient, staged):
    trainer_model, actor_model, tok = _models(tmp_path)
    names = Names("test", f"weights-{staged}")
    engine = HFEngine(actor_model, tok, temperature=1.0, top_p=1.0, top_k=0)
    publisher = WeightPublisher(
        rclient, names, "127.0.0.1", bucket_mb=0.05, timeout_s=10, secret=SECRET
    )
    receiver = WeightReceiver(
        rclient, names, "actor-0", engine, timeout_s=10, secret=SECRET, staged=staged
    )
    receiver.start()
    try:
        assert wait_until(lambda: rclient.xlen(names.joins) == 1, 10)
        for version in (1, 2):
            with torch.no_grad():
                for p in trainer_model.parameters():
                    p.add_(0.5)
            publisher.submit(version, trainer_model)
            assert wait_until(lambda v=version: engine.version == v, 20), receiver.failed
        for (n, p), (_, q) in zip(
            trainer_model.named_parameters(), actor_model.named_parameters(), strict=True
        ):
            torch.testing.assert_close(p, q, msg=n)
        assert receiver.applied == 2 and receiver.failed == 0
        entries = rclient.xrange(names.weights)
        ann = decode(entries[-1][1][b"data"], WeightAnnouncement)
        assert ann.version == 2 and ann.targets == ["actor-0"]
        assert entries[-1][1][b"version"] == b"2"  # readable beside the payload
    finally:
        receiver.stop()
        publisher.close(timeout_s=5)


def test_a_version_nobody_received_is_not_counted_as_published(tmp_path, rclient):
    trainer_model, _, _ = _models(tmp_path)
    names = Names("test", "alone")
    status = PoolStatus(rclient, names, "trainer", "trainer")
    publisher = WeightPublisher(
        rclient, names, "127.0.0.1", bucket_mb=1, timeout_s=5, secret=SECRET, status=status
    )
    t0 = time.monotonic()
    publisher.submit(1, trainer_model)
    assert wait_until(publisher.idle, 10)
    publisher.submit(2, dict(trainer_model.named_parameters()))  # a {name: tensor} mapping too
    publisher.close(timeout_s=10)
    assert time.monotonic() - t0 < 10  # the trainer goes on without actors
    assert publisher.published == 0 and publisher.unreceived == 2
    fields = {k.decode(): v.decode() for k, v in rclient.hgetall(names.status("trainer")).items()}
    assert fields["weight_versions_unreceived"] == "2"
    assert "weight_updates_published" not in fields
    assert rclient.get(names.published_version) is None


def test_an_actor_joining_after_the_last_step_is_sent_the_last_version(tmp_path, rclient):
    """A short run on a loaded machine: the trainer's last version went out to nobody
    (no actor had joined yet); while an actor is alive, close() keeps accepting joins,
    so the actor that joins then is sent it before the trainer leaves."""
    trainer_model, actor_model, tok = _models(tmp_path)
    names = Names("test", "late-join")
    PoolStatus(rclient, names, "actor-0", "actor")  # alive: its heartbeat is fresh
    publisher = WeightPublisher(
        rclient, names, "127.0.0.1", bucket_mb=0.05, timeout_s=10, secret=SECRET
    )
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(0.5)
    publisher.submit(1, trainer_model)
    assert wait_until(publisher.idle, 10) and publisher.members() == []
    engine = HFEngine(actor_model, tok, temperature=1.0, top_p=1.0, top_k=0)
    receiver = WeightReceiver(rclient, names, "actor-0", engine, timeout_s=10, secret=SECRET)
    closer = threading.Thread(target=publisher.close, kwargs={"timeout_s": 20})
    closer.start()
    time.sleep(1.0)  # the trainer is closing when the actor joins
    receiver.start()
    try:
        closer.join(timeout=30)
        assert not closer.is_alive()
        assert publisher.published == 1 and publisher.unreceived == 0
        assert engine.version == 1
        assert params_digest(actor_model) == params_digest(trainer_model)
    finally:
        receiver.stop()


def test_submit_rejects_what_is_not_a_parameter_set(tmp_path, rclient):
    publisher = WeightPublisher(
        rclient, Names("test", "bad"), "127.0.0.1", bucket_mb=1, timeout_s=5, secret=SECRET
    )
    try:
        with pytest.raises(ValueError, match="nn.Module"):
            publisher.submit(1, 3.0)
        with pytest.raises(ValueError, match="mix dtypes"):
            publisher.submit(1, {"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.bfloat16)})
        with pytest.raises(ValueError, match="empty"):
            publisher.submit(1, {})
    finally:
        publisher.close(timeout_s=1)


def test_a_silent_peer_fails_the_wait_at_its_deadline(tmp_path, redis_server):
    """No trainer ever publishes: the actor peer lives on and prints nothing. Waiting for
    its line fails at the deadline (a bare readline() would block for ever)."""
    path = materialize_model("tiny", cache_dir=str(tmp_path))
    peer = Peer("real_actor", redis_server.url, path, "actor-silent")
    try:
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match="printed nothing before the deadline"):
            peer.expect("applied 1", timeout_s=2)
        assert time.monotonic() - t0 < 5 and peer.proc.poll() is None
    finally:
        peer.kill()


def _generate_in_background(engine, tok):
    done = {"n": 0}
    stop = {"flag": False}

    def loop():
        while not stop["flag"]:
            engine.generate([tok("1 + 1 =")["input_ids"]] * 2, max_new_tokens=8)
            done["n"] += 1

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return done, lambda: (stop.update(flag=True), t.join(timeout=10))


def _actor_with_half_trainer(tmp_path, rclient, redis_server, staged):
    path = materialize_model("tiny", cache_dir=str(tmp_path))
    model, tok = load_model(path)
    engine = HFEngine(model, tok, temperature=1.0, top_p=1.0, top_k=0)
    receiver = WeightReceiver(
        rclient, NAMES, "actor-0", engine, timeout_s=TIMEOUT_S, secret=SECRET, staged=staged
    )
    trainer = Peer("half_trainer", redis_server.url, path, "trainer")
    receiver.start()
    done, stop = _generate_in_background(engine, tok)
    trainer.expect("half")
    trainer.kill()
    assert wait_until(lambda: receiver.failed >= 1, TIMEOUT_S + 10)
    return model, engine, receiver, done, stop


def test_trainer_killed_mid_transfer_leaves_old_weights_whole(tmp_path, rclient, redis_server):
    path = materialize_model("tiny", cache_dir=str(tmp_path))
    before = {n: p.detach().clone() for n, p in load_model(path)[0].named_parameters()}
    model, engine, receiver, done, stop = _actor_with_half_trainer(
        tmp_path, rclient, redis_server, staged=True
    )
    try:
        generated = done["n"]
        assert wait_until(lambda: done["n"] > generated + 2, 20), "generation stopped"
    finally:
        stop()
        receiver.stop()
    assert receiver.applied == 0 and engine.version == 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], msg=n)  # whole old weights, no mix


def test_in_place_transfer_failure_pauses_generation_until_a_whole_version(
    tmp_path, rclient, redis_server
):
    model, engine, receiver, done, stop = _actor_with_half_trainer(
        tmp_path, rclient, redis_server, staged=False
    )
    publisher = None
    try:
        assert engine.version is None  # partial weights: no forward pass may run
        paused_at = done["n"]
        time.sleep(1.0)
        assert done["n"] == paused_at, "generated on a mix of two versions"
        new_model = load_model(materialize_model("tiny", cache_dir=str(tmp_path)))[0]
        with torch.no_grad():
            for p in new_model.parameters():
                p.mul_(0.5)
        publisher = WeightPublisher(
            rclient, NAMES, "127.0.0.1", BUCKET_MB, timeout_s=TIMEOUT_S, secret=SECRET
        )
        assert wait_until(lambda: "actor-0" in publisher.members(), TIMEOUT_S * 4)
        publisher.submit(2, new_model)
        assert wait_until(lambda: engine.version == 2, TIMEOUT_S * 4)
        assert wait_until(lambda: done["n"] > paused_at, 20), "generation did not resume"
    finally:
        stop()
        receiver.stop()
        if publisher:
            publisher.close(timeout_s=5)
    for (n, p), (_, q) in zip(model.named_parameters(), new_model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=n)


def _peer_trainer(tmp_path, rclient):
    """A tiny model and a publisher on the names the peer processes use."""
    path = materialize_model("tiny", cache_dir=str(tmp_path))
    model, _ = load_model(path)
    publisher = WeightPublisher(rclient, NAMES, "127.0.0.1", BUCKET_MB, TIMEOUT_S, SECRET)
    return path, model, publisher


def test_actor_killed_mid_transfer_does_not_stall_the_trainer(tmp_path, rclient, redis_server):
    path, model, publisher = _peer_trainer(tmp_path, rclient)
    actor = Peer("half_actor", redis_server.url, path, "actor-0")
    try:
        actor.expect("joined")
        assert wait_until(lambda: "actor-0" in publisher.members(), 10)
        t0 = time.monotonic()
        publisher.submit(1, model)
        actor.expect("half")
        actor.kill()
        assert wait_until(publisher.idle, TIMEOUT_S + 5)
        assert time.monotonic() - t0 < TIMEOUT_S + 5
        assert list(publisher.dropped) == ["actor-0"] and "actor-0" not in publisher.members()
        assert publisher.actors_dropped == 1 and "actor-0" in publisher.last_error
        assert publisher.published == 0  # nobody received version 1 whole
        publisher.submit(2, model)  # the trainer goes on
        assert wait_until(publisher.idle, 5) and publisher.unreceived == 1
    finally:
        actor.kill()
        publisher.close(timeout_s=5)


def test_one_hung_actor_does_not_delay_the_others(tmp_path, rclient, redis_server):
    """Sends run concurrently: actor-1 gets the version while actor-0 hangs (sequential
    sends, in name order, would hold actor-1 back for the whole 8 s deadline)."""
    path = materialize_model("tiny", cache_dir=str(tmp_path))
    model, _ = load_model(path)
    status = PoolStatus(rclient, NAMES, "trainer", "trainer")
    publisher = WeightPublisher(
        rclient, NAMES, "127.0.0.1", BUCKET_MB, timeout_s=8, secret=SECRET, status=status
    )
    hung = Peer("half_actor", redis_server.url, path, "actor-0")
    good = Peer("real_actor", redis_server.url, path, "actor-1")
    try:
        assert wait_until(lambda: publisher.members() == ["actor-0", "actor-1"], 60)
        t0 = time.monotonic()
        publisher.submit(1, model)
        good.expect("applied 1", timeout_s=8)
        assert time.monotonic() - t0 < 4, "actor-1 waited for the hung actor"
        assert wait_until(publisher.idle, 8 + 5)
        assert time.monotonic() - t0 < 8 + 5  # the dead actor cost one deadline
        assert publisher.members() == ["actor-1"] and list(publisher.dropped) == ["actor-0"]
        assert publisher.published == 1 and publisher.unreceived == 0
        fields = rclient.hgetall(NAMES.status("trainer"))
        assert fields[b"weight_updates_published"] == b"1"
        assert fields[b"actors_dropped"] == b"1"
        assert b"actor-0" in fields[b"last_publish_error"]
        assert rclient.get(NAMES.published_version) == b"1"
    finally:
        hung.kill()
        good.kill()
        publisher.close(timeout_s=5)


def test_restarted_actor_reaches_the_current_version(tmp_path, rclient, redis_server):
    path, model, publisher = _peer_trainer(tmp_path, rclient)
    first = Peer("real_actor", redis_server.url, path, "actor-0")
    try:
        assert wait_until(lambda: "actor-0" in publisher.members(), 30)
        publisher.submit(1, model)
        first.expect("applied 1")
        first.kill()
        publisher.submit(2, model)  # sent while the actor is down: it is dropped
        assert wait_until(lambda: publisher.idle() and publisher.actors_dropped == 1, TIMEOUT_S + 5)
        assert publisher.published == 1  # version 2 reached nobody (yet)
        second = Peer("real_actor", redis_server.url, path, "actor-0")
        second.expect("applied 2")  # caught up on joining, with no new trainer step
        assert wait_until(lambda: publisher.published == 2, 5)  # now version 2 counts
        second.kill()
    finally:
        first.kill()
        publisher.close(timeout_s=5)


def test_join_without_the_run_secret_is_refused(tmp_path, rclient):
    trainer_model, actor_model, tok = _models(tmp_path)
    names = Names("test", "secret")
    engine = HFEngine(actor_model, tok, temperature=1.0, top_p=1.0, top_k=0)
    status = PoolStatus(rclient, names, "trainer", "trainer")
    publisher = WeightPublisher(
        rclient, names, "127.0.0.1", 1, timeout_s=3, secret=SECRET, status=status
    )
    intruder = WeightReceiver(rclient, names, "actor-x", engine, timeout_s=3, secret="guess")
    intruder.start()
    try:
        # the publisher read the join and refused it (not merely: has not read it yet)
        assert wait_until(lambda: publisher.joins_refused >= 1, 10), "the join was not refused"
        assert set(publisher.refused) == {"actor-x"}
        assert int(rclient.hget(names.status("trainer"), "weight_joins_refused")) >= 1
        publisher.submit(1, trainer_model)
        assert wait_until(publisher.idle, 10)
        assert publisher.members() == [] and engine.version == 0
    finally:
        intruder.stop()
        publisher.close(timeout_s=5)


def test_actor_follows_a_restarted_trainer(tmp_path, rclient):
    trainer_model, actor_model, tok = _models(tmp_path)
    names = Names("test", "epochs")
    engine = HFEngine(actor_model, tok, temperature=1.0, top_p=1.0, top_k=0)
    receiver = WeightReceiver(rclient, names, "actor-0", engine, timeout_s=5, secret=SECRET)
    first = WeightPublisher(rclient, names, "127.0.0.1", 1, timeout_s=5, secret=SECRET)
    receiver.start()
    try:
        assert wait_until(lambda: "actor-0" in first.members(), 10)
        first.submit(1, trainer_model)
        assert wait_until(lambda: engine.version == 1, 10)
        first.close(timeout_s=5)  # the trainer process goes away ...
        second = WeightPublisher(rclient, names, "127.0.0.1", 1, timeout_s=5, secret=SECRET)
        assert wait_until(lambda: "actor-0" in second.members(), 15), "actor did not rejoin"
        second.submit(7, trainer_model)  # ... and its successor resumes at another version
        assert wait_until(lambda: engine.version == 7, 10)
        second.close(timeout_s=5)
    finally:
        receiver.stop()
