"""``redis=cluster``: a local Redis Cluster of 3 primaries with a replica each for one
run, on loopback (tests and demos; an operator's cluster is a redis+cluster:// URL).

Each node is an :class:`~pipeline.redisd.server.EmbeddedRedis` (per-run password, AOF
with ``appendfsync always``, ``noeviction``, loopback only) under ``RUN_DIR/redis/
node-K`` with ``cluster-enabled yes`` and its own ``nodes.conf``; ``redis-cli --cluster
create ... --cluster-replicas 1`` joins them (the password reaches redis-cli in its
environment, ``REDISCLI_AUTH``, never on a command line). A primary silent for
``cluster-node-timeout`` (:data:`NODE_TIMEOUT_MS`) is failed over to its replica by the
other primaries; the pools' client (pipeline/streams/cluster.py) follows. With
``redis.tls=true`` every node is on TLS only with the run's certificates
(RUN_DIR/redis/tls): clients, replication (``tls-replication``) and the cluster bus
(``tls-cluster``); the URL is ``rediss+cluster://``.

A dead node is restarted as a replica (:meth:`LocalCluster.watch`, called by the
supervisor): a dead primary once the cluster has promoted its replica, as the replica of
that node, so every primary has a replica again; a dead replica under its primary. A
node whose data directory was lost comes back empty under a new id and is introduced
(CLUSTER MEET, CLUSTER REPLICATE); one that kept its ``nodes.conf`` rejoins by itself.

With ``redis.acl_file`` (per-role users, deploy/redis/users.acl) every node loads those
users with per-run passwords (pipeline/topology/acl.py) plus its ``ADMIN``, the launcher's,
redis-cli's and the replicas' user (``user default off`` leaves no other); each pool
connects as its role's user (``LocalCluster.role_urls``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable

import redis

from pipeline.redisd.server import LOWEST_PORT, EmbeddedRedis, ephemeral_range, free_port
from pipeline.redisd.tls import TLSFiles, make_run_certs, write_private
from pipeline.streams import RedisUnavailable
from pipeline.streams.cluster import format_url, gap
from pipeline.topology.acl import ADMIN, POOL_ROLES, per_run_users, write_node_acl

log = logging.getLogger(__name__)

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
        tls: tuple[TLSFiles, TLSFiles] | None = None,
        acl_file: str | None = None,
    ):
        self.data_dir = os.path.abspath(data_dir)
        # (server, client) files: every node on TLS only, the cluster bus and replication
        # included (tls-cluster, tls-replication; redis.tls=true)
        self.server_tls, self.client_tls = tls if tls else (None, None)
        self.acl_file = acl_file
        self.primaries, self.replicas = primaries, replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes = [
            EmbeddedRedis(
                os.path.join(self.data_dir, f"node-{k}"), appendfsync, port=bus_port(), tls=tls
            )
            for k in range(primaries * (1 + replicas))
        ]
        self.password = self.nodes[0].password
        # with an ACL file (its users, e.g. deploy/redis/users.acl with `user default off`):
        # the launcher, redis-cli and the replicas' link to their primary use ADMIN
        self.username = ADMIN if acl_file else ""
        for node in self.nodes:
            node.password = self.password  # one per-run password for every node
            node.username = self.username
            node.extra_args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",  # in the node's --dir
                "--cluster-node-timeout", str(node_timeout_ms),
                "--masterauth", self.password,
                "--repl-diskless-sync-delay", "0",
            ] + (["--tls-cluster", "yes"] if tls else [])  # fmt: skip
            if acl_file:
                path = os.path.join(node.data_dir, "users.acl")  # the node's own (ACL SAVE)
                node.extra_args += ["--aclfile", path, "--masteruser", ADMIN]
        self.down_since: dict[int, float] = {}  # node index -> when it was found dead
        self.reported: set[int] = set()  # failovers already reported
        self.replica_of: dict[int, int] = {}  # replica index -> primary index (kept current)
        self.ids: dict[int, str] = {}  # node index -> cluster node id
        self.role_urls: dict[str, str] = {}  # redis.acl_file: pool role -> its user's URL

    @property
    def url(self) -> str:
        return format_url(
            [("127.0.0.1", n.port) for n in self.nodes],
            self.password,
            self.username,
            tls=self.server_tls is not None,
        )

    def _write_acl(self, nodes: list[EmbeddedRedis]) -> None:
        """Each node's ACL file: ``acl_file``'s users and ADMIN (acl.py)."""
        write_node_acl(self.acl_file, [n.data_dir for n in nodes], self.password)

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the nodes, create the cluster and wait, at most ``timeout_s``, until every
        node sees it whole and every replica is in sync; RedisUnavailable (one line: the
        launcher exits 2 with it) naming what is missing otherwise."""
        exe = shutil.which("redis-cli")
        if exe is None:
            raise ValueError(
                "redis-cli is not installed: run `make setup` (or `apt-get install redis-tools`)"
            )
        if self.acl_file:
            self._write_acl(self.nodes)
        try:
            self._form(exe, timeout_s)
        except BaseException:  # one would not start, or an interrupt (Ctrl-C, SIGTERM):
            self.stop()  # none of the nodes is left running
            raise

    def _form(self, exe: str, timeout_s: float) -> None:
        for node in self.nodes:
            node.start()
        cmd = [exe, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes)]
        cmd += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        if self.client_tls is not None:
            cmd[1:1] = self.client_tls.cli_args().split()
        cmd += ["--user", self.username] if self.username else []
        env = dict(os.environ, REDISCLI_AUTH=self.password)
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RedisUnavailable(
                f"redis-cli --cluster create did not finish in {timeout_s:.0f} s; see the "
                f"logs in {self.data_dir}/node-*/redis.log"
            ) from None
        if out.returncode != 0:
            last = (out.stdout + out.stderr).strip().splitlines()[-1:] or ["no output"]
            raise RedisUnavailable(
                f"redis-cli --cluster create failed ({out.returncode}): {last[0]}; see the "
                f"logs in {self.data_dir}/node-*/redis.log"
            )
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        """Until :meth:`not_ready` finds nothing missing (then ``replica_of`` and ``ids``
        are read), adopting the nodes left without a primary (:meth:`adopt_unassigned`);
        RedisUnavailable naming what is still missing after ``timeout_s``."""
        deadline, missing = time.monotonic() + timeout_s, "nothing checked"
        while time.monotonic() < deadline:
            missing = self.not_ready()
            if missing is None:
                self.replica_of = self.pairs()
                self.ids = {k: node_id(self.node_client(n)) for k, n in enumerate(self.nodes)}
                return
            with contextlib.suppress(redis.RedisError):  # a node not answering: not_ready says
                for k in self.adopt_unassigned():
                    log.warning(
                        "redis-cli --cluster create left node-%d a primary without slots "
                        "(its CLUSTER REPLICATE failed); told it to replicate now",
                        k,
                    )
            time.sleep(0.2)
        raise RedisUnavailable(
            f"the local Redis Cluster was not ready in {timeout_s:.0f} s: {missing}; see the "
            f"logs in {self.data_dir}/node-*/redis.log"
        )

    def node_client(self, node: EmbeddedRedis, timeout_s: float = 2.0) -> redis.Redis:
        return node.client(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def live(self) -> list[EmbeddedRedis]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def adopt_unassigned(self) -> list[int]:
        """Nodes that say they are a primary without slots, each told to replicate the
        primary with the fewest replicas (CLUSTER MEET first where it does not know that
        one yet); the indices told. ``redis-cli --cluster create`` sends CLUSTER
        REPLICATE to each replica-to-be before and once after the nodes meet, and ignores
        that command's error: a node that did not know its primary yet both times (seen
        in a loaded CI run) stays a primary without slots, and the cluster is never
        whole. Each node's own CLUSTER NODES line says what it is (gossip may lag)."""
        own = {}  # index -> (id, flags, master id, slots), as the node itself says
        live = self.live()
        for k, node in enumerate(self.nodes):
            if node not in live:
                continue
            table = self.node_client(node).execute_command("CLUSTER NODES")
            me = next(v for v in table.values() if "myself" in v["flags"])
            own[k] = (me["node_id"], me["flags"], me["master_id"], me["slots"])
        serving = {k: v[0] for k, v in own.items() if "master" in v[1] and v[3]}
        followers = {k: sum(v[2] == i for v in own.values()) for k, i in serving.items()}
        told = []
        for k, (_, flags, _, slots) in sorted(own.items()):
            if "master" not in flags or slots or not followers:
                continue
            lead = min(followers, key=lambda p: (followers[p], p))
            if followers[lead] >= self.replicas:
                continue
            client = self.node_client(self.nodes[k])
            if serving[lead] not in _ids(client):
                client.execute_command("CLUSTER MEET", "127.0.0.1", self.nodes[lead].port)
                continue  # replicated at a later round, once it knows the primary
            client.execute_command("CLUSTER REPLICATE", serving[lead])
            followers[lead] += 1
            told.append(k)
        return told

    def not_ready(self) -> str | None:
        """None when every live node sees the cluster whole, a live node knows every
        replica pairing (``primaries * replicas``), and every replica is in sync with its
        primary (role replica, link up: data written from here on reaches it), else what
        is missing (one phrase). A node that says "replica" only once told to replicate,
        so checking the nodes' own roles alone passed before a replica was one."""
        for node in self.live():
            try:
                info = cluster_info(self.node_client(node))
            except redis.RedisError as e:
                return f"node on port {node.port} does not answer ({e})"
            why = gap(info)
            if why is not None:
                return f"node on port {node.port} says {why}"
        try:
            pairs = self.pairs()
        except redis.RedisError as e:
            return f"CLUSTER NODES failed ({e})"
        want = self.primaries * self.replicas
        if len(pairs) < want:
            return f"{len(pairs)} of {want} replicas known to the cluster"
        for r, p in sorted(pairs.items()):
            try:
                repl = self.node_client(self.nodes[r]).info("replication")
            except redis.RedisError as e:
                return f"replica node-{r} does not answer ({e})"
            if repl.get("role") != "slave" or repl.get("master_link_status") != "up":
                return f"replica node-{r} is not in sync with node-{p}"
            if repl.get("master_port") != self.nodes[p].port:
                return f"replica node-{r} replicates port {repl.get('master_port')}, not node-{p}"
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
        """One supervision round: report a node found dead (once); a dead primary's
        replica promoted in its place (the other primaries' vote); and restart a dead node
        as the replica of the primary that now serves its slots (of its own primary, for
        a dead replica), so that primary has a replica again (:meth:`rejoin`)."""
        dead = [
            k for k, n in enumerate(self.nodes) if n.proc is not None and n.proc.poll() is not None
        ]
        for k in dead:
            node = self.nodes[k]
            if k in self.down_since:
                continue
            self.down_since[k] = time.monotonic()
            primary = k not in self.replica_of
            event("exit", f"redis-node{k}", code=node.proc.returncode)
            say(
                f"redis cluster node-{k} (port {node.port}, a "
                f"{'primary' if primary else 'replica'}) exited with {node.proc.returncode}"
                + ("; waiting for its replica to be promoted" if primary else "")
            )
        if not self.down_since:
            return
        promoted = self.promoted()
        for k, since in list(self.down_since.items()):
            if k in self.replica_of:  # a replica: back under the primary it had
                primary = self.replica_of[k]
                if primary in self.down_since:
                    continue
            elif k in promoted:
                primary = promoted[k]
                if k not in self.reported:
                    self.reported.add(k)
                    waited = time.monotonic() - since
                    say(
                        f"redis cluster promoted node-{primary} (port "
                        f"{self.nodes[primary].port}) in place of node-{k} {waited:.1f} s "
                        "after it was found dead"
                    )
                    event("failover", f"redis-node{primary}", after_s=round(waited, 1))
            else:
                continue  # no replica promoted yet: the cluster is failing over
            say(
                f"restarting node-{k} (port {self.nodes[k].port}) as a replica of node-{primary}"
                f" (port {self.nodes[primary].port})"
            )
            why = self.rejoin(k, primary)
            if why is not None:
                say(f"node-{k} did not rejoin the cluster: {why}; trying again")
                continue
            event("restart", f"redis-node{k}", role="replica")
            self.replica_of = {r: p for r, p in self.replica_of.items() if p != k and r != primary}
            self.replica_of[k] = primary
            del self.down_since[k]
            self.reported.discard(k)

    def rejoin(self, k: int, primary: int, timeout_s: float = 10.0) -> str | None:
        """Start dead node ``k`` again as ``primary``'s replica; None once it replicates
        it, else why not. With its ``nodes.conf`` it rejoins by itself, and a former
        primary whose slots were taken over turns replica of the node that holds them;
        with its data directory lost it starts empty, under a new id: it meets ``primary``
        (CLUSTER MEET), is told to replicate it (CLUSTER REPLICATE), and the other nodes
        forget its old id (CLUSTER FORGET)."""
        node, lead = self.nodes[k], self.nodes[primary]
        fresh = not os.path.exists(os.path.join(node.data_dir, "nodes.conf"))
        if node.proc is None or node.proc.poll() is not None:
            if self.acl_file and fresh:  # its data directory (and ACL file) lost
                self._write_acl([node])
            node.start()
        c = self.node_client(node)
        lead_id = node_id(self.node_client(lead))
        deadline = time.monotonic() + timeout_s
        if fresh:
            c.execute_command("CLUSTER MEET", "127.0.0.1", lead.port)
            while lead_id not in _ids(c):
                if time.monotonic() > deadline:
                    return f"it does not know node-{primary} {timeout_s:.0f} s after CLUSTER MEET"
                time.sleep(0.1)
            c.execute_command("CLUSTER REPLICATE", lead_id)
            old = self.ids.get(k)
            for other in self.live():
                if other is not node and old:
                    with contextlib.suppress(redis.ResponseError):  # not known there any more
                        self.node_client(other).execute_command("CLUSTER FORGET", old)
            self.ids[k] = node_id(c)
        while True:
            repl = c.info("replication")
            if repl.get("role") == "slave" and repl.get("master_port") == lead.port:
                return None
            if time.monotonic() > deadline:
                return f"it replicates {repl.get('master_port')} (role {repl.get('role')})"
            time.sleep(0.1)

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


def node_id(client: redis.Redis) -> str:
    """The cluster node id of ``client``'s node (CLUSTER MYID)."""
    reply = client.execute_command("CLUSTER MYID")
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _ids(client: redis.Redis) -> set[str]:
    """The node ids ``client``'s node knows (CLUSTER NODES, parsed by redis-py)."""
    return {v["node_id"] for v in client.execute_command("CLUSTER NODES").values()}


def bus_port(tries: int = 200) -> int:
    """A free port P with P + 10000 free too (a cluster node's bus port), so P <= 55535;
    P + 10000 is also kept below the ephemeral range where that leaves room
    (``free_port``), so no outgoing connection takes the bus port before the node binds
    it."""
    low = ephemeral_range()[0]
    below = low - 10000 if low - 10000 - LOWEST_PORT >= 1000 else 55536
    for _ in range(tries):
        port = free_port(below=below)
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
    ``pipeline.inspect --run-dir`` and the faults bench), both mode 0600.

    With ``redis.acl_file`` (per-role users, deploy/redis/users.acl) every node loads
    those users with per-run passwords (``RUN_DIR/redis/users.acl``, 0600) and the
    launcher its own user (:data:`ADMIN`); ``role_urls`` holds each pool role's URL,
    which the launcher gives the pools as ``NONSTOP_REDIS_URL_<ROLE>``."""
    d = os.path.join(run_dir, "redis")
    os.makedirs(d, exist_ok=True)
    tls = make_run_certs(os.path.join(d, "tls")) if cfg.redis.tls.enabled else None
    acl = getattr(cfg.redis, "acl_file", None)
    users = per_run_users(os.path.abspath(acl), os.path.join(d, "users.acl")) if acl else {}
    local = LocalCluster(
        d,
        cfg.redis.embedded_appendfsync,
        tls=tls,
        acl_file=os.path.join(d, "users.acl") if acl else None,
    )
    local.start()
    try:
        _announce(cfg, local, users, d, tls, acl)
    except BaseException:  # an interrupt before the launcher holds the cluster: stop it
        local.stop()
        raise
    return local


def _announce(cfg, local: LocalCluster, users: dict, d: str, tls, acl) -> None:
    """The pools' per-role URLs, ``redis/auth`` and ``redis/url``, and the lines that
    say where the cluster is."""
    nodes = [("127.0.0.1", n.port) for n in local.nodes]
    local.role_urls = {
        r: format_url(nodes, pw, r, tls=tls is not None)
        for r, pw in users.items()
        if r in POOL_ROLES
    }
    for name, text in (("auth", local.password), ("url", local.url)):
        write_private(os.path.join(d, name), text + "\n")
    roles = local.roles()
    nodes = ", ".join(f"node-{k} :{n.port} {roles.get(k, '?')}" for k, n in enumerate(local.nodes))
    tls_note = f", TLS only, certificates in {d}/tls" if tls else ""
    cli_tls = f" {tls[1].cli_args()}" if tls else ""
    print(
        f"local redis cluster on 127.0.0.1 ({nodes}; password in {d}/auth, cluster URL in "
        f"{d}/url, AOF in {d}/node-*{tls_note}), {cfg.redis.shards} partition(s) of the work "
        "streams\n"
        f"  redis-cli: redis-cli -c -p {local.nodes[0].port}{cli_tls}"
        + (f" --user {local.username}" if local.username else "")
        + f' -a "$(cat {d}/auth)" --no-auth-warning cluster info'
        + (
            f"\n  ACL users of {acl} on every node (per-run passwords in {d}/users.acl): "
            f"the pools connect as {', '.join(sorted(local.role_urls))}"
            if acl
            else ""
        )
    )
