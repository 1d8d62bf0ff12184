"""Redis Sentinel for ``redis.mode=sentinel``: the URL form, the client that follows a
failover, and the start-up probe that says in one line what is wrong.

URL (it travels in ``redis.url`` / ``NONSTOP_REDIS_URL`` like a ``redis://`` one)::

    redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]

``HOST:PORT`` are the sentinels (26379 when the port is left out), ``SERVICE`` the name
they monitor the primary under (``redis.sentinel_service``), ``DB`` the database (0).
The same user and password authenticate on the nodes (the primary and its replicas) and
on the sentinels (``requirepass``, or the same ACL user defined there:
pipeline/topology/acl.py, deploy/bin/nonstop-sentinel-start with NONSTOP_REDIS_ACL_FILE).
``rediss+sentinel://`` speaks TLS to the sentinels and to the nodes
they name, as ``rediss://`` does to one server: the client checks every certificate
against ``redis.tls.ca`` and presents ``redis.tls.cert``/``key`` (or the
``NONSTOP_REDIS_TLS_*`` variables: pipeline/redisd/tls.py) to both.

The client (:func:`sentinel_client`) asks the sentinels for the primary whenever it
(re)connects, so after a failover the same client object carries on with the promoted
replica: a command that meets the dropped connection, a primary the sentinels see down
(redis-py's MasterNotFoundError), an old primary now read-only (READONLY) or a primary
that refuses writes for want of replicas (NOREPLICAS, ``min-replicas-to-write``: the
write was not applied) is retried by :func:`pipeline.streams.connect`'s reconnect
budget (``redis.reconnect_s``) before the error reaches the caller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import unquote

import redis
from redis.backoff import NoBackoff
from redis.connection import SSLConnection
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

from pipeline.redisd.tls import TLSFiles, explain, settled
from pipeline.streams import urls
from pipeline.streams.errors import RedisRefused, RedisUnavailable
from pipeline.streams.urls import shown as _shown

SCHEME = "redis+sentinel"
TLS_SCHEME = "rediss+sentinel"
DEFAULT_PORT = 26379
FORM = "redis[s]+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"


def is_sentinel(url: str | None) -> bool:
    """Whether ``url`` names sentinels (``redis+sentinel://`` or ``rediss+sentinel://``)."""
    return bool(url) and url.split("://", 1)[0].lower().endswith("+sentinel")


@dataclass
class SentinelURL:
    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False  # rediss+sentinel://
    files: TLSFiles | None = None  # the client's TLS files (tls only)

    def shown(self) -> str:
        """The URL with the password hidden."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        who = "***@" if self.password else (f"{self.username}@" if self.username else "")
        return f"{self.scheme}://{who}{hosts}/{self.service}/{self.db}"

    @property
    def scheme(self) -> str:
        return TLS_SCHEME if self.tls else SCHEME

    def ssl_kwargs(self) -> dict:
        """redis-py's TLS arguments for a sentinel or a node ({} without TLS)."""
        return {"ssl": True, **(self.files or TLSFiles()).client_kwargs()} if self.tls else {}

    def explain(self, host: str, port: int, error: BaseException) -> str | None:
        """redis_tls.explain for one sentinel or node of this URL (None: not about TLS)."""
        url = f"{'rediss' if self.tls else 'redis'}://{host}:{port}"
        return explain(url, error, self.files, f"{host}:{port} ({self.shown()})", SCHEME)

    def hosts(self) -> str:
        return ", ".join(f"{h}:{p}" for h, p in self.sentinels)


def format_url(
    sentinels: list[tuple[str, int]],
    service: str,
    password: str = "",
    username: str = "",
    db: int = 0,
    tls: bool = False,
) -> str:
    """The URL :func:`parse` reads (the launcher's ``redis=ha`` hands it to the pools)."""
    cred = f"{username}:{password}@" if password or username else ""
    hosts = ",".join(f"{h}:{p}" for h, p in sentinels)
    return f"{TLS_SCHEME if tls else SCHEME}://{cred}{hosts}/{service}/{db}"


def parse(url: str) -> SentinelURL:
    """Read a sentinel URL; ValueError naming what is wrong and the form to use."""
    tls, username, password, hosts, path = urls.split(url, "sentinel", (SCHEME, TLS_SCHEME), FORM)
    parts = [p for p in path.split("/") if p] if path else []
    if not hosts or not parts or len(parts) > 2:
        raise ValueError(
            f"bad sentinel URL {_shown(url)}: give the sentinels and the service, {FORM}"
        )
    sentinels = urls.host_ports(hosts, url, DEFAULT_PORT, "sentinel", FORM)
    db = parts[1] if len(parts) == 2 else "0"
    if not db.isdigit():
        raise ValueError(f"bad database {db!r} in {_shown(url)}: a number ({FORM})")
    return SentinelURL(sentinels, unquote(parts[0]), int(db), username, password, tls)


def _cli_tls(files: TLSFiles | None, tls: bool) -> str:
    """redis-cli's TLS arguments (`` --tls --cacert ...``) for a TLS URL, else ""."""
    return f" {(files or TLSFiles()).cli_args()}" if tls else ""


class NotEnoughReplicas(redis.ConnectionError):
    """The primary refused a write (NOREPLICAS: fewer replicas in sync than its
    ``min-replicas-to-write``); the write was not applied, so it is retried like a
    dropped connection until the reconnect budget is spent, then reaches the caller."""


class NodeConnection(SentinelManagedConnection):
    """A connection to the primary the sentinels name.

    - Every (re)connect asks the sentinels: redis-py 8.1's ``send_packed_command``
      reconnects a dropped connection to its previous address without asking them
      (``connect_check_health``), so a command retried after the primary died went back
      to the dead port, and, once that node was restarted as a replica, to a replica.
    - MASTERDOWN (a replica whose link is down: we reached a replica, not the primary)
      drops the connection like READONLY does, as a ConnectionError the retry covers.
    - NOREPLICAS becomes :class:`NotEnoughReplicas`, which the retry covers too.
    """

    def send_packed_command(self, command, check_health=True):
        if not self._sock:  # a command's retry: one try at the primary named now; a
            # failure (none named yet: MasterNotFoundError) is the command retry's to
            # count, so the reconnect budget is not spent once per retry
            self._connect_retry()
        return super().send_packed_command(command, check_health)

    def read_response(self, *args, **kwargs):
        try:
            return super().read_response(*args, **kwargs)
        except redis.exceptions.MasterDownError as e:
            self.disconnect()
            raise redis.ConnectionError(
                f"{self.host}:{self.port} is a replica out of sync ({e}), not the primary"
            ) from None
        except redis.ResponseError as e:
            if str(e).startswith("NOREPLICAS"):
                raise NotEnoughReplicas(
                    f"the redis primary {self.host}:{self.port} refuses writes: {e} "
                    "(min-replicas-to-write): start or reconnect a replica, or check its "
                    "replication link (INFO replication on the primary)"
                ) from None
            raise


class NodeSSLConnection(NodeConnection, SSLConnection):
    """:class:`NodeConnection` over TLS (``rediss+sentinel://``; redis-py's pool picks
    its SSL class only when no connection class is given)."""


def _sentinel_kwargs(parsed: SentinelURL, timeout_s: float) -> dict:
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "username": parsed.username,
        "password": parsed.password,
        "retry": Retry(NoBackoff(), 0),
        **parsed.ssl_kwargs(),
    }


