"""Per-pool ACL users on a Redis Cluster (redis.mode=cluster), on real redis-servers on
loopback: a 6-node cluster (pipeline/topology/cluster.py LocalCluster) loading
deploy/redis/users.acl on every node; each role's user does its work on every partition
and on the control keys' slot and is refused what it must not do (as
tests/test_security.py on one Redis); the start-up probes name the node that refused;
the promoted replica of a failover has the same users; the tiny pipeline runs end to
end with every pool as its own user."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import redis
from omegaconf import OmegaConf

from pipeline.config import Config, validate
from pipeline.streams import Names, RedisRefused, check_permissions, connect, wait_until
from pipeline.streams.cluster import parse
from pipeline.streams.durable import Durability
from pipeline.topology.acl import ADMIN, per_run_users
from pipeline.topology.cluster import cluster_info
from tests.launching import ROOT, tiny_cache
from tests.redis_builders import acl_cluster, tiny_run_as_role_users
from trainer.weight_publisher import set_rendezvous

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")

NAMES = Names("nonstop", "t", cluster=True)
PARTITIONS = 3


@pytest.fixture(scope="module")
def acl(tmp_path_factory):
    local, urls = acl_cluster(tmp_path_factory.mktemp("aclcluster"))
    yield local, urls
    local.stop()


def _client(urls, role):
    return connect(urls[role], reconnect_s=5, startup_s=8)


def test_the_key_patterns_match_the_hash_tagged_names(acl):
    """users.acl's `<prefix>:*:<name>` patterns match `<prefix>:{<run>}:<name>` and
    `<prefix>:{<run>.p<k>}:<name>` (ACL DRYRUN on a node, as each role)."""
    local, _ = acl
    admin = local.node_client(local.nodes[0])
    for k in range(PARTITIONS):
        part = NAMES.part(k)
        for role, command, key in [
            ("actor", "XADD", part.rollouts),
            ("actor", "HSET", part.rollouts_once),
            ("preprocessor", "XADD", part.batches),
            ("preprocessor", "XACK", part.rollouts),
            ("trainer", "XACK", part.batches),
        ]:
            args = {"XADD": (key, "*", "f", "v"), "XACK": (key, "g", "0-1")}.get(
                command, (key, "f", "v")
            )
            assert admin.execute_command("ACL DRYRUN", role, command, *args) == b"OK", key
    for role, command, args in [
        ("actor", "INCRBY", (NAMES.samples_produced, "1")),
        ("trainer", "SET", (NAMES.trainer_version, "1")),
        ("preprocessor", "INCRBY", (NAMES.samples_retired, "1")),
    ]:
        assert admin.execute_command("ACL DRYRUN", role, command, *args) == b"OK", args
    refused = admin.execute_command(
        "ACL DRYRUN", "actor", "XADD", NAMES.part(1).batches, "*", "f", "v"
    )
    assert b"no permissions to access the" in refused, refused


def test_every_role_does_its_work_on_every_partition_and_no_more(acl):
    local, urls = acl
    clients = {r: _client(urls, r) for r in ("actor", "preprocessor", "trainer", "operator")}
    try:
        for role in ("actor", "preprocessor", "trainer"):  # the pools' start-up probes
            c = clients[role]
            check_permissions(c, NAMES, role, urls[role])
            for k in range(1, PARTITIONS):
                check_permissions(c, NAMES.part(k), role, urls[role], shard=True)
        actor, pre, trainer, op = (
            clients[r] for r in ("actor", "preprocessor", "trainer", "operator")
        )
        nodes = set()
        for k in range(PARTITIONS):
            part = NAMES.part(k)
            nodes.add(actor.get_node_from_key(part.rollouts).name)
            actor.xadd(part.rollouts, {"data": b"g"})
            pre.xgroup_create(part.rollouts, Names.ROLLOUTS_GROUP, id="0")
            got = pre.xreadgroup(Names.ROLLOUTS_GROUP, "p0", {part.rollouts: ">"}, count=10)
            ((entry_id, _),) = got[0][1]
            pre.xadd(part.batches, {"data": b"b"})
            assert pre.xack(part.rollouts, Names.ROLLOUTS_GROUP, entry_id) == 1
            trainer.xgroup_create(part.batches, Names.BATCHES_GROUP, id="0")
            got = trainer.xreadgroup(Names.BATCHES_GROUP, "t0", {part.batches: ">"}, count=10)
            ((batch_id, _),) = got[0][1]
            assert trainer.xack(part.batches, Names.BATCHES_GROUP, batch_id) == 1
            assert op.xlen(part.rollouts) == 1 and op.xlen(part.batches) == 1
        assert len(nodes) >= 2, nodes  # the partitions are on different primaries
        # the control keys' slot
        assert actor.incrby(NAMES.samples_produced, 4) == 4
        actor.hset(NAMES.status("actor-0"), "heartbeat", 1)
        pre.incrby(NAMES.samples_retired, 4)
        trainer.set(NAMES.trainer_version, 1)
        trainer.xadd(NAMES.weights, {"data": b"w"})
        assert actor.get(NAMES.trainer_version) == b"1"
        assert actor.xread({NAMES.weights: "0"}, count=1)[0][1]
        set_rendezvous(trainer, NAMES, {"epoch": 1, "port": 1})  # the publisher's script
        assert trainer.hgetall(NAMES.rendezvous) == {b"epoch": b"1", b"port": b"1"}
        assert op.hgetall(NAMES.status("actor-0")) == {b"heartbeat": b"1"}
        # refused, on whichever node serves the key
        for forbidden in (
            lambda: actor.flushall(),
            lambda: actor.config_get("requirepass"),
            lambda: actor.xadd(NAMES.part(1).batches, {"data": b"x"}),
            lambda: actor.set("other:key", 1),
            lambda: actor.keys("*"),
            lambda: actor.script_load("return 1"),
            lambda: actor.execute_command("CLUSTER NODES", target_nodes=actor.get_primaries()),
            lambda: actor.execute_command("CLUSTER FAILOVER", target_nodes=actor.get_primaries()),
            lambda: pre.set(NAMES.trainer_version, 9),
            lambda: pre.xadd(NAMES.weights, {"data": b"x"}),
            lambda: trainer.xadd(NAMES.part(2).rollouts, {"data": b"x"}),
            lambda: op.xadd(NAMES.part(0).rollouts, {"data": b"x"}),
            lambda: op.execute_command("CLUSTER RESET", target_nodes=op.get_primaries()),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
        with pytest.raises(RedisRefused, match="refused the credentials"):
            connect(urls["actor"].replace("pw-actor", "guess"), startup_s=2)
    finally:
        for c in clients.values():
            c.close()


def test_inspect_runs_as_the_operator_user(acl, capsys):
    """pipeline.inspect with the operator user (read-only: SCAN, XINFO, ...) finds the run
    by its hash-tagged keys on every node and reads every partition."""
    from pipeline.inspect.cli import main

    _, urls = acl
    names = Names("nonstop", "seen", cluster=True)
    actor = _client(urls, "actor")
    actor.hset(names.status("actor-0"), mapping={"role": "actor", "heartbeat": time.time()})
    for k in range(PARTITIONS):
        actor.xadd(names.part(k).rollouts, {"data": b"x"})
    actor.close()
    assert main(["--url", urls["operator"], "--run", "seen", "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["run"] == "nonstop:{seen}"
    assert [s["streams"]["rollouts"]["length"] for s in snap["shards"]] == [1, 1]


def test_a_missing_grant_is_named_with_the_node_that_refused(tmp_path):
    """A user without +xadd: the pool's start-up probe names XADD, the partition's key,
    the cluster node serving it and users.acl; a user without +cluster|slots cannot even
    learn the slot map (why users.acl grants it)."""
    local, urls = acl_cluster(tmp_path, drop=" +xadd", role="actor")
    try:
        actor = _client(urls, "actor")
        with pytest.raises(RedisRefused) as e:
            check_permissions(actor, NAMES.part(2), "actor", urls["actor"], shard=True)
        msg = str(e.value)
        node = actor.get_node_from_key(NAMES.part(2).rollouts).name
        assert "XADD" in msg and NAMES.part(2).rollouts in msg and f"cluster node {node})" in msg, (
            msg
        )
        assert "users.acl" in msg and "pw-actor" not in msg, msg
        # no +cluster|slots: redis-py's cluster client cannot start
        admin = local.node_client(local.nodes[0])
        for n in local.nodes:
            local.node_client(n).acl_setuser("actor", enabled=True, commands=["-cluster|slots"])
        assert admin.acl_dryrun("actor", "CLUSTER", "SLOTS") != b"OK"
        with pytest.raises(RedisRefused) as e:  # one line, at once (not after startup_s)
            connect(urls["actor"], startup_s=8, reconnect_s=1)
        msg = str(e.value)
        assert "CLUSTER SLOTS" in msg and "+cluster|slots" in msg and "users.acl" in msg, msg
        assert "pw-actor" not in msg, msg
    finally:
        local.stop()


def test_a_promoted_replica_has_the_same_users(tmp_path):
    """SIGKILL the primary serving the control keys and delete its data directory: the
    replica promoted in its place refuses and grants as the primary did, the actor's
    client (made before the kill) goes on writing, and the lost node, back empty as a
    replica, loads the users again."""
    local, urls = acl_cluster(tmp_path)
    try:
        actor = connect(urls["actor"], reconnect_s=30)  # a failover under load: seconds
        key = NAMES.samples_produced
        # as a pool counts (durable.py): the count is the replica's too before the kill;
        # a bare INCRBY could be lost with the primary (asynchronous replication)
        Durability(replicas=1).write(actor, "the count", lambda p, c: p.incrby(key, 1), key=key)
        node = actor.get_node_from_key(NAMES.samples_produced)
        k = next(i for i, n in enumerate(local.nodes) if n.port == node.port)
        replica = next(r for r, p in local.replica_of.items() if p == k)
        victim = local.nodes[k]
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        shutil.rmtree(victim.data_dir)
        assert actor.incrby(NAMES.samples_produced, 1) == 2  # follows the failover
        assert actor.get_node_from_key(NAMES.samples_produced).port == local.nodes[replica].port
        with pytest.raises(redis.exceptions.NoPermissionError):
            actor.set(NAMES.trainer_version, 5)  # on the promoted node: still the actor's rules
        lines: list[str] = []
        deadline = time.monotonic() + 30
        while local.down_since or not lines:
            assert time.monotonic() < deadline, lines
            local.watch(lines.append, lambda *a, **kw: None)
            time.sleep(0.2)
        assert any(f"restarting node-{k}" in line for line in lines), lines
        back = redis.Redis(
            host="127.0.0.1", port=victim.port, username="actor", password="pw-actor"
        )
        assert back.ping()  # the users, in the rejoined node's new ACL file
        back.execute_command("READONLY")  # a replica of the slot: the actor's read, replicated
        # a restarted node answers CLUSTERDOWN until it has learned the slots from the others
        # (seconds under load: a 2-worker test run read it too early)
        assert wait_until(lambda: cluster_info(back).get("cluster_state") == "ok", 30)
        assert wait_until(lambda: back.get(NAMES.samples_produced) == b"2", 10)  # once synced
        assert oct(os.stat(os.path.join(victim.data_dir, "users.acl")).st_mode)[-3:] == "600"
        with pytest.raises(redis.exceptions.NoPermissionError):
            back.config_get("requirepass")
    finally:
        local.stop()


def test_acl_file_is_for_the_launchers_topologies_and_gets_per_run_passwords(tmp_path):
    cfg = OmegaConf.structured(Config)
    acl = str(ROOT / "deploy" / "redis" / "users.acl")
    for mode, url in (
        ("single", None),
        ("cluster", "redis+cluster://h:1/"),
        ("sentinel", "redis+sentinel://h:1/s/0"),
    ):
        bad = cfg.copy()
        bad.redis.mode, bad.redis.url, bad.redis.acl_file = mode, url, acl
        with pytest.raises(ValueError, match="redis.acl_file is for redis=cluster and redis=ha"):
            validate(bad)
    for mode in ("cluster", "sentinel"):  # the nodes (and sentinels) the launcher starts
        ok = cfg.copy()
        ok.redis.mode, ok.redis.acl_file = mode, acl
        validate(ok)
    users = per_run_users(acl, str(tmp_path / "u.acl"))
    assert sorted(users) == ["actor", "evaluator", "operator", "preprocessor", "trainer"]
    text = (tmp_path / "u.acl").read_text()
    assert "CHANGE-ME" not in text and all(f">{pw}" in text for pw in users.values())
    assert "user default off" in text and oct((tmp_path / "u.acl").stat().st_mode)[-3:] == "600"
    with pytest.raises(ValueError, match="is not a file"):
        per_run_users(str(tmp_path / "missing.acl"), str(tmp_path / "x.acl"))


@pytest.mark.slow
def test_an_actor_refused_on_one_partitions_node_exits_4_naming_it(tmp_path):
    """The actor's user lacks XADD only on the primary (and replica) serving partition
    2's slot: the actor stops at start-up (exit 4, no traceback) naming that node and
    partition 2's stream, since the runtime probes every partition, not only the first."""
    from tests.config_builders import actor_config

    local, urls = acl_cluster(tmp_path / "acl")
    try:
        key = Names("nonstop", "tiny", cluster=True).part(2).rollouts
        probe = connect(urls["operator"], startup_s=8)
        node = probe.get_node_from_key(key)
        probe.close()
        k = next(i for i, n in enumerate(local.nodes) if n.port == node.port)
        for j in (k, *(r for r, p in local.replica_of.items() if p == k)):
            local.node_client(local.nodes[j]).acl_setuser("actor", enabled=True, commands=["-xadd"])
        env = dict(os.environ, NONSTOP_REDIS_URL_ACTOR=urls["actor"], HF_HUB_OFFLINE="1")
        env.update(NONSTOP_CACHE=tiny_cache(tmp_path / "cache"), NONSTOP_RUN_SECRET="s" * 32)
        env["NONSTOP_REDIS_URL"] = urls["operator"]
        cfg = actor_config(tmp_path, "null")
        cmd = [sys.executable, "-m", "actor", "--config", cfg, "redis.mode=cluster"]
        cmd += [f"redis.shards={PARTITIONS}"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 4, out
        assert "Traceback" not in out and "pw-actor" not in out, out
        line = next(ln for ln in out.splitlines() if "may not run XADD" in ln)
        assert f"cluster node {node.name})" in line and key in line, line
    finally:
        local.stop()


@pytest.mark.slow
def test_tiny_pipeline_on_redis_cluster_with_the_shipped_users(tmp_path):
    """redis=cluster with redis.acl_file=deploy/redis/users.acl: every node loads the
    shipped users with per-run passwords, each pool connects as its role's user
    (NONSTOP_REDIS_URL_<ROLE>) and passes its start-up probes on every partition; the run
    finishes with nothing lost or duplicated."""
    users, run_dir = tiny_run_as_role_users(tmp_path, "redis=cluster", parse, lambda a: a.nodes)
    # (superuser): a replica's link to its primary, as CLIENT LIST shows it on the replica
    assert users <= {"actor", "preprocessor", "trainer", "evaluator", ADMIN, "(superuser)"}, users
    users = (run_dir / "redis" / "users.acl").read_text()
    assert (
        "CHANGE-ME" not in users
        and oct((run_dir / "redis" / "users.acl").stat().st_mode)[-3:] == "600"
    )
    for node in sorted((run_dir / "redis").glob("node-*")):  # the same users on every node
        assert (node / "users.acl").read_text().startswith(users), node


def test_acl_users_and_tls_together_on_the_local_cluster(tmp_path, monkeypatch):
    """redis=cluster redis.tls=true redis.acl_file=...: every node TLS-only and loading the
    per-run users; each pool's URL is a rediss+cluster:// URL of its own user, which
    works over TLS and is refused what its role may not do."""
    from pipeline.topology.cluster import start_local_cluster

    cfg = OmegaConf.structured(Config)
    cfg.redis.mode, cfg.redis.shards, cfg.redis.tls.enabled = "cluster", PARTITIONS, True
    cfg.redis.acl_file = str(ROOT / "deploy" / "redis" / "users.acl")
    local = start_local_cluster(cfg, str(tmp_path))
    try:
        for var, value in local.client_tls.env().items():
            monkeypatch.setenv(var, value)
        assert set(local.role_urls) == {"actor", "preprocessor", "trainer", "evaluator"}
        url = local.role_urls["actor"]
        assert url.startswith("rediss+cluster://actor:"), url.split("@")[0]
        actor = connect(url, reconnect_s=5, startup_s=8)
        names = Names("nonstop", "run", cluster=True)
        assert actor.xadd(names.part(1).rollouts, {"f": "v"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            actor.xadd(names.batches, {"f": "v"})  # the preprocessor's stream
        plain = url.replace("rediss+cluster://", "redis+cluster://")
        with pytest.raises(Exception, match="TLS|tls|rediss"):
            connect(plain, reconnect_s=1, startup_s=2)  # the nodes speak TLS only
    finally:
        local.stop()
