"""redis.mode=sentinel on real redis-servers on loopback (pipeline/topology/ha.py,
pipeline/streams/sentinel.py): a primary, a replica and three sentinels; the client found
through the sentinels follows a failover (SIGKILL of the primary and its data directory
deleted) with no restart; the primary refuses writes without a replica; bad sentinel
URLs fail in one line; the tiny pipeline runs end to end on redis=ha."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from omegaconf import OmegaConf

from pipeline.config import Config, min_replicas_acked, validate
from pipeline.redisd.server import free_port
from pipeline.streams import RedisRefused, RedisUnavailable, connect
from pipeline.streams.sentinel import NotEnoughReplicas, failover_gap, parse
from pipeline.topology.ha import RedisHA
from tests.deploy_builders import stop_processes
from tests.launching import ROOT
from tests.redis_builders import WatchRounds, interrupted_start, pool_start_line

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")


@pytest.fixture
def ha(tmp_path):
    topology = RedisHA(str(tmp_path / "redis"))
    topology.start()
    yield topology
    topology.stop()


def test_sentinel_urls_parse_and_hide_the_password():
    p = parse("redis+sentinel://u:s3cret@h1:26379,h2:26380,h3/svc/2")
    assert p.sentinels == [("h1", 26379), ("h2", 26380), ("h3", 26379)]
    assert (p.service, p.db, p.username, p.password) == ("svc", 2, "u", "s3cret")
    assert "s3cret" not in p.shown() and p.shown().startswith("redis+sentinel://***@h1:26379")
    for bad, said in [
        ("redis+sentinel://h1:26379", "give the sentinels and the service"),
        ("redis+sentinel://h1:x/svc", "bad sentinel address"),
        ("redis+sentinel://h1:1/svc/db", "bad database"),
    ]:
        with pytest.raises(ValueError, match=said):
            parse(bad)
    tls = parse("rediss+sentinel://:pw@h1:1/svc")  # TLS: pipeline/redisd/tls.py
    assert tls.tls and tls.shown() == "rediss+sentinel://***@h1:1/svc/0"
    assert not p.tls and p.ssl_kwargs() == {}


def test_redis_mode_is_validated():
    cfg = OmegaConf.structured(Config)
    validate(cfg)
    assert min_replicas_acked(cfg) == 0
    for mode, url, said in [
        ("cluster", "redis://h:1/0", "redis.mode=cluster needs redis.url=redis\\[s\\]\\+cluster"),
        ("raft", None, "redis.mode='raft' is not supported"),
        (
            "sentinel",
            "redis://h:1/0",
            "redis.mode=sentinel needs redis.url=redis\\[s\\]\\+sentinel",
        ),
        ("single", "redis+sentinel://h:1/s", "redis.mode=single"),
    ]:
        bad = cfg.copy()
        bad.redis.mode, bad.redis.url = mode, url
        with pytest.raises(ValueError, match=said):
            validate(bad)
    ok = cfg.copy()
    ok.redis.mode = "sentinel"
    validate(ok)
    assert min_replicas_acked(ok) == 1


def test_failover_keeps_the_same_client_writing(ha):
    """(a) SIGKILL the primary and delete its data: the sentinels promote the replica,
    the supervisor's round restarts the old node as its replica, and the client made
    before the kill carries on; every write it saw acknowledged is on the new primary."""
    client = connect(ha.url, reconnect_s=60)
    old = ha.nodes[0]
    assert client.connection_pool.get_master_address() == ("127.0.0.1", old.port)
    for i in range(20):
        client.xadd("s", {"i": i})
    assert client.execute_command("WAIT", 1, 30000) == 1  # both nodes have them
    # a blocking write in flight across the failover (BLPOP, like the pools' XREADGROUP
    # BLOCK): its retry must go to the primary the sentinels name, not back to the old port
    blocked: dict = {}
    reader = threading.Thread(target=_read_one, args=(client, blocked), daemon=True)
    reader.start()
    _wait(lambda: _blocked_clients(ha, old) > 0, 10, lambda: "the read did not block")
    os.kill(old.proc.pid, signal.SIGKILL)
    old.proc.wait()
    shutil.rmtree(old.data_dir)
    killed = time.monotonic()
    lines: list[str] = []
    watcher = WatchRounds(ha, lines)
    try:
        client.xadd("s", {"i": 20})  # blocks in the retry until the new primary takes it
        first_write_s = time.monotonic() - killed
        new = client.connection_pool.get_master_address()
    finally:
        watcher.stop()
    print(f"\nkill to first write on the new primary: {first_write_s:.2f} s")
    assert new == ("127.0.0.1", ha.nodes[1].port), (new, lines)
    assert [int(e[1][b"i"]) for e in client.xrange("s")] == list(range(21))
    assert any("promoted node-1" in line for line in lines), lines
    assert any("restarting node-0" in line and "as a replica" in line for line in lines), lines
    # the old node came back as a replica of the new primary, with the data
    _wait(lambda: ha.not_ready() is None, 20, lambda: ha.not_ready())
    role = ha.node_client(old).execute_command("ROLE")
    assert role[0] == b"slave" and role[2] == ha.nodes[1].port
    assert first_write_s < 30
    client.rpush("wake", "up")  # the blocked BLPOP, retried on the new primary, returns
    reader.join(30)
    assert blocked.get("got") == (b"wake", b"up"), blocked


def _read_one(client, out: dict) -> None:
    try:
        out["got"] = client.blpop(["wake"], timeout=60)
    except Exception as e:  # noqa: BLE001 - reported by the assertion
        out["error"] = e


def _blocked_clients(ha, node) -> int:
    return int(ha.node_client(node).info("clients")["blocked_clients"])


def _wait(check, timeout, why=lambda: ""):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, why()
        time.sleep(0.1)


def test_primary_refuses_writes_without_a_replica(ha):
    """(b) min-replicas-to-write: with the replica gone the primary applies no write; the
    caller gets NotEnoughReplicas naming the cause once the reconnect budget is spent."""
    client = connect(ha.url, reconnect_s=2)
    client.set("k", "before")
    replica = ha.nodes[1]
    os.kill(replica.proc.pid, signal.SIGKILL)
    replica.proc.wait()
    # the primary notices a silent replica after min-replicas-max-lag seconds at most
    _wait(lambda: _refuses(ha), 15, lambda: "the primary still accepts writes")
    with pytest.raises(
        NotEnoughReplicas, match="refuses writes: NOREPLICAS.*min-replicas-to-write"
    ):
        client.set("k", "after")
    assert client.get("k") == b"before"  # reads go on; the refused write was not applied


def _refuses(ha) -> bool:
    try:
        ha.node_client(ha.nodes[0]).set("probe", 1)
        return False
    except redis.ResponseError as e:
        return "NOREPLICAS" in str(e)


def test_bad_sentinel_urls_fail_in_one_line(ha):
    """(c) no sentinel answers; a service the sentinels do not know; a wrong password."""
    dead = f"redis+sentinel://:pw@127.0.0.1:{free_port()},127.0.0.1:{free_port()}/nonstop/0"
    t = time.monotonic()
    with pytest.raises(RedisUnavailable, match="none of the sentinels of") as e:
        connect(dead, startup_s=1.5)
    assert "pw" not in str(e.value) and "\n" not in str(e.value)
    assert time.monotonic() - t < 10
    unknown = ha.url.replace("/nonstop/", "/nosuch/")
    with pytest.raises(RedisRefused, match="do not know the service 'nosuch'") as e:
        connect(unknown, startup_s=2)
    assert ha.password not in str(e.value)
    wrong = ha.url.replace(ha.password, "wrong")
    with pytest.raises(RedisRefused, match="refused the credentials"):
        connect(wrong, startup_s=2)
    # and from the command line: a pool's one line, exit 2/4, no traceback
    out = pool_start_line(dead)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr
    assert out.stdout.count("\n") == 1 and "redis-sentinel" in out.stdout


@pytest.mark.slow
def test_primary_loss_mid_run_loses_and_duplicates_nothing(tmp_path):
    """(d) the launcher starts the topology (its URL file redis+sentinel://, 0600) and
    the pools run through the sentinels; (e) pipeline.bench faults redis_primary_loss on
    that redis=ha run: SIGKILL the primary and delete its data directory mid-run; the
    sentinels promote the replica, every pool carries on without a restart, and the
    account finds 0 groups lost, 0 duplicated. (One run for both: a tiny run of its own
    for (d) cost a minute of CI.)"""
    from tests.fault_runs import check_account, run_faults_bench

    proc, result, run_dir = run_faults_bench(
        tmp_path, "--faults", "redis_primary_loss", "--set", "redis=ha"
    )
    (fault,) = result["faults"]
    assert fault["name"] == "redis_primary_loss" and fault["effect"]["new_port"] != fault["port"]
    print(
        f"\nredis_primary_loss: kill to first write on the new primary {fault['first_write_s']} s"
    )
    terms = check_account(result, run_dir)
    assert terms["groups_lost"] == 0 and result["groups_duplicated"] == 0
    assert not [k for k in result["restarts"] if not k.startswith("redis-node")], result["restarts"]
    assert result["passed"] and proc.returncode == 0, proc.stdout[-3000:]
    out = (run_dir / "launcher.out").read_text()
    assert "sentinels on" in out, out[-3000:]
    url = run_dir / "redis" / "url"
    assert url.read_text().strip().startswith("redis+sentinel://"), url.read_text()
    assert oct(url.stat().st_mode)[-3:] == "600"


def _deploy_topology(tmp_path, url: str, **env_extra) -> tuple[list, list[int], list[int]]:
    """A primary, a replica and three sentinels started as the systemd units run them
    (deploy/bin/nonstop-redis-start, nonstop-sentinel-start) with ``url`` and
    ``env_extra``: (processes, node ports, sentinel ports); the caller stops them."""
    node_ports = [free_port(), free_port()]
    sentinel_ports = [int(h.rsplit(":", 1)[1]) for h in url.split("@")[1].split("/")[0].split(",")]
    procs = []
    conf = str(tmp_path / "redis.conf")  # a copy: the sentinels CONFIG REWRITE it
    shutil.copy(ROOT / "deploy/redis/nonstop-redis.conf", conf)
    for k, port in enumerate(node_ports):
        role = {
            "NONSTOP_REDIS_ROLE": "replica",
            "NONSTOP_REDIS_REPLICAOF": f"127.0.0.1:{node_ports[0]}",
        }
        env = dict(
            os.environ,
            NONSTOP_REDIS_URL=url,
            NONSTOP_REDIS_NODE_PORT=str(port),
            NONSTOP_REDIS_DIR=str(tmp_path / f"node{k}"),
            NONSTOP_REDIS_RUNTIME=str(tmp_path / f"run{k}"),
            **(role if k else {}),
            **env_extra,
        )
        procs.append(
            subprocess.Popen(
                ["sh", str(ROOT / "deploy/bin/nonstop-redis-start"), conf]
                + ["--logfile", str(tmp_path / f"node{k}.log")],
                env=env,
            )
        )
    for k, port in enumerate(sentinel_ports):
        env = dict(
            os.environ,
            NONSTOP_REDIS_URL=url,
            NONSTOP_SENTINEL_PORT=str(port),
            NONSTOP_REDIS_PRIMARY=f"127.0.0.1:{node_ports[0]}",
            NONSTOP_SENTINEL_DIR=str(tmp_path / f"sentinel{k}"),
            **env_extra,
        )
        log = ["--logfile", str(tmp_path / f"sentinel{k}.log")]
        procs.append(
            subprocess.Popen([str(ROOT / "deploy/bin/nonstop-sentinel-start"), *log], env=env)
        )
    return procs, node_ports, sentinel_ports


def _sentinel_url(user: str, password: str, ports: list[int]) -> str:
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    return f"redis+sentinel://{user}:{password}@{hosts}/nonstop/0"


def test_deploy_scripts_start_a_primary_replica_and_sentinels(tmp_path):
    """deploy/bin/nonstop-redis-start (primary, replica) and nonstop-sentinel-start, as the
    systemd units run them: the pools' sentinel URL reaches the primary, which refuses
    writes once its replica is gone; no password on a command line."""
    password = "0123abcd" * 4
    url = _sentinel_url("", password, [free_port() for _ in range(3)])
    procs, node_ports, _ = _deploy_topology(tmp_path, url)
    try:
        client = connect(url, startup_s=20)
        _wait(lambda: _in_sync(client), 20, lambda: "the replica never synced")
        client.set("k", "v")
        assert client.connection_pool.get_master_address() == ("127.0.0.1", node_ports[0])
        conf_file = tmp_path / "sentinel0" / "sentinel.conf"
        assert oct(conf_file.stat().st_mode)[-3:] == "600"
        for p in procs:
            assert password.encode() not in Path(f"/proc/{p.pid}/cmdline").read_bytes()
        procs[1].kill()  # the replica: the primary now refuses writes
        procs[1].wait()
        with pytest.raises(NotEnoughReplicas):
            _wait(lambda: connect(url, reconnect_s=1).set("k", "w") and False, 20)
    finally:
        stop_processes(procs)


def test_deploy_scripts_with_per_role_users_on_nodes_and_sentinels(tmp_path):
    """NONSTOP_REDIS_ACL_FILE (deploy/redis/users.acl plus an admin user of the
    operator's) on both scripts: the nodes load the users (no default user), the replica
    syncs as the URL's admin user, the sentinels know each other and log in to the nodes
    as it, each pool's user finds the primary through them and may do nothing else
    there; a SIGKILLed primary is failed over. Without a user in the URL: one line."""
    from pipeline.topology.acl import SENTINEL_RULES

    password = "0123abcd" * 4
    acl = (ROOT / "deploy" / "redis" / "users.acl").read_text()
    for role in ("actor", "preprocessor", "trainer", "operator", "evaluator"):
        acl = acl.replace(f"CHANGE-ME-{role}", f"pw-{role}")
    acl += f"user admin on >{password} ~* &* +@all\n"
    (tmp_path / "users.acl").write_text(acl)
    ports = [free_port() for _ in range(3)]
    env = {"NONSTOP_REDIS_ACL_FILE": str(tmp_path / "users.acl"), "NONSTOP_REDIS_MIN_REPLICAS": "0"}
    for script in ("nonstop-sentinel-start", "nonstop-redis-start"):
        bare = dict(os.environ, NONSTOP_REDIS_URL=_sentinel_url("", password, ports), **env)
        bare |= {"NONSTOP_SENTINEL_DIR": str(tmp_path / "x"), "NONSTOP_REDIS_PRIMARY": "h:1"}
        bare |= {"NONSTOP_REDIS_DIR": str(tmp_path / "y"), "NONSTOP_REDIS_RUNTIME": str(tmp_path)}
        args = [str(ROOT / "deploy/bin" / script)] + (["/dev/null"] if "redis" in script else [])
        out = subprocess.run(["sh", *args], env=bare, capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and "give NONSTOP_REDIS_URL the user" in out.stderr, out
    url = _sentinel_url("admin", password, ports)
    procs, node_ports, _ = _deploy_topology(tmp_path, url, **env)
    try:
        actor_url = _sentinel_url("actor", "pw-actor", ports)
        actor = connect(actor_url, startup_s=20, reconnect_s=60)
        admin = connect(url, startup_s=20)
        _wait(lambda: _in_sync(admin), 20, lambda: (tmp_path / "node1.log").read_text())
        assert actor.xadd("nonstop:acl:rollouts", {"f": "v"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            actor.xadd("nonstop:acl:batches", {"f": "v"})
        for port in ports:
            s = redis.Redis(port=port, username="actor", password="pw-actor", socket_timeout=2)
            assert int(s.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", "nonstop")[1])
            for command in ("SENTINEL SET nonstop quorum 1", "SENTINEL FAILOVER nonstop"):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    s.execute_command(command)
            with pytest.raises(redis.AuthenticationError):  # the default user is off
                redis.Redis(port=port, password=password, socket_timeout=2).ping()
        parsed = parse(url)
        _wait(lambda: failover_gap(parsed, 1) is None, 30, lambda: failover_gap(parsed, 1))
        procs[0].kill()  # the primary
        procs[0].wait()
        actor.xadd("nonstop:acl:rollouts", {"f": "w"})  # once the sentinels promoted node1
        assert actor.connection_pool.get_master_address() == ("127.0.0.1", node_ports[1])
        assert admin.xlen("nonstop:acl:rollouts") == 2
        conf = (tmp_path / "sentinel0" / "sentinel.conf").read_text()
        assert "user default off" in conf and "sentinel auth-user nonstop admin" in conf
        assert SENTINEL_RULES.split()[-1] in conf
    finally:
        stop_processes(procs)


def _in_sync(client) -> bool:
    info = client.info("replication")
    return any(isinstance(v, dict) and v.get("state") == "online" for v in info.values())


def test_inspect_shows_the_replication_state(ha, capsys):
    """pipeline.inspect in sentinel mode: the primary, each replica with its lag in bytes,
    and the sentinels that answer (one of them stopped here)."""
    from pipeline.inspect.cli import main

    client = connect(ha.url)
    client.set("k", "v" * 1000)
    assert client.execute_command("WAIT", 1, 30000) == 1
    ha.sentinel_procs[2].terminate()
    ha.sentinel_procs[2].wait()
    args = ["--url", ha.url, "--prefix", "nonstop", "--run", "r"]
    assert main(args + ["--json"]) == 0
    rep = json.loads(capsys.readouterr().out)["replication"]
    assert rep["primary"] == f"127.0.0.1:{ha.nodes[0].port}" and rep["role"] == "master"
    (replica,) = rep["replicas"]
    assert replica["address"] == f"127.0.0.1:{ha.nodes[1].port}"
    assert 0 <= replica["lag_bytes"] < 1000  # it acknowledged the 1000-byte write (WAIT)
    assert replica["state"] == "online" and rep["good_replicas"] == 1
    answering = [s for s in rep["sentinels"] if s["error"] is None]
    assert len(answering) == 2 and all(s["primary"] == rep["primary"] for s in answering)
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"primary 127.0.0.1:{ha.nodes[0].port}" in text
    assert re.search(rf"replica 127.0.0.1:{ha.nodes[1].port}: online, lag \d+ bytes", text)
    assert "sentinels answering: 2 of 3" in text and ha.password not in text


@pytest.mark.slow
def test_slurm_redis_job_in_sentinel_mode_survives_losing_the_primary(slurm, tmp_path):  # noqa: F811
    """deploy/slurm/redis.sbatch with redis.mode=sentinel on three nodes of a real
    single-host Slurm: a primary, a replica and three sentinels (deploy/slurm/redis-ha.sh);
    SIGKILL the primary and delete its data: the replica is promoted, the client carries
    on, the dead node's task restarts it as the new primary's replica, and the stopped job
    records which node is primary for the next one."""
    from tests.slurm_builders import sbatch, slurm_env, tail_of, wait_done

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    compose = subprocess.run(
        [sys.executable, "-m", "pipeline.launch", "+exp=tiny", "redis=ha", f"run_dir={run_dir}"]
        + ["--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    (run_dir / "config.yaml").write_text(compose.stdout)
    env = slurm_env(slurm, run_dir, tmp_path / "cache")
    out = tmp_path / "redis.out"
    job = sbatch(env, "redis.sbatch", out, "-N3", "-n3")
    try:
        _wait(lambda: (run_dir / "redis" / "url").exists(), 120, lambda: tail_of(out))
        url = (run_dir / "redis" / "url").read_text().strip()
        assert url.startswith("redis+sentinel://") and len(parse(url).sentinels) == 3
        client = connect(url, reconnect_s=60)
        client.set("k", "before")
        assert client.execute_command("WAIT", 1, 30000) == 1
        pid, old_dir = client.info("server")["process_id"], client.config_get("dir")["dir"]
        old = client.connection_pool.get_master_address()
        os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(old_dir)
        killed = time.monotonic()
        client.set("k2", "after")
        print(f"\nslurm: kill to first write on the new primary {time.monotonic() - killed:.1f} s")
        assert client.connection_pool.get_master_address() != old
        assert client.get("k") == b"before"
        _wait(lambda: _in_sync(client), 60, lambda: tail_of(out))  # the old node, a replica now
        node_file = run_dir / "redis" / "primary_node"  # recorded while running, not at the stop
        _wait(
            lambda: node_file.exists() and node_file.read_text().strip() == "1",
            30,
            lambda: tail_of(out),
        )
    finally:
        subprocess.run(["scancel", "--signal=TERM", job], env=env, timeout=30)
        wait_done(env, job, 90, out)
    assert "restarting redis node" in out.read_text(), tail_of(out)
    assert (run_dir / "redis" / "primary_node").read_text().strip() == "1"


def test_a_command_in_flight_gives_up_within_the_reconnect_budget(ha):
    """No primary left to promote (both nodes killed): a command in flight is retried for
    about redis.reconnect_s, then its error reaches the caller; a reconnect inside the
    retry is one try, not a second budget per retry (redis-py's own connect retries)."""
    client = connect(ha.url, reconnect_s=20)
    out: dict = {}
    reader = threading.Thread(target=_read_one, args=(client, out), daemon=True)
    reader.start()
    _wait(lambda: _blocked_clients(ha, ha.nodes[0]) > 0, 10, lambda: "the read did not block")
    for node in ha.nodes:
        os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait()
    t = time.monotonic()
    reader.join(120)
    waited = time.monotonic() - t
    print(f"\nno primary: the error reached the caller after {waited:.1f} s (budget 20 s)")
    assert isinstance(out.get("error"), redis.ConnectionError), out
    assert 10 < waited < 40, waited


def test_an_acl_user_authenticates_on_the_nodes_and_the_sentinels(ha):
    """redis+sentinel://USER:PASSWORD@...: the same ACL user on every node and sentinel;
    a user the sentinels do not know is refused in one line, password hidden."""
    for node in ha.nodes:
        ha.node_client(node).acl_setuser(
            "pool", enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"]
        )
    hosts = ",".join(f"127.0.0.1:{p}" for p in ha.sentinel_ports)
    url = f"redis+sentinel://pool:s3cret@{hosts}/nonstop/0"
    with pytest.raises(RedisRefused, match="sentinels of .* refused the credentials") as e:
        connect(url, startup_s=2)
    assert "s3cret" not in str(e.value)
    for port in ha.sentinel_ports:  # sentinels keep their own users (ACL SETUSER there)
        ha.sentinel_client(port).execute_command("ACL", "SETUSER", "pool", "on", ">s3cret", "+@all")
    client = connect(url, startup_s=5)
    client.set("k", "v")
    assert client.acl_whoami() == "pool"


def test_a_topology_not_ready_in_time_is_one_line(tmp_path):
    """The readiness wait is bounded: sentinels that cannot have found each other within
    0.5 s (they greet every 2 s) stop the start with one line naming what is missing,
    and nothing is left running."""
    topology = RedisHA(str(tmp_path / "redis"))
    with pytest.raises(RedisUnavailable, match="were not ready in 0 s: .*see the logs") as e:
        topology.start(timeout_s=0.5)
    assert "\n" not in str(e.value) and topology.password not in str(e.value)
    assert all(n.proc.poll() is not None for n in topology.nodes)
    assert all(p.poll() is not None for p in topology.sentinel_procs)


def test_a_node_that_cannot_start_leaves_the_primary_not_running(tmp_path):
    """The replica's port taken by a socket that never answers: start() fails, and the
    primary it had started is stopped with it (nothing of the topology left behind)."""
    import socket

    ha = RedisHA(str(tmp_path / "redis"))
    blocker = socket.create_server(("127.0.0.1", ha.nodes[1].port))
    try:
        with pytest.raises((RuntimeError, redis.RedisError)):
            ha.start(timeout_s=30)
    finally:
        blocker.close()
    primary = ha.nodes[0].proc
    assert primary is not None and primary.poll() is not None
    assert all(p is None for p in ha.sentinel_procs)  # never reached


@pytest.mark.parametrize("where", ["forming", "announcing"])
def test_an_interrupt_while_the_topology_starts_leaves_nothing_running(
    tmp_path, monkeypatch, where
):
    """Ctrl-C or SIGTERM (a KeyboardInterrupt in the launcher) while the primary, replica
    and sentinels come up, or after but before start_local_ha returned them to the
    launcher (which stops what it holds): every node and sentinel is stopped."""
    from pipeline.topology import ha as ha_mod

    ha = interrupted_start(monkeypatch, tmp_path, RedisHA, ha_mod, "start_local_ha", where)
    ran = [p for p in [n.proc for n in ha.nodes] + list(ha.sentinel_procs) if p is not None]
    assert ha.nodes[0].proc in ran and all(p.poll() is not None for p in ran), ran
