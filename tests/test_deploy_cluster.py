"""deploy/ in redis.mode=cluster and over TLS: the nonstop-redis-cluster@ unit's command
starting real cluster nodes joined by deploy/bin/nonstop-cluster-form (plain and TLS),
the sentinel mode's node and sentinel commands over TLS, and (slow) the Slurm Redis job
in cluster mode on the single-host Slurm: it comes up, fails over a killed primary,
brings the lost node back and resumes its data in a resubmitted job; over TLS; and a
whole tiny run in cluster mode."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pipeline.redisd.server import free_port
from pipeline.redisd.tls import make_run_certs
from pipeline.streams import Names, connect
from pipeline.streams.cluster import parse as parse_cluster
from pipeline.streams.sentinel import parse as parse_sentinel
from pipeline.topology.cluster import bus_port, cluster_info
from tests.deploy_builders import env_file, stop_processes, unit_file, verify_units
from tests.slurm_builders import _job_state, sbatch, slurm_env, tail_of, wait_done

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNIT = "nonstop-redis-cluster@.service"
PASSWORD = "c1u5" * 8

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")


def _wait(cond, timeout: float, what) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what() if callable(what) else what}")
        time.sleep(0.5)


def _node_addr() -> str:
    """The address deploy/slurm/common.sh's nonstop_node_addr gives this host."""
    out = subprocess.run(
        ["bash", "-c", f"source {DEPLOY}/slurm/common.sh; nonstop_node_addr"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout.strip()


def _two_partitions(client, names: Names) -> tuple[int, int]:
    """Two partitions whose rollouts streams live on different primaries."""
    first = {}
    for k in range(16):
        node = client.get_node_from_key(names.part(k).stream("rollouts")).name
        first.setdefault(node, k)
        if len(first) == 2:
            return tuple(first.values())
    pytest.fail("16 partitions all on one primary")


def _write_read(client, names: Names, parts, tag: str) -> None:
    for k in parts:
        stream = names.part(k).stream("rollouts")
        client.xadd(stream, {"tag": tag})
        assert client.xrange(stream)[-1][1] == {b"tag": tag.encode()}


def _tags(client, names: Names, k: int) -> list[bytes]:
    return [f[b"tag"] for _, f in client.xrange(names.part(k).stream("rollouts"))]


# ------------------------------------------------------------------ systemd: cluster nodes


def _unit_env(unit: str, instance: str) -> dict[str, str]:
    """The unit's Environment= lines with %i filled in."""
    out = {}
    for line in unit_file(unit).get("Environment", []):
        key, value = line.replace("%i", instance).split("=", 1)
        out[key] = value
    return out


def _start_node(base: dict, tmp: Path, port: int) -> subprocess.Popen:
    """The unit's ExecStart for instance ``port``, as systemd would run it: its
    Environment=, the env file's variables, STATE_DIRECTORY and RUNTIME_DIRECTORY."""
    line = unit_file(UNIT)["ExecStart"][0].replace("%i", str(port))
    argv = line.replace("/usr/local/lib/nonstop-rl", str(DEPLOY / "bin"))
    argv = argv.replace("/etc/nonstop-rl/redis.conf", str(DEPLOY / "redis" / "nonstop-redis.conf"))
    env = base | _unit_env(UNIT, str(port))
    env |= {
        "STATE_DIRECTORY": str(tmp / "state" / str(port)),
        "RUNTIME_DIRECTORY": str(tmp / "run" / str(port)),
    }
    log = open(tmp / f"node-{port}.log", "a")  # noqa: SIM115 - the child's output
    return subprocess.Popen(argv.split(), env=env, stdout=log, stderr=log)


def _ping(port: int, proc: subprocess.Popen, tls_kwargs: dict, tmp: Path) -> None:
    client = redis.Redis(port=port, password=PASSWORD, socket_timeout=2, **tls_kwargs)
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, (tmp / f"node-{port}.log").read_text()
        try:
            client.ping()
            return
        except redis.RedisError:
            assert time.monotonic() < deadline, f"node {port} did not answer"
            time.sleep(0.1)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_cluster_unit_command_starts_nodes_that_form_a_cluster_and_fail_over(
    unit_root,
    tmp_path,
    tls,
):
    """systemd-analyze verify on an instance of the cluster-node unit; six nodes started
    with its command and the env file's variables, joined by the documented one-time
    nonstop-cluster-form; a client writes two partitions on two primaries; a SIGKILLed
    primary is failed over, the client writes again, and the node restarted by the same
    command (Restart=on-failure) rejoins as a replica from its nodes.conf."""
    proc = verify_units(unit_root, UNIT.replace("@.", "@7000."))
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stderr
    ports = []
    while len(ports) < 6:
        p = bus_port()
        if p not in ports:
            ports.append(p)
    scheme = "rediss+cluster" if tls else "redis+cluster"
    url = f"{scheme}://:{PASSWORD}@" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/"
    env = dict(os.environ) | env_file(DEPLOY / "env.example")
    env |= {
        "NONSTOP_REDIS_URL": url,
        "NONSTOP_REDIS_BIND": "127.0.0.1",
        "NONSTOP_REDIS_ANNOUNCE_IP": "127.0.0.1",
        "NONSTOP_REDIS_CLUSTER_NODE_TIMEOUT_MS": "2000",
        "NONSTOP_REDIS_SERVER": shutil.which("redis-server"),
        "PYTHONPATH": str(ROOT),
    }
    tls_kwargs, client_files = {}, None
    if tls:
        server, client_files = make_run_certs(str(tmp_path / "tls"))
        env |= client_files.env() | {
            "NONSTOP_REDIS_TLS_SERVER_CERT": server.cert,
            "NONSTOP_REDIS_TLS_SERVER_KEY": server.key,
        }
        tls_kwargs = {"ssl": True, **client_files.client_kwargs()}
    procs = {p: _start_node(env, tmp_path, p) for p in ports}
    try:
        for p in ports:
            _ping(p, procs[p], tls_kwargs, tmp_path)
        if tls:  # TLS only: no plain-text port answers
            with pytest.raises(redis.ConnectionError):
                redis.Redis(port=ports[0], password=PASSWORD, socket_timeout=2).ping()
        form = _form_cluster(env)
        assert form.returncode == 0, form.stdout + form.stderr
        assert "cluster created" in form.stdout
        client = connect(url, reconnect_s=60, tls=client_files)
        names = Names("nonstop", "unit", cluster=True)
        parts = _two_partitions(client, names)
        _write_read(client, names, parts, "before")
        client.execute_command("WAIT", 1, 5000, target_nodes=client.get_primaries())
        victim = client.get_node_from_key(names.part(parts[0]).stream("rollouts"))
        procs[victim.port].send_signal(signal.SIGKILL)
        procs[victim.port].wait()
        _write_read(client, names, parts, "after")  # through the failover
        now = client.get_node_from_key(names.part(parts[0]).stream("rollouts"))
        assert now.port != victim.port
        assert _tags(client, names, parts[0]) == [b"before", b"after"]
        procs[victim.port] = _start_node(env, tmp_path, victim.port)  # Restart=on-failure
        back = redis.Redis(port=victim.port, password=PASSWORD, socket_timeout=2, **tls_kwargs)

        def replica_in_sync():
            try:
                repl = back.info("replication")
            except redis.RedisError:
                return False
            return repl.get("role") == "slave" and repl.get("master_link_status") == "up"

        _wait(replica_in_sync, 60, lambda: (tmp_path / f"node-{victim.port}.log").read_text())
        assert cluster_info(back)["cluster_state"] == "ok"
    finally:
        stop_processes(procs.values())
    for p in ports:  # each node's AOF and nodes.conf in its state directory
        assert (tmp_path / "state" / str(p) / "nodes.conf").exists()


def test_cluster_form_refuses_bad_input_in_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), NONSTOP_REDIS_URL="redis://:pw@127.0.0.1:1/0")
    cases = [
        ([], "set NONSTOP_REDIS_URL=redis+cluster://"),
        (
            ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"],
            "leave 1 primaries; a Redis Cluster needs 3",
        ),
        (["127.0.0.1"], "bad node '127.0.0.1': write HOST:PORT"),
    ]
    for i, (args, message) in enumerate(cases):
        if i:
            env["NONSTOP_REDIS_URL"] = f"redis+cluster://:{PASSWORD}@127.0.0.1:7000/"
        out = subprocess.run(
            [sys.executable, DEPLOY / "bin" / "nonstop-cluster-form", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and PASSWORD not in out.stderr


# ------------------------------------------------------------------ systemd: sentinels on TLS


def test_sentinel_mode_commands_run_on_tls(tmp_path):
    """nonstop-redis-start (a primary and a replica) and three nonstop-sentinel-start with
    a rediss+sentinel:// URL, as the units run them: every node and sentinel on TLS only,
    the replica in sync over TLS, a client found through the sentinels writes."""
    server, client_files = make_run_certs(str(tmp_path / "tls"))
    node_ports, sentinel_ports = [free_port(), free_port()], [free_port() for _ in range(3)]
    hosts = ",".join(f"127.0.0.1:{p}" for p in sentinel_ports)
    url = f"rediss+sentinel://:{PASSWORD}@{hosts}/nonstop/0"
    env = dict(os.environ) | client_files.env()
    env |= {
        "NONSTOP_REDIS_URL": url,
        "NONSTOP_REDIS_TLS_SERVER_CERT": server.cert,
        "NONSTOP_REDIS_TLS_SERVER_KEY": server.key,
        "NONSTOP_REDIS_BIND": "127.0.0.1",
        "NONSTOP_REDIS_ANNOUNCE_IP": "127.0.0.1",
        "NONSTOP_SENTINEL_ANNOUNCE_IP": "127.0.0.1",
        "NONSTOP_REDIS_SERVER": shutil.which("redis-server"),
        "NONSTOP_REDIS_PRIMARY": f"127.0.0.1:{node_ports[0]}",
    }
    procs = []

    def start(argv, log, **extra):
        with open(tmp_path / log, "w") as f:
            procs.append(subprocess.Popen(argv, env=env | extra, stdout=f, stderr=f))

    conf = str(DEPLOY / "redis" / "nonstop-redis.conf")
    try:
        for k, port in enumerate(node_ports):
            role = {"NONSTOP_REDIS_ROLE": "replica", "NONSTOP_REDIS_REPLICAOF": env[
                "NONSTOP_REDIS_PRIMARY"]} if k else {}  # fmt: skip
            start(
                [DEPLOY / "bin" / "nonstop-redis-start", conf],
                f"node-{k}.log",
                NONSTOP_REDIS_NODE_PORT=str(port),
                NONSTOP_REDIS_DIR=str(tmp_path / f"node-{k}"),
                NONSTOP_REDIS_RUNTIME=str(tmp_path / f"run-{k}"),
                **role,
            )
        for k, port in enumerate(sentinel_ports):
            start(
                [DEPLOY / "bin" / "nonstop-sentinel-start"],
                f"sentinel-{k}.log",
                NONSTOP_SENTINEL_PORT=str(port),
                NONSTOP_SENTINEL_DIR=str(tmp_path / f"sentinel-{k}"),
            )
        tls_kwargs = {"ssl": True, **client_files.client_kwargs()}
        replica = redis.Redis(port=node_ports[1], password=PASSWORD, socket_timeout=2, **tls_kwargs)

        def in_sync():
            assert all(p.poll() is None for p in procs), [
                (tmp_path / f).read_text() for f in os.listdir(tmp_path) if f.endswith(".log")
            ]
            try:
                return replica.info("replication").get("master_link_status") == "up"
            except redis.RedisError:
                return False

        _wait(in_sync, 30, "the replica did not sync over TLS")
        with pytest.raises(redis.ConnectionError):  # TLS only
            redis.Redis(port=sentinel_ports[0], password=PASSWORD, socket_timeout=2).ping()
        conf_text = (tmp_path / "sentinel-0" / "sentinel.conf").read_text()
        assert "port 0" in conf_text and "tls-replication yes" in conf_text
        client = connect(url, reconnect_s=30, tls=client_files)
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert client.execute_command("WAIT", 1, 5000) == 1
    finally:
        stop_processes(procs)


# ------------------------------------------------------------------ Slurm (slow)


def _compose(run_dir: Path, *overrides: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.launch", "+exp=tiny", *overrides, f"run_dir={run_dir}"]
        + ["--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    (run_dir / "config.yaml").write_text(out.stdout)


def _published(env: dict, job: str, run_dir: Path, out: Path, timeout: float = 180) -> str:
    """The URL the Redis job publishes (failing at once if the job ended first)."""
    url_file = run_dir / "redis" / "url"

    def published():
        if url_file.exists():
            return True
        state = _job_state(env, job)[0]
        assert state in ("PENDING", "RUNNING", "CONFIGURING", "UNANSWERED"), (
            f"job {state}: {tail_of(out)}"
        )
        return False

    _wait(published, timeout, lambda: tail_of(out))
    assert url_file.stat().st_mode & 0o777 == 0o600
    return url_file.read_text().strip()


def _slurm_nodes(run_dir: Path) -> dict[str, str]:
    """HOST:PORT -> the Slurm node its task ran on (redis/node.K)."""
    out = {}
    for f in (run_dir / "redis").glob("node.*"):
        if f.name.count(".") == 1 and f.name[5:].isdigit():
            addr, where = f.read_text().split()
            out[addr] = where
    return out


@pytest.mark.slow
def test_slurm_redis_job_in_cluster_mode_fails_over_and_resumes(slurm, tmp_path):
    """redis.sbatch with redis.mode=cluster on three nodes of the single-host Slurm, six
    tasks: a cluster of 3 primaries with a replica each on another Slurm node, published
    only once whole; a client writes two partitions on two primaries; SIGKILL of one
    primary and deletion of its data: the cluster fails over, the client writes again,
    the task brings the node back as a replica; a resubmitted job (new ports) resumes
    the data."""
    run_dir = tmp_path / "run"
    _compose(run_dir, "redis=cluster")
    env = slurm_env(
        slurm, run_dir, tmp_path / "cache", NONSTOP_REDIS_CLUSTER_NODE_TIMEOUT_MS="2000"
    )
    out = tmp_path / "redis.out"
    job = sbatch(env, "redis.sbatch", out, "-N3", "-n6", "--ntasks-per-node=2")
    names = Names("nonstop", "slurm", cluster=True)
    try:
        url = _published(env, job, run_dir, out)
        parsed = parse_cluster(url)
        assert url.startswith("redis+cluster://") and len(parsed.nodes) == 6
        where = _slurm_nodes(run_dir)
        assert len(set(where.values())) == 3, where
        client = connect(url, reconnect_s=60)
        table = client.cluster_nodes()  # {"host:port": {"node_id", "master_id", ...}}
        by_id = {v["node_id"]: a.split("@")[0] for a, v in table.items()}
        pairs = [(a, by_id[v["master_id"]]) for a, v in table.items() if v["master_id"] != "-"]
        assert len(pairs) == 3, table
        for replica, primary in pairs:  # replicas on other Slurm nodes than their primary
            assert where[replica.split("@")[0]] != where[primary], (replica, primary, where)
        parts = _two_partitions(client, names)
        _write_read(client, names, parts, "before")
        client.execute_command("WAIT", 1, 5000, target_nodes=client.get_primaries())
        victim = client.get_node_from_key(names.part(parts[0]).stream("rollouts"))
        node = victim.redis_connection
        pid, data = node.info("server")["process_id"], node.config_get("dir")["dir"]
        os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(data)
        killed = time.monotonic()
        _write_read(client, names, parts, "after")
        waited = time.monotonic() - killed
        print(f"\nslurm cluster: kill to a write in the lost primary's slot {waited:.1f} s")
        assert client.get_node_from_key(names.part(parts[0]).stream("rollouts")).name != victim.name
        _wait(lambda: "came back without its data" in out.read_text(), 60, lambda: tail_of(out))

        back = redis.Redis(victim.host, victim.port, password=parsed.password, socket_timeout=2)

        def whole():  # six nodes again, the lost one's old id forgotten, it a replica in sync
            try:
                info, repl = cluster_info(back), back.info("replication")
            except redis.RedisError:
                return False
            return (
                info["cluster_known_nodes"] == "6"
                and info["cluster_state"] == "ok"
                and repl.get("role") == "slave"
                and repl.get("master_link_status") == "up"
            )

        _wait(whole, 60, lambda: tail_of(out))
        client.close()
    finally:
        subprocess.run(["scancel", "--signal=TERM", job], env=env, timeout=30)
        wait_done(env, job, 90, out)
    assert not (run_dir / "redis" / "url").exists()
    out2 = tmp_path / "redis2.out"
    job2 = sbatch(env, "redis.sbatch", out2, "-N3", "-n6", "--ntasks-per-node=2")
    try:
        url2 = _published(env, job2, run_dir, out2)
        assert set(parse_cluster(url2).nodes).isdisjoint(parsed.nodes) or url2 != url
        assert "met again" in out2.read_text()  # resumed from nodes.conf, not created anew
        client = connect(url2, reconnect_s=30)
        for k in parts:
            assert _tags(client, names, k) == [b"before", b"after"], k
        client.close()
    finally:
        subprocess.run(["scancel", "--signal=TERM", job2], env=env, timeout=30)
        wait_done(env, job2, 90, out2)
    for k in range(6):  # every node stopped cleanly (SIGTERM: AOF written)
        assert "ready to exit" in (run_dir / "redis" / f"node-{k}.log").read_text(), k


def _tls_job(slurm, run_dir: Path, tmp_path: Path, *overrides: str):
    """A Redis job's environment with the job's server certificate (TLS only) and the
    run composed with ``overrides``; returns (env, the client's TLS files)."""
    _compose(run_dir, *overrides)
    server, client_files = make_run_certs(
        str(tmp_path / "tls"), [_node_addr(), "127.0.0.1", "localhost"]
    )
    tls_env = client_files.env() | {
        "NONSTOP_REDIS_TLS_SERVER_CERT": server.cert,
        "NONSTOP_REDIS_TLS_SERVER_KEY": server.key,
    }
    return slurm_env(slurm, run_dir, tmp_path / "cache", **tls_env), client_files


@pytest.mark.slow
def test_slurm_redis_job_in_cluster_mode_over_tls(slurm, tmp_path):
    """The job's server certificate set: every node on TLS only (rediss+cluster://, the
    bus and replication on TLS), a plain-text client refused, a TLS client writes and
    reads two partitions."""
    run_dir = tmp_path / "run"
    env, client_files = _tls_job(slurm, run_dir, tmp_path, "redis=cluster")
    out = tmp_path / "redis.out"
    job = sbatch(env, "redis.sbatch", out, "-N3", "-n6", "--ntasks-per-node=2")
    try:
        url = _published(env, job, run_dir, out)
        assert url.startswith("rediss+cluster://")
        host, port = parse_cluster(url).nodes[0]
        with pytest.raises(redis.ConnectionError):
            redis.Redis(host, port, password=parse_cluster(url).password, socket_timeout=2).ping()
        client = connect(url, reconnect_s=30, tls=client_files)
        names = Names("nonstop", "tls", cluster=True)
        _write_read(client, names, _two_partitions(client, names), "tls")
        assert client.execute_command("WAIT", 1, 5000, target_nodes=client.get_primaries())
        client.close()
    finally:
        subprocess.run(["scancel", "--signal=TERM", job], env=env, timeout=30)
        wait_done(env, job, 90, out)


@pytest.mark.slow
def test_slurm_redis_job_in_sentinel_mode_over_tls(slurm, tmp_path):
    """redis.mode=sentinel with the job's server certificate: a rediss+sentinel:// URL,
    nodes and sentinels on TLS only, a TLS client writes through the sentinels."""
    run_dir = tmp_path / "run"
    env, client_files = _tls_job(slurm, run_dir, tmp_path, "redis=ha")
    out = tmp_path / "redis.out"
    job = sbatch(env, "redis.sbatch", out, "-N3", "-n3")
    try:
        url = _published(env, job, run_dir, out)
        assert url.startswith("rediss+sentinel://")
        host, port = parse_sentinel(url).sentinels[0]
        with pytest.raises(redis.ConnectionError):
            redis.Redis(host, port, socket_timeout=2).ping()
        client = connect(url, reconnect_s=30, tls=client_files)
        client.set("k", "tls")
        assert client.get("k") == b"tls" and client.execute_command("WAIT", 1, 5000) == 1
    finally:
        subprocess.run(["scancel", "--signal=TERM", job], env=env, timeout=30)
        wait_done(env, job, 90, out)


# run.sbatch's groups: a 6-node Redis Cluster on three nodes, the preprocessor, the
# trainer, two actors (one node each)
CLUSTER_GROUPS = ["-N3", "-n6", "--ntasks-per-node=2", "-c1", ":", "-N1", "-n1", "-c2", ":"]
CLUSTER_GROUPS += ["-N1", "-n1", "-c2", ":", "-N1", "-n2", "-c2"]


def _whole_pipeline(slurm, tmp_path: Path, redis_override: str, groups: list[str]):
    """The tiny pipeline (4 steps) under run.sbatch with ``groups``: it completes, the
    summary says finished, 0 lost, 0 duplicated and every actor applied weights; returns
    (the job's output, the run directory)."""
    run_dir = tmp_path / "run"
    compose = f"+exp=tiny {redis_override} trainer.max_steps=4"
    env = slurm_env(slurm, run_dir, tmp_path / "cache", NONSTOP_COMPOSE=compose)
    log = tmp_path / "run.out"
    job = sbatch(env, "run.sbatch", log, *groups)
    state, code = wait_done(env, job, 400, log)
    assert (state, code) == ("COMPLETED", "0:0"), tail_of(log, 80)
    text = log.read_text()
    assert "run summary" in text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["trainer_steps"] == 4
    acc = summary["accounting"]
    assert acc["groups_lost"] == 0 and acc["groups_duplicated"] == 0, acc
    assert min(summary["weight_updates_applied"].values()) >= 1
    assert not (run_dir / "redis" / "url").exists()  # Redis stopped with the job
    return text, run_dir


@pytest.mark.slow
def test_slurm_heterogeneous_job_runs_the_whole_pipeline_on_a_cluster(slurm, tmp_path):
    text, run_dir = _whole_pipeline(slurm, tmp_path, "redis=cluster", CLUSTER_GROUPS)
    assert "redis cluster of 6 nodes" in text
    where = re.findall(r"redis cluster node \d on node (\w+)", text)
    assert sorted(where) == ["n1", "n1", "n2", "n2", "n3", "n3"], text  # two per node
    aofs = [
        b"".join(
            p.read_bytes() for p in (run_dir / "redis" / f"node-{k}" / "appendonlydir").iterdir()
        )
        for k in range(6)
    ]
    for k in range(3):  # redis=cluster's 3 partitions all carried rollouts
        assert any(f"{{tiny.p{k}}}:rollouts".encode() in a for a in aofs), k


# run.sbatch's groups in sentinel mode: a node and a sentinel on each of three nodes, the
# preprocessor, the trainer, two actors (one node each)
SENTINEL_GROUPS = ["-N3", "-n3", "-c1", ":", "-N1", "-n1", "-c2", ":"]
SENTINEL_GROUPS += ["-N1", "-n1", "-c2", ":", "-N1", "-n2", "-c2"]


@pytest.mark.slow
def test_slurm_heterogeneous_job_runs_the_whole_pipeline_in_sentinel_mode(slurm, tmp_path):
    """The whole tiny pipeline under run.sbatch with redis.mode=sentinel: the primary,
    the replica and three sentinels on three Slurm nodes (redis-ha.sh), the pools find
    the primary through the sentinels, their work writes wait for the replica (WAIT 1),
    and the run finishes with nothing lost or duplicated."""
    _, run_dir = _whole_pipeline(slurm, tmp_path, "redis=ha", SENTINEL_GROUPS)
    primary = int((run_dir / "redis" / "primary_node").read_text().split()[0])
    replica = 1 - primary  # nodes 0 and 1 (NONSTOP_REDIS_REPLICAS=1)
    synced = (run_dir / "redis" / f"node-{replica}.log").read_text()
    assert "MASTER <-> REPLICA sync: Finished with success" in synced
    for k in (primary, replica):  # the replica holds the run's rollouts too
        data = b"".join(p.read_bytes() for p in (run_dir / "redis" / f"node-{k}").rglob("*.*"))
        assert b"tiny:rollouts" in data, f"node-{k} never held a rollout"


def test_cluster_unit_command_loads_per_role_acl_users(tmp_path):
    """NONSTOP_REDIS_ACL_FILE: six nodes started with the unit's command load
    deploy/redis/users.acl (plus an admin user of the operator's) instead of a default
    user's password; nonstop-cluster-form joins them as the URL's admin user, the replicas
    sync as it (masteruser), and each pool's user does its work on the cluster and is
    refused the rest. A replicated node without a user in the URL: one line, exit 2."""
    ports = []
    while len(ports) < 6:
        p = bus_port()
        if p not in ports:
            ports.append(p)
    nodes = ",".join(f"127.0.0.1:{p}" for p in ports)
    acl = (DEPLOY / "redis" / "users.acl").read_text()
    for role in ("actor", "preprocessor", "trainer", "operator", "evaluator"):
        acl = acl.replace(f"CHANGE-ME-{role}", f"pw-{role}")
    acl += f"user admin on >{PASSWORD} ~* &* +@all\n"
    (tmp_path / "users.acl").write_text(acl)
    env = dict(os.environ) | env_file(DEPLOY / "env.example")
    env |= {
        "NONSTOP_REDIS_URL": f"redis+cluster://admin:{PASSWORD}@{nodes}/",
        "NONSTOP_REDIS_ACL_FILE": str(tmp_path / "users.acl"),
        "NONSTOP_REDIS_BIND": "127.0.0.1",
        "NONSTOP_REDIS_ANNOUNCE_IP": "127.0.0.1",
        "NONSTOP_REDIS_CLUSTER_NODE_TIMEOUT_MS": "2000",
        "NONSTOP_REDIS_SERVER": shutil.which("redis-server"),
        "PYTHONPATH": str(ROOT),
    }
    no_user = _start_node(env | {"NONSTOP_REDIS_URL": f"redis+cluster://:{PASSWORD}@{nodes}/"},
                          tmp_path, ports[0])  # fmt: skip
    assert no_user.wait(30) == 2
    assert "give NONSTOP_REDIS_URL the user" in (tmp_path / f"node-{ports[0]}.log").read_text()
    procs = {p: _start_node(env, tmp_path, p) for p in ports}
    try:
        for p in ports:
            admin = redis.Redis(port=p, username="admin", password=PASSWORD, socket_timeout=2)
            _wait(
                lambda a=admin: _answers(a),
                30,
                lambda p=p: (tmp_path / f"node-{p}.log").read_text(),
            )
            with pytest.raises(redis.AuthenticationError):  # the default user is off
                redis.Redis(port=p, password=PASSWORD, socket_timeout=2).ping()
        form = _form_cluster(env)
        assert form.returncode == 0, form.stdout + form.stderr  # replicas in sync: masteruser
        names = Names("nonstop", "acl", cluster=True)
        actor = connect(f"redis+cluster://actor:pw-actor@{nodes}/", reconnect_s=10)
        pre = connect(f"redis+cluster://preprocessor:pw-preprocessor@{nodes}/", reconnect_s=10)
        parts = _two_partitions(actor, names)
        for k in parts:
            assert actor.xadd(names.part(k).rollouts, {"f": "v"})
            assert pre.xadd(names.part(k).batches, {"f": "v"})
            with pytest.raises(redis.exceptions.NoPermissionError):
                actor.xadd(names.part(k).batches, {"f": "v"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            actor.flushall()
    finally:
        stop_processes(procs.values())


def _form_cluster(env: dict) -> subprocess.CompletedProcess:
    """deploy/bin/nonstop-cluster-form over the nodes of ``env``'s NONSTOP_REDIS_URL."""
    return subprocess.run(
        [sys.executable, DEPLOY / "bin" / "nonstop-cluster-form"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _answers(client) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_a_redis_task_stops_a_replica_that_refuses_its_first_sigterm(tmp_path):
    """redis-server 7.0 refuses a SIGTERM that arrives while a replica writes its initial
    AOF after a full sync ("Writing initial AOF, can't exit.") and runs on: a Slurm Redis
    task that signalled once and waited outlived scancel --signal=TERM (the cluster job's
    node brought back as a replica, stopped right after its sync). common.sh's
    nonstop_stop_servers, which the tasks' traps call, signals again until it exits, and
    it exits cleanly (AOF written). rdb-key-save-delay stretches the AOF write to ~2 s."""
    ports = free_port(), free_port()
    procs = []
    for port, extra in zip(
        ports, (["--appendonly", "no"], ["--rdb-key-save-delay", "100000"]), strict=True
    ):
        (tmp_path / str(port)).mkdir()
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--dir", str(tmp_path / str(port)), "--logfile", f"{port}.log", *extra]
        procs.append(subprocess.Popen(argv + ["--appendonly", "yes"] * (port == ports[1])))
    primary, replica = (redis.Redis("127.0.0.1", p, socket_timeout=5) for p in ports)
    log = tmp_path / str(ports[1]) / f"{ports[1]}.log"
    try:
        _wait(lambda: _pings(primary) and _pings(replica), 30, "the two servers")
        primary.mset({f"k{i}": i for i in range(20)})
        replica.replicaof("127.0.0.1", ports[0])
        _wait(lambda: replica.info("replication")["master_link_status"] == "up", 30, "sync")
        procs[1].send_signal(signal.SIGTERM)  # the one SIGTERM of a scancel --signal=TERM
        _wait(lambda: "can't exit" in log.read_text(), 10, lambda: log.read_text())
        assert procs[1].poll() is None  # refused: still running
        started = time.monotonic()
        subprocess.run(
            ["bash", "-c", f"source {DEPLOY}/slurm/common.sh; nonstop_stop_servers {procs[1].pid}"],
            timeout=60,
            check=True,
        )
        assert procs[1].wait(timeout=5) == 0, log.read_text()
        assert "ready to exit" in log.read_text()  # a clean stop, not SIGKILL
        assert time.monotonic() - started < 30
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_task_without_a_node_stops_at_once():
    """A sentinel-only task (redis-ha.sh: the third node runs a sentinel and no server)
    passes an empty node pid to nonstop_stop_servers: it returns at once. It read
    /proc//stat (that is /proc/stat, always there) as a running server, waited the whole
    NONSTOP_REDIS_STOP_S (60 s) and then killed nothing: every sentinel-mode Slurm job
    took a minute to stop."""
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        started = time.monotonic()
        stop = f"source {DEPLOY}/slurm/common.sh; nonstop_stop_servers '' {sleeper.pid}"
        subprocess.run(
            ["bash", "-c", stop],
            env=dict(os.environ, NONSTOP_REDIS_STOP_S="20"),
            timeout=60,
            check=True,
        )
        assert time.monotonic() - started < 5
        assert sleeper.wait(timeout=5) == -signal.SIGTERM  # the real pid was stopped
    finally:
        sleeper.kill()
        sleeper.wait()


def _pings(client) -> bool:
    try:
        return client.ping()
    except redis.RedisError:
        return False
