"""Redis over TLS (pipeline/redisd/tls.py): the embedded server on TLS only, one clear
line for a plain client or a wrong CA, the settings' checks, and the tiny pipeline over
TLS, embedded (redis.tls=true) and against an operator's TLS-only redis-server started
by deploy/bin/nonstop-redis-start with the shipped ACL users."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
import redis
from omegaconf import OmegaConf

from pipeline.config import (
    Config,
    check_embedded_tls,
    load_config,
    redis_tls,
    tls_files,
    validate,
)
from pipeline.launch import cli_recipe
from pipeline.redisd.server import EmbeddedRedis, free_port
from pipeline.redisd.tls import TLSFiles, make_run_certs, speaks_plain, speaks_tls
from pipeline.streams import RedisRefused, connect
from pipeline.topology.cluster import LocalCluster
from pipeline.topology.ha import RedisHA
from tests.launching import ROOT, run_tiny, tiny_cache
from tests.redis_builders import WatchRounds

TLS_ENV = ("NONSTOP_REDIS_TLS_CA", "NONSTOP_REDIS_TLS_CERT", "NONSTOP_REDIS_TLS_KEY")


@pytest.fixture
def tls_server(tmp_path, monkeypatch):
    """An EmbeddedRedis on TLS only, its certificates where the launcher puts them."""
    for var in TLS_ENV:
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "run"
    certs = make_run_certs(str(run_dir / "redis" / "tls"))
    server = EmbeddedRedis(str(run_dir / "redis"), tls=certs)
    server.start()
    (run_dir / "redis" / "port").write_text(f"{server.port}\n")
    (run_dir / "redis" / "auth").write_text(server.password + "\n")
    yield server, run_dir
    server.stop()


def _one_line(e: BaseException) -> str:
    """The error's message: one line, the password hidden."""
    msg = str(e)
    assert "\n" not in msg and ("***@" in msg or "@" not in msg), msg
    return msg


def test_the_embedded_tls_server_speaks_tls_only_and_its_files_are_private(tls_server):
    server, run_dir = tls_server
    folder = run_dir / "redis" / "tls"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["ca.crt", "client.crt", "client.key", "server.crt", "server.key"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())
    assert server.url.startswith("rediss://")
    client = connect(server.url, tls=server.client_tls)
    assert client.ping() and client.config_get("port") == {"port": "0"}  # no plain port
    assert client.config_get("tls-auth-clients") == {"tls-auth-clients": "yes"}
    assert not speaks_plain("127.0.0.1", server.port)  # PING in clear text gets no answer
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=server.port, password=server.password, socket_timeout=3).ping()
    recipe = cli_recipe(str(run_dir), server.port, server.client_tls)  # what the launcher prints
    assert "--tls --cacert" in recipe
    out = subprocess.run(f"{recipe} PING", shell=True, capture_output=True, text=True, timeout=10)
    assert out.stdout.strip() == "PONG", out.stderr


def test_a_plain_client_at_the_tls_server_gets_one_clear_line(tls_server):
    server, _ = tls_server
    with pytest.raises(RedisRefused) as info:
        connect(server.url.replace("rediss://", "redis://"), startup_s=8)
    msg = _one_line(info.value)
    assert f"redis at redis://***@127.0.0.1:{server.port}/0 speaks TLS" in msg
    assert "use rediss://" in msg and "redis.tls.ca" in msg


