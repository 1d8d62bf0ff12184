"""``redis=ha``: a local primary, one replica and three sentinels for one run, on
loopback (tests and demos; deploy/ for machines of their own).

Each node is an :class:`~pipeline.redisd.server.EmbeddedRedis` (per-run password, AOF
with ``appendfsync always``, ``noeviction``) under ``RUN_DIR/redis/node-K``; every node
refuses writes unless a replica is in sync (``min-replicas-to-write 1``,
``min-replicas-max-lag``) and a replica answers nothing stale
(``replica-serve-stale-data no``). The sentinels (``RUN_DIR/redis/sentinel-K``, their
own ``sentinel.conf``, which they rewrite) monitor the primary as
``redis.sentinel_service`` with quorum 2, authenticate to the nodes (``auth-pass``) and
to each other (``sentinel-pass``) and require the same password of their clients
(``requirepass``). The pools get the ``redis+sentinel://`` URL (pipeline/streams/sentinel.py).
With ``redis.tls=true`` every node and sentinel listens on TLS only (``port 0``,
``tls-port``, client certificates required), replicates and talks to the other
sentinels over TLS (``tls-replication``), with the run's certificates (RUN_DIR/redis/tls),
and the URL is ``rediss+sentinel://``.

With ``redis.acl_file`` (per-role users, deploy/redis/users.acl; pipeline/topology/acl.py)
every node loads those users with per-run passwords plus ``ADMIN``, the user the
launcher, the replicas (``masteruser``) and the sentinels (``auth-user``) log in as;
every sentinel defines ``ADMIN`` (the other sentinels' user, ``sentinel-user``) and each
role's user with the same password, allowed only to ask for the primary. ``user
default off`` on both leaves no password-only way in; each pool's URL carries its role's
user (``RedisHA.role_urls``).

A dead node is never restarted as it was (:meth:`RedisHA.watch`, called by the
supervisor): a primary that came back on its port with an empty or older data set would
be written to, and replicated, before the sentinels noticed. It is restarted once the
sentinels name a primary, as that primary's replica (its data directory recreated if it
was deleted), so the new primary again has the replica its ``min-replicas-to-write``
needs. A dead sentinel is restarted from its own configuration file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable

import redis

from pipeline.redisd.server import EmbeddedRedis, free_port
from pipeline.redisd.tls import TLSFiles, make_run_certs, write_private
from pipeline.streams import RedisUnavailable
from pipeline.streams.sentinel import SentinelURL, failover_gap, format_url
from pipeline.topology.acl import ADMIN, POOL_ROLES, per_run_users, sentinel_users, write_node_acl

QUORUM = 2
DOWN_AFTER_MS = 1000  # a primary silent this long is subjectively down
FAILOVER_TIMEOUT_MS = 10000
MAX_LAG_S = 5  # min-replicas-max-lag: a replica silent longer does not count


class RedisHA:
    """Start with :meth:`start`, stop with :meth:`stop`; ``url`` (password included) is
    the sentinel URL for the pools."""

    def __init__(
        self,
        data_dir: str,
        service: str = "nonstop",
        appendfsync: str = "always",
        replicas: int = 1,
        sentinels: int = 3,
        tls: tuple[TLSFiles, TLSFiles] | None = None,
        acl_file: str | None = None,
        acl_users: dict[str, str] | None = None,
    ):
        self.data_dir, self.service = os.path.abspath(data_dir), service
        # redis.acl_file: the per-run users file every node loads, and {user: password}
        # for the sentinels' users (pipeline/topology/acl.py)
        self.acl_file, self.acl_users = acl_file, dict(acl_users or {})
        self.username = ADMIN if acl_file else ""  # the launcher's, replicas', sentinels'
        self.role_urls: dict[str, str] = {}  # redis.acl_file: pool role -> its user's URL
        # (server, client) files: every node and sentinel on TLS only (redis.tls=true)
        self.server_tls, self.client_tls = tls if tls else (None, None)
        self.nodes = [
            EmbeddedRedis(os.path.join(self.data_dir, f"node-{k}"), appendfsync, tls=tls)
            for k in range(1 + replicas)
        ]
        self.password = self.nodes[0].password
        for node in self.nodes:
            node.password = self.password  # one per-run password: nodes and sentinels
            node.username = self.username
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinel_procs: list[subprocess.Popen | None] = [None] * sentinels
        self.primary = self.nodes[0]  # the primary as last seen (watch())
        self.down_since: dict[int, float] = {}  # node index -> when it was found dead

    @property
    def url(self) -> str:
        return format_url(
            [("127.0.0.1", p) for p in self.sentinel_ports],
            self.service,
            self.password,
            self.username,
            tls=self.server_tls is not None,
        )

    def role_url(self, role: str) -> str:
        """The sentinel URL with ``role``'s user and password (redis.acl_file)."""
        return format_url(
            [("127.0.0.1", p) for p in self.sentinel_ports],
            self.service,
            self.acl_users[role],
            role,
            tls=self.server_tls is not None,
        )

    def parsed(self) -> SentinelURL:
        """The sentinel URL read, with the client's TLS files."""
        hosts = [("127.0.0.1", port) for port in self.sentinel_ports]
        tls = self.server_tls is not None
        return SentinelURL(
            hosts,
            self.service,
            username=self.username or None,
            password=self.password,
            tls=tls,
            files=self.client_tls,
        )

    # ------------------------------------------------------------------ start, stop

    def _node_args(self, primary: EmbeddedRedis | None) -> list[str]:
        args = [
            "--min-replicas-to-write", "1",
            "--min-replicas-max-lag", str(MAX_LAG_S),
            "--replica-serve-stale-data", "no",
            "--masterauth", self.password,
            "--repl-diskless-sync-delay", "0",  # a restarted node syncs at once
        ]  # fmt: skip
        if primary is not None:
            args += ["--replicaof", "127.0.0.1", str(primary.port)]
        return args

    def _node_acl(self, node: EmbeddedRedis) -> list[str]:
        """redis.acl_file: the node's own users file (written anew: its data directory
        may have been lost) and ADMIN for the link to its primary."""
        if not self.acl_file:
            return []
        write_node_acl(self.acl_file, [node.data_dir], self.password)
        return [
            "--aclfile", os.path.join(node.data_dir, "users.acl"),
            "--masteruser", ADMIN,
        ]  # fmt: skip

    def start_node(self, k: int, primary: EmbeddedRedis | None) -> None:
        """Start node ``k`` as the primary (``primary`` None) or as its replica."""
        node = self.nodes[k]
        node.extra_args = self._node_args(primary) + self._node_acl(node)
        node.start()

    def _sentinel_dir(self, k: int) -> str:
        return os.path.join(self.data_dir, f"sentinel-{k}")

    def _write_sentinel_conf(self, k: int, primary: EmbeddedRedis) -> str:
        d = self._sentinel_dir(k)
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "sentinel.conf")
        s, pw = self.service, self.password
        port = self.sentinel_ports[k]
        lines = [f"port {port}"]
        if self.server_tls is not None:  # TLS only, to clients, nodes and other sentinels
            t, c = self.server_tls, self.client_tls
            lines = [
                "port 0",
                f"tls-port {port}",
                f"tls-cert-file {t.cert}",
                f"tls-key-file {t.key}",
                f"tls-ca-cert-file {t.ca}",
                f"tls-client-cert-file {c.cert}",
                f"tls-client-key-file {c.key}",
                "tls-auth-clients yes",
                "tls-replication yes",
            ]
        lines += [
            "bind 127.0.0.1",
            "protected-mode yes",
            f"dir {d}",
            f"logfile {os.path.join(d, 'sentinel.log')}",
            f"pidfile {os.path.join(d, 'sentinel.pid')}",
            *self._sentinel_auth(),
            f"sentinel monitor {s} 127.0.0.1 {primary.port} {QUORUM}",
            f"sentinel auth-pass {s} {pw}",
            *([f"sentinel auth-user {s} {ADMIN}"] if self.acl_file else []),
            f"sentinel down-after-milliseconds {s} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {s} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {s} 1",
        ]
        return write_private(path, "\n".join(lines) + "\n")

    def _sentinel_auth(self) -> list[str]:
        """Who may talk to a sentinel: the per-run password (``requirepass``), or with
        redis.acl_file no default user, ADMIN and each role's discovery-only user; the
        other sentinels log in with ``sentinel-pass`` (as ADMIN with an ACL file)."""
        pw = self.password
        if not self.acl_file:
            return [f"requirepass {pw}", f"sentinel sentinel-pass {pw}"]
        users = sentinel_users(self.acl_users, pw)
        return [*users, f"sentinel sentinel-user {ADMIN}", f"sentinel sentinel-pass {pw}"]

    def start_sentinel(self, k: int, primary: EmbeddedRedis | None = None) -> None:
        """Start sentinel ``k`` from its configuration file (written anew when missing,
        monitoring ``primary``, by default the primary as last seen)."""
        path = os.path.join(self._sentinel_dir(k), "sentinel.conf")
        if primary is not None or not os.path.exists(path):
            path = self._write_sentinel_conf(k, primary or self.primary)
        exe = shutil.which("redis-server")
        if exe is None:
            raise ValueError(
                "redis-server is not installed: run `make setup` (or `apt-get install "
                "redis-server redis-sentinel`)"
            )
        self.sentinel_procs[k] = subprocess.Popen(
            [exe, path, "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            umask=0o077,  # the file it rewrites holds passwords: still 0600 after
        )

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the nodes and sentinels and wait, at most ``timeout_s``, until every
        replica is in sync and every sentinel sees the primary, its replicas and the
        other sentinels; RedisUnavailable (one line: the launcher exits 2 with it) naming
        what is missing otherwise."""
        try:
            self._form(timeout_s)
        except BaseException:  # one would not start, or an interrupt (Ctrl-C, SIGTERM):
            self.stop()  # none of the nodes and sentinels is left running
            raise

    def _form(self, timeout_s: float) -> None:
        self.start_node(0, None)
        for k in range(1, len(self.nodes)):
            self.start_node(k, self.nodes[0])
        for k in range(len(self.sentinel_ports)):
            self.start_sentinel(k, self.nodes[0])
        deadline, missing = time.monotonic() + timeout_s, "nothing checked"
        while time.monotonic() < deadline:
            for k, proc in enumerate(self.sentinel_procs):
                if proc is not None and proc.poll() is not None:
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    raise RedisUnavailable(
                        f"redis sentinel {k} exited with {proc.returncode}: {err.strip()}"
                    )
            missing = self.not_ready()
            if missing is None:
                return
            time.sleep(0.2)
        raise RedisUnavailable(
            f"the local Redis primary, replica and sentinels were not ready in {timeout_s:.0f}"
            f" s: {missing}; see the logs in {self.data_dir}/node-*/redis.log and "
            f"{self.data_dir}/sentinel-*/sentinel.log"
        )

    def not_ready(self) -> str | None:
        """None when the topology is whole, else what is missing (one phrase)."""
        try:
            info = self.node_client(self.primary).info("replication")
        except redis.RedisError as e:
            return f"the primary on port {self.primary.port} does not answer ({e})"
        online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        online = [v for v in online if v.get("state") == "online"]
        want = len(self.nodes) - 1
        if len(online) < want:
            return f"{len(online)} of {want} replicas in sync with the primary"
        return failover_gap(self.parsed(), want, primary_port=self.primary.port)

    def node_client(self, node: EmbeddedRedis, timeout_s: float = 2.0) -> redis.Redis:
        return node.client(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def sentinel_client(self, port: int, timeout_s: float = 2.0) -> redis.Redis:
        return redis.Redis(
            "127.0.0.1",
            port,
            username=self.username or None,
            password=self.password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            **self.parsed().ssl_kwargs(),
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the sentinels first (no failover while the nodes stop), then the nodes."""
        for proc in self.sentinel_procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in self.sentinel_procs:
            if proc is not None:
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for node in self.nodes:
            node.stop(timeout_s)

    # ------------------------------------------------------------------ supervision

    def named_primary(self) -> tuple[str, int] | None:
        """The primary's address as most answering sentinels name it (None: none answer)."""
        votes: dict[tuple[str, int], int] = {}
        for port in self.sentinel_ports:
            try:
                reply = self.sentinel_client(port, 1.0).execute_command(
                    "SENTINEL GET-MASTER-ADDR-BY-NAME", self.service
                )
            except redis.RedisError:
                continue
            if reply:
                addr = (reply[0].decode(), int(reply[1]))
                votes[addr] = votes.get(addr, 0) + 1
        return max(votes, key=votes.get) if votes else None

    def watch(self, say: Callable[[str], None], event: Callable[..., None]) -> None:
        """One supervision round: restart a dead sentinel from its config; restart a
        dead node only as the replica of the primary the sentinels name, once that is a
        live node (after a failover when the dead one was the primary)."""
        for k, proc in enumerate(self.sentinel_procs):
            if proc is not None and proc.poll() is not None:
                say(f"redis sentinel {k} exited with {proc.returncode}; restarting it")
                event("exit", f"redis-sentinel{k}", code=proc.returncode)
                self.start_sentinel(k)
                event("restart", f"redis-sentinel{k}")
        dead = [
            k for k, n in enumerate(self.nodes) if n.proc is not None and n.proc.poll() is not None
        ]
        if not dead:
            return
        named = self.named_primary()
        by_port = {n.port: n for n in self.nodes}
        primary = by_port.get(named[1]) if named else None
        for k in dead:
            node = self.nodes[k]
            if k not in self.down_since:
                self.down_since[k] = time.monotonic()
                role = "primary" if node is self.primary else "replica"
                event("exit", f"redis-node{k}", code=node.proc.returncode, role=role)
                say(
                    f"redis {role} node-{k} (port {node.port}) exited with "
                    f"{node.proc.returncode}; not restarting it as it was"
                    + (
                        "; waiting for the sentinels to promote a replica"
                        if role == "primary"
                        else ""
                    )
                )
            if primary is None or primary is node or primary.proc.poll() is not None:
                continue  # no live primary named yet: the sentinels are failing over
            if primary is not self.primary:
                waited = time.monotonic() - self.down_since[k]
                say(
                    f"sentinels promoted node-{self.nodes.index(primary)} (port "
                    f"{primary.port}) {waited:.1f} s after node-{k} was found dead"
                )
                event(
                    "failover", f"redis-node{self.nodes.index(primary)}", after_s=round(waited, 1)
                )
                self.primary = primary
            say(f"restarting node-{k} (port {node.port}) as a replica of port {primary.port}")
            self.start_node(k, primary)
            event("restart", f"redis-node{k}", role="replica")
            del self.down_since[k]


def start_local_ha(cfg, run_dir: str) -> RedisHA:
    """``redis=ha`` in the launcher: start the topology under ``RUN_DIR/redis`` and
    write the password (``redis/auth``) and the sentinel URL (``redis/url``, read by
    ``pipeline.inspect --run-dir`` and the faults bench), both mode 0600."""
    d = os.path.join(run_dir, "redis")
    os.makedirs(d, exist_ok=True)
    tls = make_run_certs(os.path.join(d, "tls")) if cfg.redis.tls.enabled else None
    acl = getattr(cfg.redis, "acl_file", None)
    users = per_run_users(os.path.abspath(acl), os.path.join(d, "users.acl")) if acl else {}
    ha = RedisHA(
        d,
        cfg.redis.sentinel_service,
        cfg.redis.embedded_appendfsync,
        tls=tls,
        acl_file=os.path.join(d, "users.acl") if acl else None,
        acl_users=users,
    )
    ha.start()
    try:
        _announce(ha, users, d, tls, acl)
    except BaseException:  # an interrupt before the launcher holds the topology: stop it
        ha.stop()
        raise
    return ha


def _announce(ha: RedisHA, users: dict, d: str, tls, acl) -> None:
    """The pools' per-role URLs, ``redis/auth`` and ``redis/url``, and the lines that
    say where the topology is."""
    ha.role_urls = {r: ha.role_url(r) for r in users if r in POOL_ROLES}
    for name, text in (("auth", ha.password), ("url", ha.url)):
        write_private(os.path.join(d, name), text + "\n")
    nodes = ", ".join(f"node-{k} :{n.port}" for k, n in enumerate(ha.nodes))
    sentinels = ", ".join(f":{p}" for p in ha.sentinel_ports)
    tls_note = f", TLS only (certificates in {d}/tls)" if tls else ""
    cli_tls = f" {tls[1].cli_args()}" if tls else ""
    print(
        f"local redis primary and replica on 127.0.0.1 ({nodes}; node-0 is the primary), "
        f"sentinels on {sentinels}{tls_note} (service {ha.service!r}; password in {d}/auth, "
        f"sentinel URL in {d}/url, AOF in {d}/node-*)\n"
        f"  redis-cli: redis-cli -p {ha.sentinel_ports[0]}{cli_tls}"
        + (f" --user {ha.username}" if ha.username else "")
        + f' -a "$(cat {d}/auth)" --no-auth-warning sentinel get-master-addr-by-name '
        + ha.service
        + (
            f"\n  ACL users of {acl} on every node, and on every sentinel allowed only to "
            f"find the primary (per-run passwords in {d}/users.acl): the pools connect as "
            + ", ".join(sorted(ha.role_urls))
            if acl
            else ""
        )
    )
