"""Peer processes for the weight-transfer fault tests: a real actor, and a
trainer or actor that dies halfway through a transfer.

``python -m tests.weight_peers ROLE REDIS_URL MODEL_DIR NAME`` prints one line
per event (``joined``, ``applied <v>``, ``half``) and runs until killed.
"""

import sys
import threading
import time

from actor.engine import HFEngine
from pipeline.messages import SCHEMA_VERSION, WeightAnnouncement, decode, encode
from pipeline.models import load_model
from pipeline.streams import Names, connect, publish
from pipeline.transfer.gloo import broadcast_buckets
from pipeline.weight_publisher import WeightPublisher
from pipeline.weight_receiver import WeightReceiver
from pipeline.weights import bucket_layout, checksum, flatten

NAMES = Names("test", "faults")
BUCKET_MB = 0.05
TIMEOUT_S = 3.0
SECRET = "test-run-secret"


def say(msg: str) -> None:
    print(msg, flush=True)


def real_actor(client, model_dir: str, name: str) -> None:
    model, tok = load_model(model_dir)
    engine = HFEngine(model, tok, temperature=1.0, top_p=1.0, top_k=0)
    receiver = WeightReceiver(client, NAMES, name, engine, timeout_s=TIMEOUT_S, secret=SECRET)
    receiver.start()
    seen = 0
    while True:
        if receiver.applied > seen:
            seen = receiver.applied
            say(f"applied {engine.version}")
        time.sleep(0.05)


def half_actor(client, model_dir: str, name: str) -> None:
    """Joins, takes the first bucket of the first announcement, then hangs."""
    receiver = WeightReceiver(client, NAMES, name, target=None, timeout_s=TIMEOUT_S, secret=SECRET)
    after = receiver._join()
    say("joined")
    while True:
        for _s, entries in client.xread({NAMES.weights: after}, block=1000) or []:
            ann = decode(entries[0][1][b"data"], WeightAnnouncement)
            import torch

            first = torch.empty(ann.buckets[0].numel, dtype=getattr(torch, ann.dtype))
            receiver.transport.receive([first], time.monotonic() + 30)
            say("half")
            threading.Event().wait()


def half_trainer(client, model_dir: str, name: str) -> None:
    """Waits for one actor, announces a version, sends half its buckets, then hangs."""
    model, _ = load_model(model_dir)
    publisher = WeightPublisher(client, NAMES, "127.0.0.1", BUCKET_MB, timeout_s=30, secret=SECRET)
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
        checksums=checksum(flat),
        targets=publisher.members(),
    )
    publish(client, NAMES.weights, encode(ann), version=1)
    group = publisher.sender._groups[publisher.members()[0]]  # the gloo pair group
    broadcast_buckets(group, flat[: len(flat) // 2], time.monotonic() + 30)
    say("half")
    threading.Event().wait()


if __name__ == "__main__":
    role, url, model_dir, name = sys.argv[1:5]
    {"real_actor": real_actor, "half_actor": half_actor, "half_trainer": half_trainer}[role](
        connect(url), model_dir, name
    )
