"""Redis servers built for tests: one with the shipped ACL users, less a command
(tests/test_redis_errors.py, tests/test_durable.py)."""

from __future__ import annotations

import subprocess

from pipeline.redis_server import free_port
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


def acl_cluster(tmp_path, drop: str = "", role: str = "actor"):
    """A 6-node redis=cluster (pipeline/redis_cluster.py LocalCluster) loading
    deploy/redis/users.acl on every node, ``pw-<role>`` passwords (``drop`` removed from
    ``role``'s line). Returns (the LocalCluster, redis+cluster:// URLs per role); the
    caller stops the cluster."""
    from pipeline.redis_cluster import LocalCluster
    from pipeline.streams.cluster import format_url

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