def test_the_launcher_says_it_in_one_line_and_exits_2(tls_server, tmp_path):
    server, _ = tls_server
    plain = server.url.replace("rediss://", "redis://")
    cmd = [sys.executable, "-m", "pipeline.launch", "+exp=tiny", f"run_dir={tmp_path / 'r'}"]
    out = subprocess.run(
        [*cmd, f"redis.url={plain}"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: redis at redis://***@")
    assert "speaks TLS: use rediss://" in out.stderr


def test_a_pool_with_a_wrong_ca_exits_4_with_one_line(tls_server, tmp_path):
    from tests.config_builders import actor_config

    server, _ = tls_server
    _, other = make_run_certs(str(tmp_path / "other"))
    env = dict(os.environ, NONSTOP_REDIS_URL=server.url, HF_HUB_OFFLINE="1")
    env.update(NONSTOP_CACHE=tiny_cache(tmp_path / "cache"), NONSTOP_RUN_SECRET="s" * 32)
    env.update(NONSTOP_REDIS_TLS_CA=other.ca, NONSTOP_REDIS_TLS_CERT=server.client_tls.cert)
    env["NONSTOP_REDIS_TLS_KEY"] = server.client_tls.key
    cmd = [sys.executable, "-m", "actor", "--config", actor_config(tmp_path, server.url)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out
    assert "Traceback" not in out and server.password not in out
    line = next(ln for ln in out.splitlines() if "certificate verify failed" in ln)
    assert f"NONSTOP_REDIS_TLS_CA={other.ca} does not sign the certificate of redis at" in line
    env["NONSTOP_REDIS_TLS_CA"] = str(tmp_path / "missing.crt")  # a file that is not there
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4 and "Traceback" not in out, out
    assert f"NONSTOP_REDIS_TLS_CA={tmp_path / 'missing.crt'} does not exist" in out


def test_a_wrong_ca_or_no_client_certificate_gets_one_clear_line(tls_server, tmp_path):
    server, _ = tls_server
    _, other = make_run_certs(str(tmp_path / "other"))
    wrong = TLSFiles(other.ca, server.client_tls.cert, server.client_tls.key)
    with pytest.raises(RedisRefused) as info:
        connect(server.url, tls=wrong, startup_s=8)
    msg = _one_line(info.value)
    assert msg.startswith(f"certificate verify failed: redis.tls.ca={other.ca} does not sign")
    assert "set redis.tls.ca (NONSTOP_REDIS_TLS_CA)" in msg
    no_ca = TLSFiles(cert=server.client_tls.cert, key=server.client_tls.key)
    with pytest.raises(RedisRefused) as info:
        connect(server.url, tls=no_ca, startup_s=8)
    assert "failed: no redis.tls.ca, and no CA this system trusts signs" in _one_line(info.value)
    with pytest.raises(RedisRefused) as info:
        connect(server.url, tls=TLSFiles(ca=server.client_tls.ca), startup_s=8)
    msg = _one_line(info.value)
    assert "asks for a client certificate; set redis.tls.cert and redis.tls.key" in msg


def test_a_tls_client_at_a_plain_server_gets_one_clear_line(redis_server):
    url = redis_server.url.replace("redis://", "rediss://")
    with pytest.raises(RedisRefused) as info:
        connect(url, tls=TLSFiles(), startup_s=12)
    assert "does not speak TLS: use redis://" in _one_line(info.value)


def test_inspect_reads_a_tls_run_dir(tls_server, capsys):
    from pipeline.inspect.cli import main

    server, run_dir = tls_server
    assert main(["--run-dir", str(run_dir), "--run", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"] == "nonstop:tiny"


def _cfg(**redis_keys):
    cfg = OmegaConf.structured(Config)
    for k, v in redis_keys.items():
        OmegaConf.update(cfg, f"redis.{k}", v)
    return cfg


def test_tls_settings_are_checked_with_the_key_and_the_fix(tmp_path, monkeypatch):
    for var in TLS_ENV:
        monkeypatch.delenv(var, raising=False)
    pem = tmp_path / "ca.crt"
    pem.write_text("x")
    with pytest.raises(ValueError, match="only redis.tls.cert is set: set both"):
        validate(_cfg(url="rediss://h:1/0", **{"tls.cert": str(pem)}))
    with pytest.raises(ValueError, match="redis.tls.ca name files for an external Redis"):
        check_embedded_tls(_cfg(**{"tls.ca": str(pem)}))  # the launcher, no redis.url
    cfg = _cfg(**{"tls.enabled": True})
    with pytest.raises(ValueError, match="redis.tls=true but the Redis URL is plain-text"):
        redis_tls(cfg, "redis://h:1/0")
    cfg = _cfg(**{"tls.ca": str(pem)})
    with pytest.raises(ValueError, match="redis.tls.ca set but the Redis URL is plain-text"):
        redis_tls(cfg, "redis://h:1/0")
    validate(_cfg(url="rediss://h:1/0", **{"tls.ca": str(pem)}))  # fine
    with pytest.raises(ValueError, match=r"redis.tls.ca=/nope/ca.crt does not exist"):
        tls_files(_cfg(url="rediss://h:1/0", **{"tls.ca": "/nope/ca.crt"}))
    monkeypatch.setenv("NONSTOP_REDIS_TLS_KEY", str(pem))
    with pytest.raises(ValueError, match="NONSTOP_REDIS_TLS_KEY is set but not redis.tls.cert"):
        tls_files(None)
    monkeypatch.delenv("NONSTOP_REDIS_TLS_KEY")
    monkeypatch.setenv("NONSTOP_REDIS_TLS_CA", str(pem))  # the environment wins
    files = redis_tls(_cfg(url="rediss://h:1/0", **{"tls.ca": "/nope"}), "rediss://h:1/0")
    assert files.ca == str(pem) and files.named("ca") == "NONSTOP_REDIS_TLS_CA"
    with pytest.raises(ValueError, match="NONSTOP_REDIS_TLS_CA set but the Redis URL is plain"):
        redis_tls(_cfg(), "redis://h:1/0")


def test_redis_tls_true_is_short_for_enabled(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("redis:\n  tls: true\n")
    assert load_config(str(path)).redis.tls.enabled is True
    path.write_text("redis:\n  tls: {}\n")
    assert load_config(str(path), ["redis.tls=true"]).redis.tls.enabled is True
    out = subprocess.run(  # the launcher's command line, composed by Hydra
        [sys.executable, "-m", "pipeline.launch", "+exp=tiny", "redis.tls=true", "--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert OmegaConf.create(out.stdout).redis.tls.enabled is True


def test_the_tiny_pipeline_on_an_embedded_tls_redis(tmp_path):
    run_dir = tmp_path / "run"
    code, out = run_tiny(tmp_path, run_dir, "redis.tls=true", "trainer.max_steps=2")
    assert code == 0, out
    assert "TLS only" in out and "--tls --cacert" in out  # the redis-cli line it prints
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_steps"] == 2 and summary["weight_updates_applied"]["actor-0"] >= 1
    assert summary["outcome"] == "finished"
    # the server had no plain port (test above): every pool spoke TLS with the run's files
    assert OmegaConf.load(run_dir / "config.yaml").redis.tls.enabled is True
    assert (run_dir / "redis" / "tls" / "client.key").stat().st_mode & 0o077 == 0


@pytest.mark.slow
def test_the_tiny_pipeline_on_a_tls_redis_cluster_with_two_partitions(tmp_path):
    """redis=cluster redis.tls=true redis.shards=2: every node on TLS only with the run's
    certificates, the pools reach both partitions over rediss+cluster://."""
    run_dir = tmp_path / "run"
    code, out = run_tiny(
        tmp_path,
        run_dir,
        "redis=cluster",
        "redis.tls=true",
        "redis.shards=2",
        "trainer.max_steps=2",
        timeout=400,
    )
    assert code == 0, out[-3000:]
    assert "TLS only, certificates in" in out and "--tls --cacert" in out  # its redis-cli line
    assert "2 partition(s)" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_steps"] == 2 and summary["weight_updates_applied"]["actor-0"] >= 1
    assert summary["outcome"] == "finished"
    assert summary["accounting"]["groups_lost"] == 0, summary["accounting"]
    assert (run_dir / "redis" / "url").read_text().startswith("rediss+cluster://")
    # the nodes had no plain port (test_cluster_mode_over_tls_...): every pool spoke TLS
    assert OmegaConf.load(run_dir / "config.yaml").redis.tls.enabled is True
    assert (run_dir / "redis" / "tls" / "client.key").stat().st_mode & 0o077 == 0


ROLES = ("actor", "preprocessor", "trainer", "operator")


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_the_tiny_pipeline_over_tls_with_the_shipped_acl_users(tmp_path):
    """An operator's Redis as deploy/ starts it (nonstop-redis-start with a rediss://
    URL: TLS only, client certificates required) with deploy/redis/users.acl; each pool
    reaches it as its own user over TLS, files from NONSTOP_REDIS_TLS_*."""
    server, client = make_run_certs(str(tmp_path / "tls"))
    acl = (ROOT / "deploy" / "redis" / "users.acl").read_text()
    for role in ROLES:
        acl = acl.replace(f"CHANGE-ME-{role}", f"pw-{role}")
    (tmp_path / "users.acl").write_text(acl)
    port = free_port()
    env = dict(
        os.environ,
        NONSTOP_REDIS_URL=f"rediss://:unused-default@127.0.0.1:{port}/0",
        NONSTOP_REDIS_DIR=str(tmp_path / "redis-data"),
        NONSTOP_REDIS_RUNTIME=str(tmp_path / "redis-run"),
        NONSTOP_REDIS_SERVER=shutil.which("redis-server"),
        NONSTOP_REDIS_TLS_CA=server.ca,
        NONSTOP_REDIS_TLS_SERVER_CERT=server.cert,
        NONSTOP_REDIS_TLS_SERVER_KEY=server.key,
    )
    cmd = [str(ROOT / "deploy" / "bin" / "nonstop-redis-start")]
    cmd += [str(ROOT / "deploy" / "redis" / "nonstop-redis.conf"), "--aclfile"]
    cmd += [str(tmp_path / "users.acl"), "--appendfsync", "everysec", "--maxmemory", "1gb"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    urls = {r: f"rediss://{r}:pw-{r}@127.0.0.1:{port}/0" for r in ROLES}
    try:
        connect(urls["operator"], tls=client, startup_s=15).close()
        assert not speaks_plain("127.0.0.1", port)
        pools = {f"NONSTOP_REDIS_URL_{r.upper()}": urls[r] for r in ROLES[:3]}
        code, out = run_tiny(
            tmp_path,
            tmp_path / "run",
            f"redis.url={urls['operator']}",
            "trainer.max_steps=2",
            f"redis.tls.cert={client.cert}",  # the config's, beside the environment's CA
            f"redis.tls.key={client.key}",
            env_extra={"NONSTOP_REDIS_TLS_CA": client.ca, **pools},
        )
        assert code == 0, out
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["trainer_steps"] == 2 and summary["weight_updates_applied"]["actor-0"] >= 1
        actor = connect(urls["actor"], tls=client)
        with pytest.raises(redis.exceptions.NoPermissionError):
            actor.xadd("nonstop:tiny:batches", {"data": b"x"})
    finally:
        proc.terminate()
        proc.wait(30)


# ------------------------------------------------- sentinel and cluster mode over TLS


def _until(check, timeout_s: float, why=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, why()
        time.sleep(0.1)


def _tls_only(kind, folder, monkeypatch):
    """A started ``kind`` (RedisHA or LocalCluster) on TLS only with certificates of its
    own in ``folder``/tls; no NONSTOP_REDIS_TLS_* of the caller's leaks into it."""
    for var in TLS_ENV:
        monkeypatch.delenv(var, raising=False)
    topology = kind(str(folder), tls=make_run_certs(str(folder / "tls")))
    topology.start()
    return topology


@pytest.fixture
def tls_ha(tmp_path, monkeypatch):
    """redis=ha redis.tls=true's topology: a primary, a replica, three sentinels, TLS only."""
    ha = _tls_only(RedisHA, tmp_path / "ha", monkeypatch)
    yield ha
    ha.stop()


@pytest.fixture
def tls_cluster(tmp_path, monkeypatch):
    """redis=cluster redis.tls=true's cluster: 3 primaries with a replica each, TLS only."""
    local = _tls_only(LocalCluster, tmp_path / "cluster", monkeypatch)
    yield local
    local.stop()


def test_sentinel_mode_over_tls_follows_a_failover(tls_ha):
    """Every node and sentinel speaks TLS only; a rediss+sentinel:// client (CA, client
    certificate) finds the primary, and after a SIGKILL of the primary (its data deleted)
    the same client writes to the promoted replica; the lost node comes back as its
    replica, replicating over TLS."""
    ha, files = tls_ha, tls_ha.client_tls
    assert ha.url.startswith("rediss+sentinel://")
    for port in [n.port for n in ha.nodes] + ha.sentinel_ports:
        assert speaks_tls("127.0.0.1", port) and not speaks_plain("127.0.0.1", port), port
    client = connect(ha.url, reconnect_s=60, tls=files)
    old = ha.nodes[0]
    assert client.connection_pool.get_master_address() == ("127.0.0.1", old.port)
    for i in range(10):
        client.xadd("s", {"i": i})
    assert client.execute_command("WAIT", 1, 2000) == 1  # the replica has them, over TLS
    os.kill(old.proc.pid, signal.SIGKILL)
    old.proc.wait()
    shutil.rmtree(old.data_dir)
    killed, lines = time.monotonic(), []
    rounds = WatchRounds(ha, lines)
    try:
        client.xadd("s", {"i": 10})  # retried until the sentinels name the new primary
        first_write_s = time.monotonic() - killed
        _until(lambda: ha.not_ready() is None, 30, lambda: f"{ha.not_ready()} {lines}")
    finally:
        rounds.stop()
    print(f"\nTLS sentinel mode: kill to first write on the new primary {first_write_s:.2f} s")
    assert client.connection_pool.get_master_address() == ("127.0.0.1", ha.nodes[1].port)
    assert [int(e[1][b"i"]) for e in client.xrange("s")] == list(range(11))
    role = ha.node_client(old).execute_command("ROLE")  # back as a replica, over TLS
    assert role[0] == b"slave" and role[2] == ha.nodes[1].port
    # replication is asynchronous: the node back as a replica catches up moments after it
    # reports its role (a loaded CI run read 10 of 11 at once)
    _until(lambda: ha.node_client(old).xlen("s") == 11, 30, lambda: ha.node_client(old).xlen("s"))


def test_cluster_mode_over_tls_follows_a_failover(tls_cluster):
    """Every node speaks TLS only, its cluster bus too (tls-cluster); a rediss+cluster://
    client follows a primary's SIGKILL to its promoted replica, and the lost node comes
    back, empty, as that node's replica (replication and CLUSTER MEET over TLS)."""
    local, files = tls_cluster, tls_cluster.client_tls
    assert local.url.startswith("rediss+cluster://")
    for node in local.nodes:
        for port in (node.port, node.port + 10000):  # the client port and the cluster bus
            assert speaks_tls("127.0.0.1", port) and not speaks_plain("127.0.0.1", port), port
    client = connect(local.url, reconnect_s=60, tls=files)
    key = "{p0}:s"
    for i in range(10):
        client.xadd(key, {"i": i})
    k = next(i for i, n in enumerate(local.nodes) if n.port == client.get_node_from_key(key).port)
    replica = next(r for r, p in local.replica_of.items() if p == k)
    victim = local.nodes[k]
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    shutil.rmtree(victim.data_dir)
    killed, lines = time.monotonic(), []
    rounds = WatchRounds(local, lines)
    try:
        client.xadd(key, {"i": 10})
        first_write_s = time.monotonic() - killed
        _until(lambda: local.not_ready() is None and not local.down_since, 40, lambda: lines)
    finally:
        rounds.stop()
    print(f"\nTLS cluster mode: kill to first write on the promoted replica {first_write_s:.2f} s")
    assert client.get_node_from_key(key).port == local.nodes[replica].port
    assert [int(f[b"i"]) for _, f in client.xrange(key)] == list(range(11))
    role = local.node_client(victim).execute_command("ROLE")
    assert role[0] == b"slave" and role[2] == local.nodes[replica].port


def test_sentinel_and_cluster_tls_mismatches_are_one_line(tls_ha, tls_cluster, tmp_path):
    """A plain-text client at the TLS-only sentinels or cluster nodes, and a CA that does
    not sign their certificates: one line each (redis_tls.explain), naming the fix."""
    _, other = make_run_certs(str(tmp_path / "other"))
    for url, files, plain in (
        (tls_ha.url, tls_ha.client_tls, "redis+sentinel"),
        (tls_cluster.url, tls_cluster.client_tls, "redis+cluster"),
    ):
        with pytest.raises(RedisRefused) as info:
            connect(url.replace("rediss+", "redis+"), startup_s=8)
        msg = _one_line(info.value)
        assert f"({plain}://***@127.0.0.1:" in msg and " speaks TLS: use rediss+" in msg, msg
        assert "redis.tls.ca (NONSTOP_REDIS_TLS_CA)" in msg
        wrong = TLSFiles(other.ca, files.cert, files.key)
        with pytest.raises(RedisRefused) as info:
            connect(url, tls=wrong, startup_s=8)
        msg = _one_line(info.value)
        assert msg.startswith(f"certificate verify failed: redis.tls.ca={other.ca} does not sign")
        assert f"(rediss+{plain.split('+')[1]}://***@" in msg, msg
        with pytest.raises(RedisRefused) as info:  # no client certificate
            connect(url, tls=TLSFiles(ca=files.ca), startup_s=8)
        assert "asks for a client certificate" in _one_line(info.value)


def test_inspect_reads_tls_sentinel_and_cluster_run_dirs(tls_ha, tls_cluster, capsys):
    """pipeline.inspect --run-dir of a redis=ha or redis=cluster run on TLS: the URL from
    redis/url, the run's client files from redis/tls; the sentinels answer over TLS."""
    from pipeline.inspect.cli import main

    for topology in (tls_ha, tls_cluster):
        run_dir = os.path.dirname(topology.data_dir)
        rd = os.path.join(run_dir, "run-" + os.path.basename(topology.data_dir))
        os.makedirs(os.path.join(rd, "redis"))
        shutil.copytree(os.path.join(topology.data_dir, "tls"), os.path.join(rd, "redis", "tls"))
        with open(os.path.join(rd, "redis", "url"), "w") as f:
            f.write(topology.url + "\n")
        assert main(["--run-dir", rd, "--prefix", "nonstop", "--run", "r", "--json"]) == 0
        snap = json.loads(capsys.readouterr().out)
        if topology is tls_ha:
            rep = snap["replication"]
            assert rep["primary"] == f"127.0.0.1:{tls_ha.nodes[0].port}", rep
            assert [s["error"] for s in rep["sentinels"]] == [None] * 3, rep
            assert rep["replicas"][0]["state"] == "online"
        else:
            assert snap["run"] == "nonstop:{r}" and snap["redis"]["version"], snap  # over TLS
        args = ["--url", topology.url, "--tls-ca", topology.client_tls.ca, "--run", "r"]
        args += ["--tls-cert", topology.client_tls.cert, "--tls-key", topology.client_tls.key]
        assert main(args) == 0 and topology.password not in capsys.readouterr().out


def test_the_tiny_pipeline_on_redis_ha_over_tls(tmp_path):
    """redis=ha redis.tls=true: the launcher starts the primary, replica and sentinels on
    TLS only with the run's certificates, and every pool runs through them."""
    run_dir = tmp_path / "run"
    code, out = run_tiny(tmp_path, run_dir, "redis=ha", "redis.tls=true", timeout=500)
    assert code == 0, out[-3000:]
    assert "sentinels on" in out and "TLS only" in out and "--tls --cacert" in out
    assert (run_dir / "redis" / "url").read_text().startswith("rediss+sentinel://")
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["outcome"] == "finished" and summary["trainer_steps"] == 4, summary
    assert acc["groups_lost"] == 0 and acc["groups_duplicated"] == 0, acc
