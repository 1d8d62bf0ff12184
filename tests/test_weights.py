"""Weight transfer over a real redis-server and a gloo pair group."""

import time

import torch

from actor.engine import HFEngine
from pipeline.messages import WeightAnnouncement, decode
from pipeline.models import load_model, materialize_model
from pipeline.streams import Names, wait_until
from pipeline.weights import WeightPublisher, WeightReceiver, bucket_layout, checksum, flatten


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


def test_published_version_reaches_the_actor_whole(tmp_path, rclient):
    trainer_model, actor_model, tok = _models(tmp_path)
    names = Names("test", "weights")
    engine = HFEngine(actor_model, tok, temperature=1.0, top_p=1.0, top_k=0)
    publisher = WeightPublisher(rclient, names, "127.0.0.1", bucket_mb=1, timeout_s=10)
    receiver = WeightReceiver(rclient, names, "actor-0", engine.swap, timeout_s=10)
    receiver.start()
    try:
        assert wait_until(lambda: rclient.xlen(names.stream("joins")) == 1, 10)
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


def test_publisher_goes_on_without_actors(tmp_path, rclient):
    trainer_model, _, _ = _models(tmp_path)
    names = Names("test", "alone")
    publisher = WeightPublisher(rclient, names, "127.0.0.1", bucket_mb=1, timeout_s=5)
    t0 = time.monotonic()
    publisher.submit(1, trainer_model)
    publisher.close(timeout_s=10)
    assert publisher.published == 1 and time.monotonic() - t0 < 10