def sentinel_client(parsed: SentinelURL, retry: Retry, **node_kwargs) -> redis.Redis:
    """A client of ``parsed.service``'s primary, found through the sentinels each time it
    (re)connects; ``retry`` and ``node_kwargs`` (socket deadlines, health checks) apply
    to the node connections, a 2 s deadline to each sentinel query."""
    manager = Sentinel(parsed.sentinels, sentinel_kwargs=_sentinel_kwargs(parsed, 2.0))
    tls = {k: v for k, v in parsed.ssl_kwargs().items() if k != "ssl"}
    return manager.master_for(
        parsed.service,
        connection_class=NodeSSLConnection if parsed.tls else NodeConnection,
        **tls,
        username=parsed.username,
        password=parsed.password,
        db=parsed.db,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **node_kwargs,
    )


def probe(parsed: SentinelURL, startup_s: float, delay_s: float = 0.25) -> tuple[str, int]:
    """Ask the sentinels for the primary and PING it, within ``startup_s``; return its
    address. Raises (errors.py) RedisRefused when a sentinel or the primary refuses
    the credentials or no answering sentinel knows the service (waiting will not fix
    those), RedisUnavailable when no sentinel answers or the primary does not."""
    deadline, why, i = time.monotonic() + startup_s, "", 0
    seen: set[str] = set()  # TLS lines seen once (redis_tls.settled)
    while True:
        left = max(0.2, min(2.0, deadline - time.monotonic()))
        answers, errors = ask_sentinels(parsed, left)
        if not any(answers.values()):
            tls_why(parsed, errors, seen)
        refused = [e for e in errors.values() if isinstance(e, redis.AuthenticationError)]
        if refused and not any(answers.values()):
            raise RedisRefused(
                f"the sentinels of {parsed.shown()} refused the credentials ({refused[0]}): "
                "the user and password in the URL must be valid on the sentinels too "
                "(requirepass, or an ACL user in sentinel.conf: NONSTOP_REDIS_ACL_FILE in "
                "deploy/bin/nonstop-sentinel-start)"
            )
        if answers and not any(answers.values()):
            raise RedisRefused(
                f"the sentinels at {', '.join(answers)} do not know the service "
                f"{parsed.service!r} ({parsed.shown()}): check the name after the hosts "
                "(redis.sentinel_service, `sentinel monitor NAME` in sentinel.conf)"
            )
        address = next((a for a in answers.values() if a), None)
        if address is not None:
            why = _ping_primary(parsed, address, left, seen)
            if why is None:
                return address
        else:
            why = "; ".join(f"{k}: {e}" for k, e in errors.items())
        if time.monotonic() + delay_s >= deadline:
            break
        time.sleep(min(delay_s * 2**i, 2.0))
        i += 1
    if address is None:
        raise RedisUnavailable(
            f"none of the sentinels of {parsed.shown()} answered within {startup_s:.0f} s "
            f"({why}): check that redis-sentinel runs at {parsed.hosts()}, the hosts and "
            "ports in the URL (redis.url or NONSTOP_REDIS_URL) and any firewall between, "
            f"and try `redis-cli -h HOST -p PORT{_cli_tls(parsed.files, parsed.tls)} "
            "sentinel get-master-addr-by-name "
            f"{parsed.service}`"
        )
    raise RedisUnavailable(
        f"the sentinels of {parsed.shown()} name {address[0]}:{address[1]} as the primary "
        f"of {parsed.service!r}, but it did not answer within {startup_s:.0f} s ({why}): "
        "check that redis-server runs there and that this host can reach it (the sentinels "
        "announce the address the nodes were given, `replica-announce-ip`)"
    )


