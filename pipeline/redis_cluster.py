"""``redis=cluster``: a local Redis Cluster of 3 primaries with a replica each for one
run, on loopback (tests and demos; an operator's cluster is a redis+cluster:// URL).

Each node is an :class:`~pipeline.redis_server.EmbeddedRedis` (per-run password, AOF
with ``appendfsync always``, ``noeviction``, loopback only) under ``RUN_DIR/redis/
node-K`` with ``cluster-enabled yes`` and its own ``nodes.conf``; ``redis-cli --cluster
create ... --cluster-replicas 1`` joins them (the password reaches redis-cli in its
environment, ``REDISCLI_AUTH``, never on a command line). A primary silent for
``cluster-node-timeout`` (:data:`NODE_TIMEOUT_MS`) is failed over to its replica by the
other primaries; the pools' client (pipeline/streams/cluster.py) follows.

A dead node is not restarted (:meth:`LocalCluster.watch`, called by the supervisor, says
so and reports the promotion): after a failover its partitions are served by the
promoted replica, which has no replica of its own for the rest of the run.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable

import redis

from pipeline.redis_server import EmbeddedRedis, free_port
from pipeline.streams import RedisUnavailable
from pipeline.streams.cluster import format_url, gap

NODE_TIMEOUT_MS = 2000  # cluster-node-timeout: a primary silent this long is failed over


class LocalCluster:
    """Start with :meth:`start`, stop with :meth:`stop`; ``url`` (password included) is
    the redis+cluster:// URL for the pools."""

    def __init__(
        self,
        data_dir: str,
        appendfsync: str = "always",
        primaries: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = NODE_TIMEOUT_MS,
    ):
        self.data_dir = os.path.abspath(data_dir)
        self.primaries, self.replicas = primaries, replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes = [
            EmbeddedRedis(os.path.join(self.data_dir, f"node-{k}"), appendfsync, port=bus_port())
            for k in range(primaries * (1 + replicas))
        ]
        self.password = self.nodes[0].password
        for node in self.nodes:
            node.password = self.password  # one per-run password for every node
            node.extra_args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",  # in the node's --dir
                "--cluster-node-timeout", str(node_timeout_ms),
                "--masterauth", self.password,
                "--repl-diskless-sync-delay", "0",
            ]  # fmt: skip
        self.down_since: dict[int, float] = {}  # node index -> when it was found dead
        self.reported: set[int] = set()  # failovers already reported
        self.replica_of: dict[int, int] = {}  # replica index -> primary index (at start)

    @property
    def url(self) -> str:
        return format_url([("127.0.0.1", n.port) for n in self.nodes], self.password)

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the nodes, create the cluster and wait, at most ``timeout_s``, until every
        node sees it whole and every replica is in sync; RedisUnavailable (one line: the
        launcher exits 2 with it) naming what is missing otherwise."""
        exe = shutil.which("redis-cli")
        if exe is None:
            raise ValueError(
                "redis-cli is not installed: run `make setup` (or `apt-get install redis-tools`)"
            )
        for node in self.nodes:
            node.start()
        cmd = [exe, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes)]
        cmd += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        env = dict(os.environ, REDISCLI_AUTH=self.password)
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RedisUnavailable(
                f"redis-cli --cluster create did not finish in {timeout_s:.0f} s; see the "
                f"logs in {self.data_dir}/node-*/redis.log"
            ) from None
        if out.returncode != 0:
            self.stop()
            last = (out.stdout + out.stderr).strip().splitlines()[-1:] or ["no output"]
            raise RedisUnavailable(
                f"redis-cli --cluster create failed ({out.returncode}): {last[0]}; see the "
                f"logs in {self.data_dir}/node-*/redis.log"
            )
        deadline, missing = time.monotonic() + timeout_s, "nothing checked"
        while time.monotonic() < deadline:
            missing = self.not_ready()
            if missing is None:
                self.replica_of = self.pairs()
                want = self.primaries * self.replicas
                if len(self.replica_of) == want:
                    return
                missing = f"node-0 knows {len(self.replica_of)} of {want} replicas"
            time.sleep(0.2)
        self.stop()
        raise RedisUnavailable(
            f"the local Redis Cluster was not ready in {timeout_s:.0f} s: {missing}; see the "
            f"logs in {self.data_dir}/node-*/redis.log"
        )

    def node_client(self, node: EmbeddedRedis, timeout_s: float = 2.0) -> redis.Redis:
        return node.client(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def live(self) -> list[EmbeddedRedis]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def not_ready(self) -> str | None:
        """None when every live node sees the cluster whole and every live replica's
        link to its primary is up, else what is missing (one phrase)."""
        for node in self.live():
            try:
                c = self.node_client(node)
                info = cluster_info(c)
                repl = c.info("replication")
            except redis.RedisError as e:
                return f"node on port {node.port} does not answer ({e})"
            why = gap(info)
            if why is not None:
                return f"node on port {node.port} says {why}"
            if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                return f"the replica on port {node.port} is not in sync with its primary"
        return None

    def roles(self) -> dict[int, str]:
        """node index -> "primary" or "replica", as each live node says (ROLE)."""
        out = {}
        for k, node in enumerate(self.nodes):
            if node.proc is None or node.proc.poll() is not None:
                continue
            try:
                role = self.node_client(node, 1.0).execute_command("ROLE")[0]
            except redis.RedisError:
                continue
            out[k] = "primary" if role in (b"master", "master") else "replica"
        return out

    def stop(self, timeout_s: float = 10.0) -> None:
        for node in self.nodes:
            node.stop(timeout_s)

    def watch(self, say: Callable[[str], None], event: Callable[..., None]) -> None:
        """One supervision round: report a node found dead (once) and, for a dead primary,
        the replica promoted in its place; the dead node is not restarted (module)."""
        dead = [
            k for k, n in enumerate(self.nodes) if n.proc is not None and n.proc.poll() is not None
        ]
        for k in dead:
            node = self.nodes[k]
            if k in self.down_since:
                continue
            self.down_since[k] = time.monotonic()
            event("exit", f"redis-node{k}", code=node.proc.returncode)
            say(
                f"redis cluster node-{k} (port {node.port}) exited with {node.proc.returncode};"
                " not restarting it (a replica takes over a primary's slots)"
            )
        if not self.down_since:
            return
        promoted = self.promoted()
        for k, since in list(self.down_since.items()):
            if k in self.reported or k not in promoted:
                continue
            self.reported.add(k)
            new = promoted[k]
            waited = time.monotonic() - since
            say(
                f"redis cluster promoted node-{new} (port {self.nodes[new].port}) in place of "
                f"node-{k} {waited:.1f} s after it was found dead"
            )
            event("failover", f"redis-node{new}", after_s=round(waited, 1))

    def promoted(self) -> dict[int, int]:
        """dead node's index -> the index of its replica that is a primary now."""
        roles = self.roles()
        return {
            dead: peer
            for peer, dead in self.replica_of.items()
            if dead in self.down_since and roles.get(peer) == "primary"
        }

    def pairs(self) -> dict[int, int]:
        """replica index -> its primary's index, from a live node's CLUSTER NODES (which
        redis-py parses into {"host:port": {"node_id", "master_id", ...}})."""
        by_port = {n.port: k for k, n in enumerate(self.nodes)}
        table = self.node_client(self.live()[0]).execute_command("CLUSTER NODES")
        index = {v["node_id"]: by_port.get(int(a.rsplit(":", 1)[1])) for a, v in table.items()}
        return {
            index[v["node_id"]]: index[v["master_id"]]
            for v in table.values()
            if v.get("master_id", "-") != "-" and v["master_id"] in index
        }


