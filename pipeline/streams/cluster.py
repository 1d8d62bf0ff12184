"""Redis Cluster for ``redis.mode=cluster``: the URL form, the client that follows a
failover, and the start-up probe that says in one line what is wrong.

URL (it travels in ``redis.url`` / ``NONSTOP_REDIS_URL`` like a ``redis://`` one)::

    redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/

``HOST:PORT`` are cluster nodes to start from (6379 when the port is left out); the
client learns every other node from them (CLUSTER SLOTS). The same user and password
authenticate on every node. ``rediss+cluster://`` speaks TLS to every node, as
``rediss://`` does to one server (``redis.tls.ca``/``cert``/``key`` or the
``NONSTOP_REDIS_TLS_*`` variables: pipeline/redisd/tls.py); the nodes then run
``tls-cluster yes`` so CLUSTER SLOTS names their TLS ports.

What lives where (pipeline/streams/names.py): the control keys share the hash tag
``{<run>}`` (one slot), partition k's work streams and their once keys
``{<run>.p<k>}`` (``redis.shards`` partitions, pipeline/streams/shards.py), so each Lua
script touches one slot; the cluster spreads the partitions' slots over
its primaries.

The client (:class:`ClusterClient`, redis-py's RedisCluster) refreshes the slot map
after a dropped connection, MOVED or CLUSTERDOWN; redis-py 8.1 tries a failing command
again at once a few times, which a failover (``cluster-node-timeout`` plus an election,
seconds) outlasts, so :meth:`ClusterClient.execute_command` goes on trying, with
backoff, for ``redis.reconnect_s`` (and, once the pool is told to stop, only for its
final-writes budget: pipeline/stopping.py) before the error reaches the caller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from pipeline.redisd.tls import TLSFiles, explain, settled
from pipeline.streams import urls
from pipeline.streams.errors import RedisRefused, RedisUnavailable
from pipeline.streams.urls import shown as _shown

SCHEME = "redis+cluster"
TLS_SCHEME = "rediss+cluster"
DEFAULT_PORT = 6379
FORM = "redis[s]+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/"
SLOTS = 16384


def is_cluster(url: str | None) -> bool:
    """Whether ``url`` names cluster nodes (``redis+cluster://``, ``rediss+cluster://``)."""
    return bool(url) and url.split("://", 1)[0].lower().endswith("+cluster")


@dataclass
class ClusterURL:
    nodes: list[tuple[str, int]]
    username: str | None = None
    password: str | None = None
    tls: bool = False  # rediss+cluster://
    files: TLSFiles | None = None  # the client's TLS files (tls only)

    def shown(self) -> str:
        """The URL with the password hidden."""
        who = "***@" if self.password else (f"{self.username}@" if self.username else "")
        scheme = TLS_SCHEME if self.tls else SCHEME
        return f"{scheme}://{who}{','.join(f'{h}:{p}' for h, p in self.nodes)}/"

    def ssl_kwargs(self) -> dict:
        """redis-py's TLS arguments for a node ({} without TLS)."""
        return {"ssl": True, **(self.files or TLSFiles()).client_kwargs()} if self.tls else {}

    def explain(self, name: str, error: BaseException) -> str | None:
        """redis_tls.explain for node ``name`` ("host:port"); None: not about TLS."""
        url = f"{'rediss' if self.tls else 'redis'}://{name}"
        return explain(url, error, self.files, f"{name} ({self.shown()})", SCHEME)

    def hosts(self) -> str:
        return ", ".join(f"{h}:{p}" for h, p in self.nodes)


def format_url(
    nodes: list[tuple[str, int]], password: str = "", username: str = "", tls: bool = False
) -> str:
    """The URL :func:`parse` reads (the launcher's ``redis=cluster`` gives it to the pools)."""
    cred = f"{username}:{password}@" if password or username else ""
    scheme = TLS_SCHEME if tls else SCHEME
    return f"{scheme}://{cred}{','.join(f'{h}:{p}' for h, p in nodes)}/"


def parse(url: str) -> ClusterURL:
    """Read a cluster URL; ValueError naming what is wrong and the form to use."""
    tls, username, password, hosts, path = urls.split(url, "cluster", (SCHEME, TLS_SCHEME), FORM)
    if path.strip("/"):
        raise ValueError(
            f"bad cluster URL {_shown(url)}: a cluster has one database, so nothing goes "
            f"after the hosts but '/' ({FORM})"
        )
    if not hosts:
        raise ValueError(f"bad cluster URL {_shown(url)}: give at least one node, {FORM}")
    nodes = urls.host_ports(hosts, url, DEFAULT_PORT, "cluster node", FORM)
    return ClusterURL(nodes, username, password, tls)


def _cli_tls(parsed: ClusterURL) -> str:
    """redis-cli's TLS arguments (`` --tls --cacert ...``) for a TLS URL, else ""."""
    return f" {(parsed.files or TLSFiles()).cli_args()}" if parsed.tls else ""


class ClusterClient(RedisCluster):
    """redis-py's RedisCluster with a time budget for failovers (module docstring) and
    the ``get_retry``/``set_retry`` pair pipeline/stopping.py's ``guard`` uses."""

    def __init__(self, *args: Any, reconnect_s: float = 60.0, **kwargs: Any):
        self.reconnect_s = reconnect_s  # before: the constructor sends COMMAND
        super().__init__(*args, **kwargs)

    def get_retry(self) -> Retry:
        return self.retry

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        deadline, failures = time.monotonic() + self.reconnect_s, 0
        while True:
            try:
                return super().execute_command(*args, **kwargs)
            except self.ERRORS_ALLOW_RETRY:
                failures += 1
                left = deadline - time.monotonic()
                stop = getattr(self.retry, "stop", None)  # StopAwareRetry: the pool stops
                if stop is not None:
                    left = min(left, stop.left())
                if left <= 0:
                    raise
                time.sleep(min(0.1 * 2 ** min(failures, 4), 1.0, left))


def cluster_client(
    parsed: ClusterURL, reconnect_s: float, socket_timeout: float = 30.0, **kwargs: Any
) -> ClusterClient:
    """A client of the cluster ``parsed`` names; every socket has a deadline."""
    return ClusterClient(
        startup_nodes=[ClusterNode(h, p) for h, p in parsed.nodes],
        username=parsed.username,
        password=parsed.password,
        socket_timeout=socket_timeout,
        socket_connect_timeout=5,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.1), retries=1),
        reconnect_s=reconnect_s,
        **parsed.ssl_kwargs(),
        **kwargs,
    )


