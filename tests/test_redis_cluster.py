"""redis.mode=cluster on real redis-servers on loopback (pipeline/topology/cluster.py,
pipeline/streams/cluster.py): 3 primaries with a replica each; the work streams in
hash-tagged partitions and the control keys in a slot of their own, so every Lua script
runs in one slot; bad cluster URLs fail in one line; the cluster client follows a
failover (SIGKILL of a primary and its data directory deleted) with no restart; the
tiny pipeline runs end to end on redis=cluster, and through the loss of a primary
mid-run with 0 groups lost and 0 duplicated by the independent account."""

import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import redis
from omegaconf import OmegaConf
from redis.exceptions import RedisClusterException

from actor.journal import Journal
from pipeline.config import Config, min_replicas_acked, validate
from pipeline.messages import (
    SCHEMA_VERSION,
    EpisodeDelta,
    pack_f32,
    pack_i32,
    pack_u8,
    rle_encode,
)
from pipeline.redisd.server import EmbeddedRedis, free_port
from pipeline.streams import (
    Names,
    RedisRefused,
    RedisUnavailable,
    connect,
    counters,
    durable,
    ensure_group,
    publish,
    wait_until,
)
from pipeline.streams.cluster import parse, silent
from pipeline.streams.durable import Durability, Lua, NotReplicated, attach
from pipeline.tasks import Problem
from pipeline.topology.cluster import LocalCluster, bus_port
from tests.launching import ROOT, launch_tiny, run_tiny
from tests.redis_builders import WatchRounds, interrupted_start, pool_start_line
from trainer.weight_publisher import set_rendezvous

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")

NAMES = Names("nonstop", "t", cluster=True)
PARTITIONS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = LocalCluster(str(tmp_path_factory.mktemp("cluster")))
    local.start()
    yield local
    local.stop()


@pytest.fixture
def cclient(cluster):
    client = connect(cluster.url, reconnect_s=30)
    yield client
    client.close()


def test_cluster_urls_parse_and_hide_the_password():
    p = parse("redis+cluster://u:s3cret@h1:7000,h2:7001,h3/")
    assert p.nodes == [("h1", 7000), ("h2", 7001), ("h3", 6379)]
    assert (p.username, p.password) == ("u", "s3cret")
    assert "s3cret" not in p.shown() and p.shown() == "redis+cluster://***@h1:7000,h2:7001,h3:6379/"
    for bad, said in [
        ("redis+cluster:///", "give at least one node"),
        ("redis+cluster://h1:x/", "bad cluster node address"),
        ("redis+cluster://:pw@h1:1/0", "a cluster has one database"),
        ("redis://h1:1/0", "not a cluster URL"),
    ]:
        with pytest.raises(ValueError, match=said) as e:
            parse(bad)
        assert "pw" not in str(e.value)
    tls = parse("rediss+cluster://:pw@h1:1/")  # TLS: pipeline/redisd/tls.py
    assert tls.tls and tls.shown() == "rediss+cluster://***@h1:1/"
    assert not p.tls and p.ssl_kwargs() == {}


def test_cluster_mode_is_validated():
    cfg = OmegaConf.structured(Config)
    for url, overrides, said in [
        ("redis://h:1/0", {}, "redis.mode=cluster needs redis.url=redis\\[s\\]\\+cluster"),
        (None, {"min_replicas_acked": -1}, "must be an integer >= 0"),
    ]:
        bad = cfg.copy()
        bad.redis.mode, bad.redis.url = "cluster", url
        for k, v in overrides.items():
            bad.redis[k] = v
        with pytest.raises(ValueError, match=said):
            validate(bad)
    single = cfg.copy()
    single.redis.url = "redis+cluster://h:1/"
    with pytest.raises(ValueError, match="redis.mode=single: set redis.mode=cluster"):
        validate(single)
    braces = cfg.copy()
    braces.redis.mode, braces.run.name = "cluster", "a{b}"
    with pytest.raises(ValueError, match="may not contain"):
        validate(braces)
    ok = cfg.copy()
    ok.redis.mode, ok.redis.shards = "cluster", 3
    validate(ok)
    assert min_replicas_acked(ok) == 1  # WAIT 1 behind work writes unless set
    assert Names.of(ok).samples_produced == f"{ok.redis.prefix}:{{{ok.run.name}}}:samples_produced"