def bus_port(tries: int = 200) -> int:
    """A free port P with P + 10000 free too (a cluster node's bus port), so P <= 55535."""
    for _ in range(tries):
        port = free_port()
        if port > 55535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RedisUnavailable("no free port pair (P, P + 10000) on loopback for a cluster node")


def cluster_info(client: redis.Redis) -> dict[str, str]:
    """CLUSTER INFO as a dict of strings."""
    text = client.execute_command("CLUSTER INFO")
    if isinstance(text, dict):
        return {k: str(v) for k, v in text.items()}
    if isinstance(text, bytes):
        text = text.decode()
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def start_local_cluster(cfg, run_dir: str) -> LocalCluster:
    """``redis=cluster`` in the launcher: start the cluster under ``RUN_DIR/redis`` and
    write the password (``redis/auth``) and the cluster URL (``redis/url``, read by
    ``pipeline.inspect --run-dir`` and the faults bench), both mode 0600."""
    d = os.path.join(run_dir, "redis")
    local = LocalCluster(d, cfg.redis.embedded_appendfsync)
    local.start()
    for name, text in (("auth", local.password), ("url", local.url)):
        with open(
            os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w"
        ) as f:
            f.write(text + "\n")
    roles = local.roles()
    nodes = ", ".join(f"node-{k} :{n.port} {roles.get(k, '?')}" for k, n in enumerate(local.nodes))
    print(
        f"local redis cluster on 127.0.0.1 ({nodes}; password in {d}/auth, cluster URL in "
        f"{d}/url, AOF in {d}/node-*), {cfg.redis.shards} partition(s) of the work streams\n"
        f'  redis-cli: redis-cli -c -p {local.nodes[0].port} -a "$(cat {d}/auth)" '
        "--no-auth-warning cluster info"
    )
    return local
