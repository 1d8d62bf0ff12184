"""Redis servers built for tests: one with the shipped ACL users, less a command
(tests/test_redis_errors.py, tests/test_durable.py); the supervisor's rounds over a
local sentinel or cluster topology in a thread (tests/test_redis_ha.py, test_redis_cluster.py,
test_redis_tls.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from pipeline.redisd.server import free_port
from pipeline.streams import connect
from tests.launching import ROOT


def acl_server(tmp_path, drop: str = "") -> dict[str, str]:
    """A redis-server loading deploy/redis/users.acl (``drop`` removed from the actor's
    line, e.g. " +xadd"); URLs per role. The caller stops ``urls['proc']``."""
    lines = (ROOT / "deploy" / "redis" / "users.acl").read_text().splitlines()
    lines = [ln.replace(drop, "") if drop and ln.startswith("user actor ") else ln for ln in lines]
    acl = "\n".join(lines) + "\n"
    for role in ("actor", "preprocessor", "trainer", "operator"):
        acl = acl.replace(f"CHANGE-ME-{role}", f"pw-{role}")
    (tmp_path / "users.acl").write_text(acl)
    port = free_port()
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    cmd += ["--appendonly", "no", "--dir", str(tmp_path), "--aclfile", str(tmp_path / "users.acl")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    urls = {r: f"redis://{r}:pw-{r}@127.0.0.1:{port}/0" for r in ROLES}
    connect(urls["operator"], startup_s=10.0).close()
    return {"proc": proc, **urls}


ROLES = ("actor", "preprocessor", "trainer", "operator")


class WatchRounds:
    """The supervisor's rounds (RedisHA.watch, LocalCluster.watch) over ``topology`` in a
    thread, as the launcher runs them: a dead node is brought back as a replica."""

    def __init__(self, topology, lines: list[str]):
        self.done = threading.Event()

        def loop():
            while not self.done.is_set():
                topology.watch(lines.append, lambda *a, **k: None)
                time.sleep(0.2)

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def stop(self):
        self.done.set()
        self.thread.join(30)


def pool_start_line(url: str) -> subprocess.CompletedProcess:
    """What a pool prints and returns when ``connect(url)`` fails at start-up: one
    ``error:`` line and exit 2 (the caller asserts on it)."""
    code = (
        "from pipeline.streams import connect, RedisUnavailable\n"
        "import sys\n"
        "try:\n    connect(sys.argv[1], startup_s=1)\n"
        "except RedisUnavailable as e:\n    print(f'error: {e}'); sys.exit(2)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, url], capture_output=True, text=True, cwd=ROOT, timeout=30
    )


def acl_cluster(tmp_path, drop: str = "", role: str = "actor"):
    """A 6-node redis=cluster (pipeline/topology/cluster.py LocalCluster) loading
    deploy/redis/users.acl on every node, ``pw-<role>`` passwords (``drop`` removed from
    ``role``'s line). Returns (the LocalCluster, redis+cluster:// URLs per role); the
    caller stops the cluster."""
    from pipeline.streams.cluster import format_url
    from pipeline.topology.cluster import LocalCluster

    lines = (ROOT / "deploy" / "redis" / "users.acl").read_text().splitlines()
    lines = [
        ln.replace(drop, "") if drop and ln.startswith(f"user {role} ") else ln for ln in lines
    ]
    acl = "\n".join(lines) + "\n"
    for r in ROLES:
        acl = acl.replace(f"CHANGE-ME-{r}", f"pw-{r}")
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "users.acl").write_text(acl)
    local = LocalCluster(str(tmp_path / "cluster"), acl_file=str(tmp_path / "users.acl"))
    local.start()
    nodes = [("127.0.0.1", n.port) for n in local.nodes]
    return local, {r: format_url(nodes, f"pw-{r}", r) for r in ROLES}


def tiny_run_as_role_users(tmp_path, topology: str, parse, nodes) -> tuple[set[str], object]:
    """The tiny pipeline on ``topology`` (``redis=cluster`` or ``redis=ha``) with
    ``redis.acl_file=deploy/redis/users.acl``: after the first step, the users connected
    to the nodes ``nodes(admin)`` names (``admin``: the run's redis/url, ``parse``d;
    CLIENT LIST as the launcher's user). Asserts the run finished, 4 steps, 0 groups lost or
    duplicated, the launcher naming the pools' users; returns (users, run directory)."""
    import json

    import redis

    from pipeline.topology.acl import ADMIN
    from tests.launching import launch_tiny, wait_for_step

    run_dir = tmp_path / "run"
    acl = ROOT / "deploy" / "redis" / "users.acl"
    proc = launch_tiny(tmp_path, run_dir, topology, f"redis.acl_file={acl}")
    try:
        wait_for_step(run_dir, proc, timeout=300)
        admin = parse((run_dir / "redis" / "url").read_text().strip())
        assert admin.username == ADMIN
        users = set()
        for host, port in nodes(admin):
            node = redis.Redis(host, port, username=admin.username, password=admin.password)
            users |= {c["user"] for c in node.client_list()}
            node.close()
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert {"actor", "preprocessor", "trainer"} <= users, users
    assert proc.returncode == 0, out[-3000:]
    assert "the pools connect as actor, evaluator, preprocessor, trainer" in out, out[:3000]
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["outcome"] == "finished" and summary["trainer_steps"] == 4, summary
    assert acc["groups_lost"] == 0 and acc["groups_duplicated"] == 0, acc
    return users, run_dir


def interrupted_start(monkeypatch, tmp_path, cls, module, begin: str, where: str):
    """Run ``module.begin`` (start_local_cluster, start_local_ha) with a KeyboardInterrupt
    (the launcher's Ctrl-C or SIGTERM) raised while ``cls`` forms (``where="forming"``:
    its readiness check) or once formed, as its files are written (``"announcing"``);
    the ``cls`` instance it started, for the caller to check that nothing runs."""
    import pytest
    from omegaconf import OmegaConf

    from pipeline.config import Config

    started, real_start = [], cls.start

    def interrupt(*a, **kw):
        raise KeyboardInterrupt

    def start(self, *a, **kw):
        started.append(self)
        real_start(self, *a, **kw)
        if where == "announcing":
            monkeypatch.setattr(module, "write_private", interrupt)

    monkeypatch.setattr(cls, "start", start)
    if where == "forming":
        monkeypatch.setattr(cls, "not_ready", interrupt)
    cfg = OmegaConf.structured(Config)
    cfg.redis.embedded_appendfsync = "everysec"
    with pytest.raises(KeyboardInterrupt):
        getattr(module, begin)(cfg, str(tmp_path / "run"))
    [topology] = started
    return topology