def test_names_put_each_partition_and_the_control_keys_in_one_slot(cluster, cclient):
    """Partition k's work streams and their once keys: one slot per partition; every
    control key: the run's slot; single mode names are unchanged."""
    control = [
        NAMES.run_marker,
        NAMES.trainer_version,
        NAMES.published_version,
        NAMES.samples_produced,
        NAMES.samples_retired,
        NAMES.retired_recent,
        NAMES.rendezvous,
        NAMES.sync_claims,
        NAMES.faults_probe,
        NAMES.status("actor-0"),
        NAMES.weights,
        NAMES.joins,
        NAMES.dead,
    ]
    assert {cclient.keyslot(k) for k in control} == {cclient.keyslot("{t}")}
    slots = set()
    for k in range(PARTITIONS):
        part = NAMES.part(k)
        work = [part.rollouts, part.rollouts_once, part.batches, part.batches_once]
        work += [f"{part.rollouts_once}:order", f"{part.batches_once}:order"]
        assert {cclient.keyslot(key) for key in work} == {cclient.keyslot(f"{{t.p{k}}}")}
        assert part.rollouts == f"nonstop:{{t.p{k}}}:rollouts" and part.dead == NAMES.dead
        slots.add(cclient.keyslot(part.rollouts))
    assert len(slots) == PARTITIONS
    assert Names("nonstop", "t").part(2).rollouts == "nonstop:t:rollouts"


SCRIPT_MODULES = (
    "pipeline.streams.durable",
    "pipeline.streams.counters",
    "actor.room",
    "trainer.main",
    "trainer.weight_publisher",
    "actor.journal",
)


def _every_script() -> dict[str, Lua]:
    """Every Lua script the pools run: those of SCRIPT_MODULES, and no module of the
    code defines one elsewhere (a new script's module must be added here)."""
    defining = set()
    for top in ("pipeline", "actor", "preprocessor", "trainer"):
        for path in (ROOT / top).rglob("*.py"):
            if re.search(r"^\w+ = Lua\(", path.read_text(), re.MULTILINE):
                defining.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    assert defining == set(SCRIPT_MODULES), defining
    found = {}
    for name in SCRIPT_MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if isinstance(value, Lua):
                found[f"{name}.{attr}"] = value
    return found