def probe(parsed: ClusterURL, startup_s: float, delay_s: float = 0.25) -> dict[str, str]:
    """CLUSTER INFO at the nodes of ``parsed`` until one says the cluster is whole
    (``cluster_state:ok``, all 16384 slots assigned) within ``startup_s``; returns that
    node's CLUSTER INFO. One line for each way it fails (errors.py): RedisRefused when a
    node refuses the credentials or the user may not run CLUSTER INFO / CLUSTER SLOTS
    (deploy/redis/users.acl grants both), or is not in cluster mode (waiting will not fix those),
    RedisUnavailable when no node answers or the cluster stays incomplete."""
    deadline, i = time.monotonic() + startup_s, 0
    seen: set[str] = set()  # TLS lines seen once (redis_tls.settled)
    while True:
        left = max(0.2, min(2.0, deadline - time.monotonic()))
        infos, errors = ask_nodes(parsed, left)
        whole = next((info for info in infos.values() if not gap(info)), None)
        if whole is not None:
            return whole
        if not infos:  # no node answered: a TLS mismatch says so in one line
            for name, e in errors.items():
                line = parsed.explain(name, e)
                if line is not None and (line in seen or settled(e)):
                    raise RedisRefused(line)
                if line is not None:
                    seen.add(line)
        if time.monotonic() + delay_s >= deadline:
            break
        time.sleep(min(delay_s * 2**i, 2.0))
        i += 1
    if infos:
        name, info = next(iter(infos.items()))
        raise RedisUnavailable(
            f"the redis cluster of {parsed.shown()} is not whole after {startup_s:.0f} s: node "
            f"{name} says {gap(info)}; every slot must be served (`redis-cli --cluster check "
            f"{name}`, then `--cluster fix`, or add the node that serves them)"
        )
    why = "; ".join(f"{k}: {e}" for k, e in errors.items())
    raise RedisUnavailable(
        f"no node of the redis cluster {parsed.shown()} answered within {startup_s:.0f} s "
        f"({why}): check that redis-server runs with cluster-enabled yes at {parsed.hosts()}, "
        "the hosts and ports in the URL (redis.url or NONSTOP_REDIS_URL) and any firewall "
        f"between, and try `redis-cli -c -h HOST -p PORT{_cli_tls(parsed)} cluster info`"
    )


