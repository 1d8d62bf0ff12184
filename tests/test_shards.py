"""Partitioned work streams (redis.mode=cluster, redis.shards partitions) on a real local
Redis Cluster: the partitioned consumer's reads, acks, dead letters and positions, the
accounting across partitions, the tiny pipeline on two partitions resumed from its
per-partition checkpoint position; and the refusals of the independent-instance shards
that Redis Cluster replaced (redis.shards > 1 in single mode, redis.shard_urls,
NONSTOP_REDIS_SHARD_URLS, an old sharded run directory), one line each, exit 2 from the
launcher."""

import contextlib
import json
import re
import shutil

import pytest
import redis
from omegaconf import OmegaConf

from pipeline.config import MIGRATE_SHARDS, expand_shorthands, load_config, validate_shards
from pipeline.messages import (
    SCHEMA_VERSION,
    RolloutGroup,
    Sample,
    encode,
    pack_f32,
    pack_i32,
    rle_encode,
)
from pipeline.run.accounting import in_flight
from pipeline.streams import Consumer, Names, connect, publish
from pipeline.streams.shards import ShardedConsumer, Shards, open_consumer
from pipeline.topology.cluster import LocalCluster
from tests.config_builders import compose_config
from tests.launching import run_tiny

NAMES = Names("t", "shards", cluster=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    local = LocalCluster(str(tmp_path_factory.mktemp("cluster")))
    local.start()
    yield local
    local.stop()


@pytest.fixture
def two(cluster):
    client = connect(cluster.url, reconnect_s=30)
    for node in cluster.nodes:  # a clean cluster for each test (replicas follow)
        with contextlib.suppress(redis.ReadOnlyError):  # a replica: its primary's flush
            cluster.node_client(node).flushall()
    try:
        yield Shards.cluster(client, NAMES, 2)
    finally:
        client.close()


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


def lengths(shards: Shards) -> list[int]:
    return [shards.client.xlen(p.names.rollouts) for p in shards.parts]


def test_producer_rotates_and_consumer_reads_every_partition(two):
    reader = open_consumer(two, NAMES, NAMES.rollouts, "g", "c", RolloutGroup, block_ms=50)
    assert isinstance(reader, ShardedConsumer)
    produce(two, [f"g{i}" for i in range(6)])
    assert lengths(two) == [3, 3]
    assert len({two.client.keyslot(p.names.rollouts) for p in two.parts}) == 2
    got, seen = [], set()
    for _ in range(6):
        entries = reader.read(count=10)
        assert len({e.split("@")[0] for e, _ in entries}) <= 1, "a read mixed partitions"
        seen |= {int(e.split("@")[0]) for e, _ in entries}
        got += entries
    assert sorted(g.group_id for _, g in got) == [f"g{i}" for i in range(6)]
    assert seen == {0, 1}
    k = int(got[0][0].split("@")[0])  # a preprocessor writes a read's batches there
    assert reader.part_for(got[0][0]).names.batches == NAMES.part(k).batches
    reader.ack([e for e, _ in got])
    for p in two.parts:
        assert two.client.xpending(p.names.rollouts, "g")["pending"] == 0
    assert reader.trim() == 6  # every acknowledged entry in both partitions
    assert lengths(two) == [0, 0]


def test_bad_entry_in_a_partition_goes_to_the_runs_dead_letters(two):
    reader = open_consumer(two, NAMES, NAMES.rollouts, "g", "c", RolloutGroup, block_ms=50)
    two.client.xadd(NAMES.part(1).rollouts, {"data": b"\x00garbage", "group": "bad"})
    for _ in range(3):
        assert reader.read(count=10) == []
    assert reader.dead_lettered == 1
    dead = two.client.xrange(NAMES.dead)
    assert len(dead) == 1 and dead[0][1][b"shard"] == b"1"
    assert dead[0][1][b"group"] == b"bad"
    assert dead[0][1][b"source"] == NAMES.part(1).rollouts.encode()
    assert two.client.xpending(NAMES.part(1).rollouts, "g")["pending"] == 0


def test_positions_per_partition_resume_and_trim(two):
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
    assert reader.parse("5-0") == ["5-0", "0-0"]  # a one-part checkpoint is partition 0's


def test_accounting_sees_entries_in_flight_in_every_partition(two):
    open_consumer(two, NAMES, NAMES.rollouts, "preprocessor", "c", RolloutGroup)
    produce(two, ["a", "b", "c"])
    flight = in_flight(two.client, NAMES, two)
    assert flight["rollouts_groups"] == ["a", "b", "c"]
    assert {e["shard"] for e in flight["entries"]} == {0, 1}
    only_first = in_flight(two.client, NAMES)  # no Shards: partition 0 alone
    assert only_first["rollouts_groups"] == ["a", "c"]


def test_one_part_is_the_plain_consumer(rclient):
    names = Names("t", "one")
    reader = open_consumer(Shards(rclient, names), names, names.rollouts, "g", "c", RolloutGroup)
    assert type(reader) is Consumer
    assert reader.position("0-0", ["5-1", "7-0"]) == "7-0"
    with pytest.raises(ValueError, match="written with 2 redis.shards but redis.shards=1"):
        reader.set_position("5-0,6-0")


def test_the_parts_follow_the_config():
    """Shards.of: redis.shards partitions in cluster mode, one part otherwise; a
    producer's rotation starts at a part of its own."""
    cfg = OmegaConf.create({"redis": {"mode": "cluster", "shards": 3}})
    shards = Shards.of(cfg, None, NAMES, "actor-1")
    assert len(shards) == 3 and shards.parts[2].names.rollouts == NAMES.part(2).rollouts
    starts = {Shards.of(cfg, None, NAMES, f"actor-{i}").next().k for i in range(12)}
    assert len(starts) > 1
    cfg.redis.mode = "single"
    assert len(Shards.of(cfg, None, Names("t", "x"))) == 1


# ------------------------------------------------------------------ refusals


def test_independent_shards_are_refused_naming_the_move(tmp_path, monkeypatch):
    """redis.shards > 1 in single mode, redis.shard_urls on the command line or in a
    config file, NONSTOP_REDIS_SHARD_URLS: one line naming Redis Cluster and the
    migration section; redis.shards stays the partition count in cluster mode."""
    cfg = compose_config(["+exp=tiny", "redis.shards=2"])
    with pytest.raises(ValueError) as e:
        validate_shards(cfg)
    line = str(e.value)
    assert line == f"redis.shards=2 with redis.mode=single: {MIGRATE_SHARDS}"
    assert "\n" not in line and "redis=cluster" in line and "Redis Cluster" in line
    assert "migrating from shards" in line
    cfg.redis.mode = "cluster"
    validate_shards(cfg)  # partitions of a cluster
    cfg.redis.shards = 0
    with pytest.raises(ValueError, match="redis.shards=0 must be an integer >= 1"):
        validate_shards(cfg)
    removed = re.escape(f"redis.shard_urls was removed: {MIGRATE_SHARDS}")
    with pytest.raises(ValueError, match=removed):
        expand_shorthands(["redis.shard_urls=[redis://h:1/0]"])
    saved = tmp_path / "config.yaml"
    OmegaConf.save(compose_config(["+exp=tiny"]), saved)
    old = OmegaConf.load(saved)
    old.redis.shard_urls = ["redis://h:1/0"]
    OmegaConf.save(old, saved)
    with pytest.raises(ValueError, match=re.escape(f"redis.shard_urls is set: {MIGRATE_SHARDS}")):
        load_config(str(saved))
    old.redis.shard_urls = []  # what every older version saved: names no shard, dropped
    OmegaConf.save(old, saved)
    assert "shard_urls" not in load_config(str(saved)).redis
    from pipeline.config import refuse_shard_urls

    monkeypatch.setenv("NONSTOP_REDIS_SHARD_URLS", "")
    refuse_shard_urls()  # empty: names nothing
    monkeypatch.setenv("NONSTOP_REDIS_SHARD_URLS_ACTOR", "rediss://h:1/0")
    with pytest.raises(ValueError, match="NONSTOP_REDIS_SHARD_URLS_ACTOR is set: independent"):
        refuse_shard_urls()


@pytest.mark.parametrize(
    "overrides, env, said",
    [
        (["redis.shards=2"], {}, f"error: redis.shards=2 with redis.mode=single: {MIGRATE_SHARDS}"),
        (
            ["redis.shard_urls=[redis://h:1/0]"],
            {},
            f"error: redis.shard_urls=[redis://h:1/0]: redis.shard_urls was removed: "
            f"{MIGRATE_SHARDS}",
        ),
        (
            [],
            {"NONSTOP_REDIS_SHARD_URLS": "redis://h:1/0"},
            f"error: NONSTOP_REDIS_SHARD_URLS is set: {MIGRATE_SHARDS}; unset it",
        ),
    ],
    ids=["shards", "shard_urls", "env"],
)
def test_the_launcher_refuses_independent_shards_in_one_line(tmp_path, overrides, env, said):
    run_dir = tmp_path / "run"
    code, out = run_tiny(tmp_path, run_dir, *overrides, env_extra=env, timeout=120)
    assert code == 2, out
    assert said in out.splitlines(), out
    assert "Traceback" not in out
    assert not run_dir.exists()  # refused before anything started


def test_an_experiment_file_with_shard_urls_is_refused(tmp_path):
    """An experiment file of the user's own (hydra.searchpath) that sets redis.shard_urls:
    Hydra alone would say only that the key is not in the schema."""
    (tmp_path / "conf" / "mine").mkdir(parents=True)
    (tmp_path / "conf" / "mine" / "old.yaml").write_text(
        "# @package _global_\nredis:\n  shard_urls: [redis://h:1/0]\n"
    )
    search = f"hydra.searchpath=[file://{tmp_path / 'conf'}]"
    code, out = run_tiny(tmp_path, tmp_path / "run", search, "+mine=old", timeout=120)
    assert code == 2, out
    line = next(ln for ln in out.splitlines() if ln.startswith("error: "))
    assert "sets redis.shard_urls, which was removed: " + MIGRATE_SHARDS in line, line
    assert line.endswith("drop it from that file") and not (tmp_path / "run").exists()


def test_an_old_sharded_run_directory_is_refused(tmp_path):
    """A run directory an older version ran with independent shards: its checkpoints'
    positions name those instances' streams, so the launcher refuses to go on there."""
    from pipeline.launch import refuse_sharded_run_dir

    external = tmp_path / "external"  # redis.url and redis.shard_urls: only config.yaml says
    external.mkdir()
    (external / "config.yaml").write_text("redis:\n  shards: 2\n  shard_urls: [redis://h:1/0]\n")
    with pytest.raises(ValueError, match="config.yaml redis.shards=2"):
        refuse_sharded_run_dir(str(external))
    (external / "config.yaml").write_text("redis:\n  shards: 3\n  mode: cluster\n")
    refuse_sharded_run_dir(str(external))  # a cluster run's partitions: resumed
    run_dir = tmp_path / "run"  # the embedded launcher's shard servers
    (run_dir / "redis-shard1").mkdir(parents=True)
    code, out = run_tiny(tmp_path, run_dir, timeout=120)
    assert code == 2, out
    line = next(ln for ln in out.splitlines() if ln.startswith("error: "))
    assert f"{run_dir} is a run with independent-instance shards (redis-shard1)" in line
    assert MIGRATE_SHARDS in line and "finish it with the version that started it" in line
    assert not (run_dir / "config.yaml").exists()  # nothing written over


# ------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_tiny_pipeline_on_two_partitions_loses_nothing_and_resumes(cluster, tmp_path):
    """redis.mode=cluster with 2 partitions on a cluster of its own: produced = trained
    (+ in flight at the end), no group lost or trained twice, batches from both
    partitions trained; a relaunch resumes from the per-partition checkpoint position."""
    run_dir = tmp_path / "run"
    on = ("redis.mode=cluster", f"redis.url='{cluster.url}'", "redis.shards=2")
    code, out = run_tiny(tmp_path, run_dir, *on, "trainer.max_steps=4", timeout=400)
    assert code == 0, out[-3000:]
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
    names = Names("nonstop", "tiny", cluster=True)
    client = connect(cluster.url)
    try:  # both partitions carried rollouts, each in its own slot
        assert all(client.exists(names.part(k).rollouts) for k in range(2))
    finally:
        client.close()

    code, out = run_tiny(tmp_path, run_dir, *on, "trainer.max_steps=6", timeout=400)
    assert code == 0, out[-3000:]
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["trainer_steps"] == 6
    assert acc["groups_lost"] == 0 and acc["groups_duplicated"] == 0, acc