def test_every_script_runs_in_one_slot(cluster, cclient, monkeypatch):
    """The pools' writes on the cluster, through the functions they call, on every
    partition; each Lua script's keys fall in one slot (recorded at every call), every
    script is run, and the cluster stores what they wrote. A script given keys of two
    slots is refused: the check can fail."""
    scripts = _every_script()
    assert len(scripts) == 13, scripts
    calls: dict[str, list[list[str]]] = {name: [] for name in scripts}
    original = Lua.__call__

    def recording(self, client, keys, args, what=""):
        name = next(n for n, s in scripts.items() if s is self)
        calls[name].append(list(keys))
        return original(self, client, keys, args, what)

    monkeypatch.setattr(Lua, "__call__", recording)
    for k in range(PARTITIONS):
        part = NAMES.part(k)
        for stream, token in ((part.rollouts, f"g{k}"), (part.batches, f"b{k}")):
            first = publish(cclient, stream, b"x", token=token, group=token)
            assert publish(cclient, stream, b"x", token=token, group=token) == first  # once
            cclient.xgroup_create(stream, "g", id="0")
            cclient.xreadgroup("g", "c", {stream: ">"}, count=10)
            assert durable.xack(cclient, stream, "g", [first]) == 1
            assert cclient.xlen(stream) == 1
    assert counters.count_produced(cclient, NAMES, "actor-0", "g0", 4)
    assert not counters.count_produced(cclient, NAMES, "actor-0", "g0", 4)  # once
    assert counters.retire_groups(cclient, NAMES, [("g1", 4), ("g2", 4)]) == 8
    assert counters.add_once(
        cclient, NAMES.samples_retired, NAMES.status("trainer"), "s", "1", 4, {}
    )
    assert int(cclient.get(NAMES.samples_produced)) == 4
    assert int(cclient.get(NAMES.samples_retired)) == 12
    # the trainer's undo of retirements and the sync actors' claim, with the keys and
    # arguments their callers build (trainer/main.py _undo_retired, actor/room.py _call);
    # the claim also reads two keys it does not declare (ARGV), in the same slot
    undo, claim = scripts["trainer.main._UNDO_RETIRED"], scripts["actor.room._CLAIM"]
    trainer = NAMES.status("trainer")
    assert int(undo(cclient, [NAMES.samples_retired, trainer], ["retired_by_trainer", 0])) == 0
    now = time.time()
    args = ["actor-0", 8, 8, now, now + 30, 4, 0, 0, NAMES.samples_retired, NAMES.trainer_version]
    assert int(claim(cclient, [NAMES.samples_produced, NAMES.sync_claims], args)) == 8
    # the weight publisher's rendezvous, replaced whole (one key: the rendezvous hash)
    cclient.hset(NAMES.rendezvous, "old", "x")
    set_rendezvous(cclient, NAMES, {"epoch": "e", "port": 1})
    assert cclient.hgetall(NAMES.rendezvous) == {b"epoch": b"e", b"port": b"1"}
    # the episode journal (actor/journal.py): a group opened, a turn of each episode
    # written (a delta each), the lease renewed, the group taken over by another actor
    # once it ran out, one episode's deltas forgotten (it restarts), then done
    first = Journal(cclient, NAMES, "actor-0", 0.3)
    first.open("actor-0:g", Problem(id="p", question="q", answer="1"), [1, 2], 2)
    for k in range(2):  # one turn of each episode: 2 sampled ids, 1 observation id
        delta = EpisodeDelta(
            schema=SCHEMA_VERSION,
            index=k,
            seq=0,
            turns=1,
            ids=pack_i32([5, 6, 7]),
            mask=pack_u8([1, 1, 0]),
            logprobs=pack_f32([-0.5, -0.5]),
            versions=rle_encode([0, 0]),
            offsets=pack_i32([0]),
        )
        assert first.write("actor-0:g", delta)
    assert wait_until(lambda: calls["actor.journal._RENEW"], 5)  # a renewal round
    first.close()
    time.sleep(0.4)  # its lease runs out
    other = Journal(cclient, NAMES, "actor-1", 30.0)
    taken = other.take_over()
    assert taken is not None and taken.states[0].turns == 1 and taken.refused == {}
    assert other.forget("actor-0:g", taken.fields[1])  # episode 1 restarts: its deltas go
    assert sorted(cclient.hgetall(NAMES.episode("actor-0:g"))) == [b"0:0", b"open"]
    other.done("actor-0:g")
    # a group a dead actor left with an unreadable ``open`` field: dead-lettered whole
    # (its raw fields into <run>:dead, XADD-once on the group id), hash and claim gone
    cclient.hset(NAMES.episode_claims, "actor-9:bad", "actor-9/dead 0")
    cclient.hset(NAMES.episode("actor-9:bad"), mapping={"open": b"\x93garbage"})
    assert other.take_over() is None
    assert cclient.xlen(NAMES.dead) == 1 and not cclient.exists(NAMES.episode("actor-9:bad"))
    other.close()
    assert cclient.hgetall(NAMES.episode_claims) == {}
    for name, keysets in calls.items():
        assert keysets, f"{name} was never run"
        for keys in keysets:
            assert len({cclient.keyslot(key) for key in keys}) == 1, (name, keys)
    # keys of two slots: the client refuses before the server would (CROSSSLOT)
    xadd_once = scripts["pipeline.streams.durable._XADD_ONCE"]
    crossed = [NAMES.part(0).rollouts, NAMES.part(1).rollouts_once, "x:order"]
    with pytest.raises(RedisClusterException, match="same key slot"):
        original(xadd_once, cclient, crossed, ["t", 10, "data", "x"])
    node = cclient.get_redis_connection(cclient.get_node_from_key(crossed[0]))
    with pytest.raises(redis.ResponseError, match="don.t hash to the same slot"):  # CROSSSLOT
        node.eval(xadd_once.source, 3, *crossed, "t", 10, "data", "x")