def tls_why(parsed: SentinelURL, errors: dict[str, Exception], seen: set[str]) -> None:
    """RedisRefused with redis_tls.explain's line when a sentinel's or node's error is a
    TLS mismatch (plain text at a TLS-only server, a CA that does not sign its
    certificate, a refused client certificate); an ambiguous one once seen twice."""
    for name, e in errors.items():
        host, _, port = name.rpartition(":")
        line = parsed.explain(host, int(port), e)
        if line is not None and (line in seen or settled(e)):
            raise RedisRefused(line)
        if line is not None:
            seen.add(line)


def ask_sentinels(
    parsed: SentinelURL, timeout_s: float
) -> tuple[dict[str, tuple[str, int] | None], dict[str, Exception]]:
    """SENTINEL GET-MASTER-ADDR-BY-NAME at every sentinel: (answers by "host:port": the
    primary's address or None for an unknown service, errors by "host:port")."""
    answers: dict[str, tuple[str, int] | None] = {}
    errors: dict[str, Exception] = {}
    for host, port in parsed.sentinels:
        name = f"{host}:{port}"
        client = redis.Redis(host, port, **_sentinel_kwargs(parsed, timeout_s))
        try:
            reply = client.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", parsed.service)
            answers[name] = (reply[0].decode(), int(reply[1])) if reply else None
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as e:
            errors[name] = e
        finally:
            client.close()
    return answers, errors


def failover_gap(
    parsed: SentinelURL, replicas: int, primary_port: int | None = None, timeout_s: float = 2.0
) -> str | None:
    """None when every sentinel of ``parsed`` could fail the primary over now (it answers,
    names the primary - on ``primary_port`` if given -, knows ``replicas`` replicas and
    every other sentinel), else what is missing (one phrase). A sentinel learns of a
    replica from the primary's INFO, every 10 s: a primary lost before that leaves the
    sentinel elected to fail it over with no replica to promote
    (``-failover-abort-no-good-slave``), and the next try comes two failover-timeouts
    later."""
    for k, (host, port) in enumerate(parsed.sentinels):
        client = redis.Redis(host, port, **_sentinel_kwargs(parsed, timeout_s))
        try:
            m = client.sentinel_master(parsed.service)
        except redis.RedisError as e:
            return f"sentinel {k} ({host}:{port}) does not answer ({e})"
        finally:
            client.close()
        if primary_port is not None and m.get("port") != primary_port:
            return f"sentinel {k} names port {m.get('port')} as the primary"
        if m.get("num-slaves", 0) < replicas:
            return f"sentinel {k} sees {m.get('num-slaves')} of {replicas} replicas"
        others = len(parsed.sentinels) - 1
        if m.get("num-other-sentinels", 0) < others:
            return f"sentinel {k} sees {m.get('num-other-sentinels')} of {others} others"
    return None


def _ping_primary(
    parsed: SentinelURL, address: tuple[str, int], timeout_s: float, seen: set[str]
) -> str | None:
    """None when the primary answers PING as this user; else why not. Refused
    credentials and a TLS mismatch (:func:`tls_why`) raise RedisRefused."""
    node = redis.Redis(
        address[0],
        address[1],
        db=parsed.db,
        username=parsed.username,
        password=parsed.password,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        **parsed.ssl_kwargs(),
    )
    try:
        node.ping()
        return None
    except redis.AuthenticationError as e:
        raise RedisRefused(
            f"the redis primary {address[0]}:{address[1]} (found through {parsed.shown()}) "
            f"refused the credentials ({e}): check the user and password in the URL against "
            "the nodes' ACL (deploy/redis/users.acl)"
        ) from None
    except (redis.ConnectionError, redis.TimeoutError) as e:
        tls_why(parsed, {f"{address[0]}:{address[1]}": e}, seen)
        return str(e)
    finally:
        node.close()
