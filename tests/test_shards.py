"""Sharded work streams (redis.shards) on real redis-servers: the sharded consumer's
reads, acks, dead letters and positions, the accounting across shards, the config's
errors, and the tiny pipeline end to end on two embedded instances."""

import json
import shutil

import pytest
from omegaconf import OmegaConf

from pipeline.accounting import in_flight
from pipeline.config import shard_urls, validate_shards
from pipeline.messages import (
    SCHEMA_VERSION,
    RolloutGroup,
    Sample,
    encode,
    pack_f32,
    pack_i32,
    rle_encode,
)
from pipeline.redis_server import EmbeddedRedis
from pipeline.streams import Consumer, Names, connect, publish
from pipeline.streams.shards import ShardedConsumer, Shards, open_consumer
from tests.launching import run_tiny


@pytest.fixture(scope="module")
def second_server(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    server = EmbeddedRedis(str(tmp_path_factory.mktemp("redis-shard1")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def two(rclient, second_server):
    other = connect(second_server.url, attempts=3)
    other.flushdb()
    try:
        yield Shards([rclient, other], names=NAMES)
    finally:
        other.close()


NAMES = Names("t", "shards")


def group(gid: str, n_tokens: int = 5) -> RolloutGroup:
    samples = [
        Sample(
            index=i,
            completion_ids=pack_i32(range(n_tokens)),
            logprobs=pack_f32([-0.5] * n_tokens),
            versions=rle_encode([0] * n_tokens),
            reward=float(i % 2),
            finished=True,
        )
        for i in range(2)
    ]
    return RolloutGroup(
        schema=SCHEMA_VERSION,
        group_id=gid,
        actor="a",
        problem_id="p",
        prompt_ids=pack_i32([1, 2]),
        samples=samples,
        temperature=1.0,
    )


def produce(shards: Shards, gids: list[str]) -> None:
    for gid in gids:
        part = shards.next()
        publish(part.client, part.names.rollouts, encode(group(gid)), group=gid)


def test_producer_rotates_and_consumer_reads_every_shard(two):
    reader = open_consumer(two, NAMES, NAMES.rollouts, "g", "c", RolloutGroup, block_ms=50)
    assert isinstance(reader, ShardedConsumer)
    produce(two, [f"g{i}" for i in range(6)])
    assert [c.xlen(NAMES.rollouts) for c in two.clients] == [3, 3]
    got, shards_seen = [], set()
    for _ in range(6):
        entries = reader.read(count=10)
        assert len({e.split("@")[0] for e, _ in entries}) <= 1, "a read mixed shards"
        shards_seen |= {int(e.split("@")[0]) for e, _ in entries}
        got += entries
    assert sorted(g.group_id for _, g in got) == [f"g{i}" for i in range(6)]
    assert shards_seen == {0, 1}
    assert reader.client_for(got[0][0]) is two.clients[int(got[0][0].split("@")[0])]
    reader.ack([e for e, _ in got])
    for c in two.clients:
        assert c.xpending(NAMES.rollouts, "g")["pending"] == 0
    assert reader.trim() == 6  # every acknowledged entry on both shards
    assert [c.xlen(NAMES.rollouts) for c in two.clients] == [0, 0]


def test_bad_entry_on_a_shard_goes_to_the_primary_dead_letters(two):
    reader = open_consumer(two, NAMES, NAMES.rollouts, "g", "c", RolloutGroup, block_ms=50)
    two.clients[1].xadd(NAMES.rollouts, {"data": b"\x00garbage", "group": "bad"})
    for _ in range(3):
        assert reader.read(count=10) == []
    assert reader.dead_lettered == 1
    dead = two.primary.xrange(NAMES.dead)
    assert len(dead) == 1 and dead[0][1][b"shard"] == b"1"
    assert dead[0][1][b"group"] == b"bad" and dead[0][1][b"source"] == NAMES.rollouts.encode()
    assert two.clients[1].xlen(NAMES.dead) == 0, "dead letters belong on the primary"
    assert two.clients[1].xpending(NAMES.rollouts, "g")["pending"] == 0


def test_positions_per_shard_resume_and_trim(two):
    reader = open_consumer(two, NAMES, NAMES.rollouts, "g", "c", RolloutGroup, block_ms=50)
    produce(two, [f"g{i}" for i in range(4)])
    first = reader.read(count=1) + reader.read(count=1)
    assert {e.split("@")[0] for e, _ in first} == {"0", "1"}
    pos = reader.position("0-0", [e for e, _ in first])
    parts = pos.split(",")
    assert len(parts) == 2 and all(p != "0-0" for p in parts)
    rest = reader.read(count=10) + reader.read(count=10)
    reader.ack([e for e, _ in first + rest])
    # trimming keeps what comes after the position (a resume re-reads it)
    assert reader.trim(keep_after=pos) == 2
    # a restarted reader set back to the position gets exactly the later entries again
    again = open_consumer(two, NAMES, NAMES.rollouts, "g", "c2", RolloutGroup, block_ms=50)
    again.set_position(pos)
    redelivered = again.read(count=10) + again.read(count=10)
    assert sorted(g.group_id for _, g in redelivered) == sorted(g.group_id for _, g in rest)
    with pytest.raises(ValueError, match="redis.shards=2"):
        reader.parse("1-0,2-0,3-0")
    assert reader.parse("5-0") == ["5-0", "0-0"]  # a one-shard checkpoint is shard 0's


def test_accounting_sees_entries_in_flight_on_every_shard(two):
    open_consumer(two, NAMES, NAMES.rollouts, "preprocessor", "c", RolloutGroup)
    produce(two, ["a", "b", "c"])
    flight = in_flight(two.primary, NAMES, two.clients[1:])
    assert flight["rollouts_groups"] == ["a", "b", "c"]
    only_primary = in_flight(two.primary, NAMES)
    assert only_primary["rollouts_groups"] == ["a", "c"]


def test_one_shard_is_the_plain_consumer(rclient):
    reader = open_consumer(Shards([rclient]), NAMES, NAMES.rollouts, "g", "c", RolloutGroup)
    assert type(reader) is Consumer
    assert reader.position("0-0", ["5-1", "7-0"]) == "7-0"
    with pytest.raises(ValueError, match="written with 2 redis.shards but redis.shards=1"):
        reader.set_position("5-0,6-0")


def cfg(**redis):
    return OmegaConf.create({"redis": {"url": None, "shards": 1, "shard_urls": []} | redis})


def test_shard_config_errors(monkeypatch):
    monkeypatch.delenv("NONSTOP_REDIS_SHARD_URLS", raising=False)
    with pytest.raises(ValueError, match="redis.shards=0 must be an integer >= 1"):
        validate_shards(cfg(shards=0))
    with pytest.raises(ValueError, match="redis.shard_urls is set but redis.url is not"):
        validate_shards(cfg(shards=2, shard_urls=["redis://h:1/0"]))
    with pytest.raises(ValueError, match="has 2 URLs but redis.shards=2 needs 1"):
        validate_shards(cfg(url="redis://h:0/0", shards=2, shard_urls=["redis://a", "redis://b"]))
    with pytest.raises(ValueError, match="redis.shards=3 needs 2 shard URLs"):
        shard_urls(cfg(url="redis://h:0/0", shards=3), "actor")
    monkeypatch.setenv("NONSTOP_REDIS_SHARD_URLS", "redis://x:1/0,redis://y:2/0")
    assert shard_urls(cfg(url="redis://h:0/0", shards=3), "actor") == [
        "redis://x:1/0",
        "redis://y:2/0",
    ]
    monkeypatch.setenv("NONSTOP_REDIS_SHARD_URLS_ACTOR", "redis://own:1/0,redis://own:2/0")
    assert shard_urls(cfg(url="redis://h:0/0", shards=3), "actor")[0] == "redis://own:1/0"
    assert shard_urls(cfg(shards=1), "actor") == []


@pytest.mark.slow
def test_tiny_pipeline_on_two_shards_loses_nothing_and_resumes(tmp_path):
    """Two embedded redis-servers: produced = trained (+ in flight at the end), no
    group lost or trained twice, batches from both shards trained; a relaunch resumes
    from the per-shard checkpoint position."""
    run_dir = tmp_path / "run"
    code, out = run_tiny(tmp_path, run_dir, "redis.shards=2", "trainer.max_steps=4")
    assert code == 0, out
    assert "shard 1 on 127.0.0.1" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["outcome"] == "finished" and summary["trainer_steps"] == 4
    assert acc["groups_lost"] == 0 and acc["samples_lost"] == 0, acc
    assert acc["groups_duplicated"] == 0 and acc["samples_conflicting"] == 0, acc
    assert acc["groups_produced"] == (
        acc["groups_trained"] + acc["groups_in_flight_at_end"] + acc["groups_stale"]
    ), acc
    assert acc["groups_trained"] >= 4
    state = json.loads((run_dir / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    positions = state["entry_id"].split(",")
    assert len(positions) == 2 and "0-0" not in positions, state["entry_id"]

    code, out = run_tiny(tmp_path, run_dir, "redis.shards=2", "trainer.max_steps=6")
    assert code == 0, out
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["trainer_steps"] == 6
    assert acc["groups_lost"] == 0 and acc["groups_duplicated"] == 0, acc