def test_bad_cluster_urls_fail_in_one_line(cluster, redis_server, tmp_path):
    """No node answers; a wrong password; a node that is not in cluster mode; a cluster
    with slots uncovered: one line each, within the start-up deadline."""
    dead = f"redis+cluster://:pw@127.0.0.1:{free_port()},127.0.0.1:{free_port()}/"
    t = time.monotonic()
    with pytest.raises(RedisUnavailable, match="no node of the redis cluster") as e:
        connect(dead, startup_s=1.5)
    assert "pw" not in str(e.value) and "\n" not in str(e.value)
    assert time.monotonic() - t < 10
    wrong = cluster.url.replace(cluster.password, "wrong")
    with pytest.raises(RedisRefused, match="refused the credentials") as e:
        connect(wrong, startup_s=2)
    assert cluster.password not in str(e.value) and "wrong" not in str(e.value)
    plain = f"redis+cluster://:{redis_server.password}@127.0.0.1:{redis_server.port}/"
    with pytest.raises(RedisRefused, match="is not a cluster node"):
        connect(plain, startup_s=2)
    # a cluster node that serves no slot: cluster_state:fail, 16384 slots uncovered
    lone = EmbeddedRedis(str(tmp_path / "lone"), port=bus_port())
    lone.extra_args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
    lone.start()
    try:
        bare = f"redis+cluster://:{lone.password}@127.0.0.1:{lone.port}/"
        t = time.monotonic()
        with pytest.raises(RedisUnavailable, match="16384 uncovered") as e:
            connect(bare, startup_s=1.5)
        assert "cluster_state:fail" in str(e.value) and "\n" not in str(e.value)
        assert time.monotonic() - t < 10
    finally:
        lone.stop()
    # and from the command line: a pool's one line, exit 2, no traceback
    out = pool_start_line(dead)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr
    assert out.stdout.count("\n") == 1 and "cluster-enabled yes" in out.stdout


def test_failover_keeps_the_same_client_writing(tmp_path):
    """SIGKILL the primary serving a partition and delete its data: its replica is
    promoted within cluster-node-timeout and an election, the supervisor's rounds bring
    the lost node back, empty, as the promoted node's replica, and the client made
    before the kill carries on; its writes wait for a replica (WAIT 1 on the slot's
    primary, durable.py), so every write it saw acknowledged is there. With its replica
    gone for good, a write is not counted: NotReplicated."""
    local = LocalCluster(str(tmp_path / "cluster"))
    local.start()
    try:
        client = attach(connect(local.url, reconnect_s=60), Durability(1, 1000, 60.0))
        stream = NAMES.part(0).rollouts
        for i in range(20):
            publish(client, stream, b"x", token=f"g{i}", i=i)
        node = client.get_node_from_key(stream)
        k = next(i for i, n in enumerate(local.nodes) if n.port == node.port)
        replica = next(r for r, p in local.replica_of.items() if p == k)
        victim = local.nodes[k]
        lost_control = next(
            names
            for names in (Names("nonstop", f"r{i}", cluster=True) for i in range(10_000))
            if client.get_node_from_key(names.rendezvous).port == victim.port
        )
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        shutil.rmtree(victim.data_dir)
        killed = time.monotonic()
        lines: list[str] = []
        watcher = WatchRounds(local, lines)  # the supervisor's rounds, as the launcher runs them
        try:
            # a trainer starting now: its rendezvous (a run whose control slot the lost
            # primary served) waits out the failover (a MULTI failed at once)
            set_rendezvous(client, lost_control, {"epoch": "e"})
            publish(client, stream, b"x", token="g20", i=20)  # waits for the new replica
            first_write_s = time.monotonic() - killed
        finally:
            watcher.stop()
        assert client.hgetall(lost_control.rendezvous) == {b"epoch": b"e"}
        print(f"\nkill to first write on the promoted replica, WAIT 1: {first_write_s:.2f} s")
        assert client.get_node_from_key(stream).port == local.nodes[replica].port
        assert [int(f[b"i"]) for _, f in client.xrange(stream)] == list(range(21))
        assert any(f"node-{k}" in line and "exited with -9" in line for line in lines), lines
        assert any(f"promoted node-{replica}" in line for line in lines), lines
        assert any(f"restarting node-{k}" in line for line in lines), lines
        # the lost node is back, empty, as the promoted node's replica, with the data
        assert local.replica_of[k] == replica and not local.down_since
        role = local.node_client(victim).execute_command("ROLE")
        assert role[0] == b"slave" and role[2] == local.nodes[replica].port
        _wait(lambda: local.not_ready() is None, 20, local.not_ready)
        assert len(local.node_client(victim).execute_command("CLUSTER NODES")) == 6  # old id gone
        reader = local.node_client(victim)
        reader.execute_command("READONLY")  # a replica answers reads of its slots
        assert reader.xlen(stream) == 21
        assert first_write_s < 30
        # its replica gone (and not brought back): a write is never counted as safe
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        impatient = attach(connect(local.url, reconnect_s=5), Durability(1, 300, 1.5))
        with pytest.raises(NotReplicated, match="WAIT saw 0 of the 1 replica"):
            publish(impatient, stream, b"x", token="g21", i=21)
        # the launcher's summary asks first whether the cluster answers (summary.silent)
        assert silent(client, 1.0) is None  # every primary answers (a replica is gone)
    finally:
        local.stop()
    t = time.monotonic()
    why = silent(client, 1.0)  # every node gone: the summary is written from disk
    assert why and time.monotonic() - t < 10, why