def gap(info: dict[str, str]) -> str | None:
    """None for a whole cluster, else what CLUSTER INFO says is missing (one phrase)."""
    state = info.get("cluster_state")
    assigned = int(info.get("cluster_slots_assigned", 0))
    failing = int(info.get("cluster_slots_fail", 0))
    if state == "ok" and assigned == SLOTS and not failing:
        return None
    return (
        f"cluster_state:{state}, {assigned} of {SLOTS} slots assigned"
        + (f", {failing} failing" if failing else "")
        + (f" ({SLOTS - assigned} uncovered)" if assigned < SLOTS else "")
    )


def ask_nodes(
    parsed: ClusterURL, timeout_s: float
) -> tuple[dict[str, dict[str, str]], dict[str, Exception]]:
    """CLUSTER INFO (and CLUSTER SLOTS, which the client needs) at every node of ``parsed``:
    (infos by "host:port", errors by "host:port"). Refused credentials, a user without
    those commands and a node without cluster mode raise RedisRefused."""
    infos: dict[str, dict[str, str]] = {}
    errors: dict[str, Exception] = {}
    for host, port in parsed.nodes:
        name = f"{host}:{port}"
        node = redis.Redis(
            host,
            port,
            username=parsed.username,
            password=parsed.password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            **parsed.ssl_kwargs(),
        )
        command = "CLUSTER INFO"
        try:
            text = node.execute_command(command)
            command = "CLUSTER SLOTS"  # what redis-py's cluster client learns the map with
            node.execute_command(command)
            if isinstance(text, bytes):
                text = text.decode()
            if isinstance(text, dict):  # a parsed reply
                infos[name] = {k: str(v) for k, v in text.items()}
            else:
                infos[name] = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        except redis.AuthenticationError as e:
            raise RedisRefused(
                f"the redis cluster node {name} ({parsed.shown()}) refused the credentials "
                f"({e}): check the user and password in the URL against the nodes' "
                "requirepass or ACL (deploy/redis/users.acl)"
            ) from None
        except redis.exceptions.NoPermissionError as e:
            raise RedisRefused(
                f"the redis user of {parsed.shown()} may not run {command} on cluster node "
                f"{name} ({e}): the cluster client needs CLUSTER INFO and CLUSTER SLOTS: grant "
                "+cluster|info +cluster|slots to that user on every node (deploy/redis/"
                "users.acl, then ACL LOAD)"
            ) from None
        except redis.ResponseError as e:
            if "cluster support disabled" in str(e):
                raise RedisRefused(
                    f"redis at {name} is not a cluster node (cluster-enabled no) but "
                    f"redis.mode=cluster: use redis.mode=single with redis://{name}/0, or "
                    "point the redis+cluster:// URL at cluster nodes"
                ) from None
            errors[name] = e
        except (redis.ConnectionError, redis.TimeoutError) as e:
            errors[name] = e
        finally:
            node.close()
    return infos, errors


def silent(client: RedisCluster, timeout_s: float) -> str | None:
    """None when every primary of ``client``'s cluster answers a PING within
    ``timeout_s`` (the slot map read again first: a failover may have moved it), else
    why not (pipeline/run/summary.py asks before reading the run's totals)."""
    try:
        client.nodes_manager.initialize()
    except (redis.RedisError, RedisClusterException) as e:
        return " ".join(str(e).split())[:300] or type(e).__name__
    kwargs = client.nodes_manager.connection_kwargs
    ssl = {k: v for k, v in kwargs.items() if k.startswith("ssl")}  # rediss+cluster://
    for node in client.get_primaries():
        probe = redis.Redis(
            node.host,
            node.port,
            username=kwargs.get("username"),
            password=kwargs.get("password"),
            **ssl,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            probe.ping()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            return f"cluster node {node.name}: " + (" ".join(str(e).split())[:300])
        finally:
            probe.close()
    return None