@pytest.mark.slow
def test_tiny_pipeline_on_redis_cluster(tmp_path):
    """The launcher starts the cluster, the pools run on it, every partition is read,
    and the account finds nothing lost or duplicated."""
    run_dir = tmp_path / "run"
    code, out = run_tiny(tmp_path, run_dir, "redis=cluster", timeout=400)
    assert code == 0, out[-3000:]
    assert "local redis cluster on 127.0.0.1" in out and "3 partition(s)" in out
    url_file = run_dir / "redis" / "url"
    assert url_file.read_text().startswith("redis+cluster://")
    assert oct(url_file.stat().st_mode)[-3:] == "600"
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["outcome"] == "finished" and summary["trainer_steps"] == 4
    assert acc["groups_lost"] == 0 and acc["groups_duplicated"] == 0, acc
    assert acc["groups_produced"] == (
        acc["groups_trained"] + acc["groups_in_flight_at_end"] + acc["groups_stale"]
    ), acc
    state = json.loads((run_dir / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    positions = state["entry_id"].split(",")  # one read position per partition, each read
    assert len(positions) == PARTITIONS and "0-0" not in positions, state["entry_id"]
    ports = [int(p) for p in re.findall(r"node-\d+ :(\d+)", out)]
    assert len(ports) == 6, out[:2000]
    for port in ports:  # the launcher stopped every node
        with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
            sock.connect(("127.0.0.1", port))


@pytest.mark.slow
def test_tiny_pipeline_on_an_external_redis_cluster(tmp_path):
    """A cluster the operator runs (redis.mode=cluster, its redis+cluster:// URL in
    NONSTOP_REDIS_URL): the launcher starts no Redis, the pools run on the cluster's
    partitions, the account finds nothing lost or duplicated, and the cluster is left
    running with the run's streams on it."""
    local = LocalCluster(str(tmp_path / "cluster"))
    local.start()
    try:
        run_dir = tmp_path / "run"
        code, out = run_tiny(
            tmp_path,
            run_dir,
            "redis.mode=cluster",
            f"redis.shards={PARTITIONS}",
            env_extra={"NONSTOP_REDIS_URL": local.url},
            timeout=400,
        )
        assert code == 0, out[-3000:]
        assert "local redis cluster" not in out and local.password not in out
        summary = json.loads((run_dir / "summary.json").read_text())
        acc = summary["accounting"]
        assert summary["outcome"] == "finished" and summary["trainer_steps"] == 4
        assert acc["groups_lost"] == 0 and acc["groups_duplicated"] == 0, acc
        client = connect(local.url, reconnect_s=5)
        names = Names.of(OmegaConf.load(run_dir / "config.yaml"))  # the run's hash tags
        nodes = {client.get_node_from_key(names.part(k).rollouts).port for k in range(PARTITIONS)}
        assert len(nodes) >= 2, nodes  # the partitions are on different primaries
        assert client.exists(names.run_marker)  # the run is still on the cluster
        assert int(client.get(names.samples_produced)) >= summary["trainer_steps"]
    finally:
        local.stop()


@pytest.mark.slow
def test_a_partition_moved_mid_run_loses_and_duplicates_nothing(tmp_path):
    """The tiny pipeline on a cluster of the operator's; once groups flow, partition 1
    moves to another primary (python -m pipeline.topology.cluster_move, as an operator runs
    it) under the running pools: the run finishes, nothing lost or trained twice."""
    local = LocalCluster(str(tmp_path / "cluster"))
    local.start()
    try:
        run_dir = tmp_path / "run"
        proc = launch_tiny(
            tmp_path,
            run_dir,
            "redis.mode=cluster",
            f"redis.shards={PARTITIONS}",
            "trainer.max_steps=8",
            env_extra={"NONSTOP_REDIS_URL": local.url},
        )
        client = connect(local.url, reconnect_s=5)
        _wait(lambda: (run_dir / "config.yaml").exists(), 120)
        names = Names.of(OmegaConf.load(run_dir / "config.yaml"))
        _wait(lambda: int(client.get(names.samples_produced) or 0) > 0, 300)
        stream = names.part(1).rollouts
        source = client.get_node_from_key(stream).name
        to = next(n.name for n in client.get_primaries() if n.name != source)
        move = subprocess.run(
            [sys.executable, "-m", "pipeline.topology.cluster_move", "--run", names.run]
            + ["--partition", "1", "--to", to],
            env=dict(os.environ, NONSTOP_REDIS_URL=local.url),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert move.returncode == 0, move.stderr
        produced_at_move = client.get(names.samples_produced)
        out, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, out[-3000:]
        assert f"moved from {source} to {to}" in move.stdout
        summary = json.loads((run_dir / "summary.json").read_text())
        acc = summary["accounting"]
        assert summary["outcome"] == "finished" and summary["trainer_steps"] == 8
        assert acc["groups_lost"] == 0 and acc["groups_duplicated"] == 0, acc
        client.nodes_manager.initialize()  # the slot map now
        assert client.get_node_from_key(names.part(1).batches).name == to
        assert int(client.get(names.samples_produced)) > int(produced_at_move)
    finally:
        local.stop()


@pytest.mark.slow
def test_cluster_primary_loss_mid_run_loses_and_duplicates_nothing(tmp_path):
    """pipeline.bench faults cluster_primary_loss on a redis=cluster run: SIGKILL the
    primary of the control keys' slot and delete its data directory mid-run; its replica
    is promoted, every pool carries on without a restart, and the account finds 0 groups
    lost, 0 duplicated."""
    from tests.fault_runs import check_account, run_faults_bench

    proc, result, run_dir = run_faults_bench(
        tmp_path, "--faults", "cluster_primary_loss", "--set", "redis=cluster"
    )
    (fault,) = result["faults"]
    assert fault["name"] == "cluster_primary_loss"
    assert fault["effect"]["new_port"] != fault["port"]
    print(
        f"\ncluster_primary_loss: kill to first write on the promoted replica "
        f"{fault['first_write_s']} s, to the first one WAIT confirmed "
        f"{fault['first_durable_write_s']} s (partitions on the lost primary: "
        f"{fault['partitions_there']})"
    )
    assert fault["first_durable_write_s"] >= fault["first_write_s"]
    terms = check_account(result, run_dir)
    assert terms["groups_lost"] == 0 and result["groups_duplicated"] == 0
    assert not [k for k in result["restarts"] if not k.startswith("redis-node")], result["restarts"]
    assert result["passed"] and proc.returncode == 0, proc.stdout[-3000:]
    out = (run_dir / "launcher.out").read_text()
    assert "redis cluster promoted node-" in out, out[-3000:]


def test_inspect_shows_every_partition(cluster, cclient, capsys):
    """pipeline.inspect on a cluster URL: the run's hash-tagged status keys found,
    partition 0 as the plain rows, partitions 1.. each with its slot and node, and the
    totals over every partition summed per consumer group."""
    from pipeline.inspect.cli import main
    from pipeline.inspect.target import discover_runs

    names = Names("nonstop", "seen", cluster=True)
    cclient.hset(names.status("actor-0"), mapping={"role": "actor", "heartbeat": time.time()})
    for k in range(PARTITIONS):
        ensure_group(cclient, names.part(k).rollouts, "preprocessor")
        for i in range(k + 1):
            publish(cclient, names.part(k).rollouts, b"x", token=f"p{k}-{i}")
        # one read of each partition: pending 1 there, the rest lag
        cclient.xreadgroup("preprocessor", "p-0", {names.part(k).rollouts: ">"}, count=1)
    assert ("nonstop", "seen") in discover_runs(cclient)
    assert main(["--url", cluster.url, "--run", "seen", "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["run"] == "nonstop:{seen}"
    assert snap["streams"]["rollouts"]["length"] == 1
    assert [s["streams"]["rollouts"]["length"] for s in snap["shards"]] == [2, 3]
    for k, shard in enumerate(snap["shards"], start=1):
        node = cclient.get_node_from_key(names.part(k).rollouts).name
        assert shard["url"] == (
            f"partition {k}, slot {cclient.keyslot(names.part(k).rollouts)} on {node}"
        )
    totals = snap["work_totals"]["rollouts"]  # summed over the partitions per group
    assert totals["length"] == 6
    assert totals["groups"]["preprocessor"] == {"lag": 3, "pending": 3}
    # the replication state: every primary with its slots, each replica's lag in bytes
    rep = snap["replication"]
    roles = cluster.roles()
    primaries = {
        f"127.0.0.1:{n.port}" for k, n in enumerate(cluster.nodes) if roles[k] == "primary"
    }
    assert {p["address"] for p in rep["primaries"]} == primaries, rep
    slots = sorted(r for p in rep["primaries"] for r in p["slots"])
    assert sum(int(b) - int(a) + 1 for a, b in (r.split("-") for r in slots)) == 16384, slots
    for p in rep["primaries"]:
        assert p["error"] is None and p["role"] == "master", p
        [replica] = p["replicas"]
        assert replica["state"] == "online" and replica["lag_bytes"] >= 0, replica
    assert main(["--url", cluster.url, "--run", "seen"]) == 0
    text = capsys.readouterr().out
    assert "rollouts@shard2" in text and "the rows without @ are partition 0" in text
    assert "rollouts over 3 partitions: length 6; preprocessor lag 3 pending 3" in text, text
    assert "replication (cluster): 3 primaries" in text
    assert text.count("    replica 127.0.0.1:") == 3 and " bytes" in text, text


def _wait(check, timeout, why=lambda: ""):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, why()
        time.sleep(0.1)


def test_a_partition_moves_to_another_primary_under_a_writer_and_a_reader(tmp_path, capsys):
    """python -m pipeline.topology.cluster_move moves partition 1 (one slot) to another
    primary while a client keeps publishing to it through the durable path (WAIT 1):
    every acknowledged write is there once, in order; the consumer group moved with the
    stream (its pending entries and its position); the XADD-once keys moved too (a
    re-sent group is not written again). Bad targets: one line, exit 2."""
    import threading

    from pipeline.topology.cluster_move import main as move
    from pipeline.topology.cluster_move import move_slot

    local = LocalCluster(str(tmp_path / "cluster"))
    local.start()
    try:
        client = attach(connect(local.url, reconnect_s=30), Durability(1, 1000, 30.0))
        stream = NAMES.part(1).rollouts
        client.xgroup_create(stream, "g", id="0", mkstream=True)
        first = publish(client, stream, b"x", token="t0", i=0)
        for i in range(1, 30):
            publish(client, stream, b"x", token=f"t{i}", i=i)
        assert len(client.xreadgroup("g", "c", {stream: ">"}, count=10)[0][1]) == 10
        source = client.get_node_from_key(stream).name
        to = next(n.name for n in client.get_primaries() if n.name != source)
        acked: list[int] = []
        stop = threading.Event()

        def writer():
            w = attach(connect(local.url, reconnect_s=30), Durability(1, 1000, 30.0))
            i = 30
            while not stop.is_set():
                publish(w, stream, b"x", token=f"t{i}", i=i)
                acked.append(i)
                i += 1

        pause = lambda _n: time.sleep(0.3)  # noqa: E731
        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        _wait(lambda: len(acked) >= 20, 30)
        # one key at a time, 0.3 s apart: the writer's script meets the slot half moved
        # (TRYAGAIN: its keys split between the nodes; ASK: moved) and is sent again
        moved = move_slot(client, client.keyslot(stream), to, batch=1, on_batch=pause)
        assert moved == (source, 3)  # the stream, its once hash and its order list
        during = len(acked)
        _wait(lambda: len(acked) >= during + 20, 30)  # the writer goes on after the move
        stop.set()
        thread.join(30)
        assert [int(f[b"i"]) for _, f in client.xrange(stream)] == list(range(30)) + acked
        assert client.get_node_from_key(stream).name == to  # (the XRANGE's MOVED told it)
        assert client.xpending(stream, "g")["pending"] == 10
        rest = client.xreadgroup("g", "c", {stream: ">"}, count=10_000)
        assert len(rest[0][1]) == 20 + len(acked)
        assert publish(client, stream, b"x", token="t0", i=0) == first  # once, after a move
        assert client.xlen(stream) == 30 + len(acked)
        # the command moves it back (every key at once), and says so
        assert move(["--url", local.url, "--run", "t", "--partition", "1", "--to", source]) == 0
        out = capsys.readouterr().out
        assert f"partition 1 of nonstop:t (slot {client.keyslot(stream)}): moved from" in out
        assert client.xlen(stream) == 30 + len(acked)
        assert client.get_node_from_key(stream).name == source
        # bad input: one line each, exit 2
        assert move(["--url", local.url, "--run", "t", "--partition", "1", "--to", source]) == 2
        assert "is on" in capsys.readouterr().err
        assert move(["--url", local.url, "--run", "t", "--partition", "1", "--to", "h:1"]) == 2
        assert "is not a primary of this cluster" in capsys.readouterr().err
    finally:
        stop.set()
        local.stop()


def test_a_node_that_cannot_start_leaves_no_other_node_running(tmp_path):
    """One node's port taken by a socket that never answers: start() fails, and the nodes
    it had started are stopped with it (a full-suite run once left three behind)."""
    local = LocalCluster(str(tmp_path / "redis"), "everysec")
    blocker = socket.create_server(("127.0.0.1", local.nodes[3].port))
    try:
        with pytest.raises((RuntimeError, redis.RedisError)):
            local.start(timeout_s=30)
    finally:
        blocker.close()
    started = [n for n in local.nodes[:3] if n.proc is not None]
    assert len(started) == 3 and all(n.proc.poll() is not None for n in started)


def test_a_node_that_create_left_without_a_primary_is_adopted(tmp_path, caplog):
    """``redis-cli --cluster create`` ignores a failed CLUSTER REPLICATE (the node did not
    know its primary yet, twice): that node stays a primary without slots and the
    cluster is never whole (a loaded CI run waited 60 s on "2 of 3 replicas known").
    Made so here (CLUSTER RESET: the replica forgets every node and turns primary without
    slots); waiting for the cluster meets the primary it lacks and tells it to replicate
    it, and the cluster is whole again."""
    local = LocalCluster(str(tmp_path / "cluster"), "everysec")
    local.start()
    try:
        r = next(iter(local.replica_of))
        primary = local.replica_of[r]
        local.node_client(local.nodes[r]).execute_command("CLUSTER RESET", "SOFT")
        assert local.node_client(local.nodes[r]).info("replication")["role"] == "master"
        assert local.not_ready() is not None
        with caplog.at_level("WARNING", logger="pipeline.topology.cluster"):
            local.wait_ready(60)  # the start's own bound
        assert local.replica_of.get(r) == primary, local.replica_of
        assert len(local.replica_of) == 3
        assert f"left node-{r} a primary without slots" in caplog.text
    finally:
        local.stop()


@pytest.mark.parametrize("where", ["forming", "announcing"])
def test_an_interrupt_while_the_cluster_starts_leaves_no_node_running(tmp_path, monkeypatch, where):
    """Ctrl-C or SIGTERM (a KeyboardInterrupt in the launcher) while the cluster forms,
    or after it formed but before start_local_cluster returned it to the launcher (which
    stops what it holds): every node is stopped, none is left running."""
    from pipeline.topology import cluster as cluster_mod

    local = interrupted_start(
        monkeypatch, tmp_path, LocalCluster, cluster_mod, "start_local_cluster", where
    )
    ran = [n for n in local.nodes if n.proc is not None]
    assert len(ran) == len(local.nodes) and all(n.proc.poll() is not None for n in ran)
