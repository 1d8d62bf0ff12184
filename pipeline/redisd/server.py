"""An embedded redis-server for one run: loopback only, per-run password,
AOF in the run directory, ``noeviction``; with ``redis.tls=true`` on TLS only, client
certificates required (pipeline/redisd/tls.py).

Durability (``redis.embedded_appendfsync``): ``always`` (the default) makes
redis-server write and fsync the AOF before it replies to a command, so every
XADD, XACK and INCRBY a pool saw acknowledged is on disk and a SIGKILLed server
restarted from its AOF (pipeline/run/supervisor.py) has all of them. ``everysec``
fsyncs once a second in the background: about 4x the throughput on this
machine's disk (bench/results/scale-cpu-2026-11-23.md), but a hard kill (or a
power loss) can drop up to the last second of acknowledged writes, i.e. lost
groups. A clean SIGTERM loses nothing either way.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import shutil
import socket
import subprocess
import time

import redis

from pipeline.redisd.tls import TLSFiles

log = logging.getLogger(__name__)
APPENDFSYNC = ("always", "everysec")


LOWEST_PORT = 10000  # free_port never picks below this (well-known and registered ports)


def ephemeral_range() -> tuple[int, int]:
    """The range the kernel takes a connection's local port from (Linux's
    net.ipv4.ip_local_port_range; its default where that file is absent)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", below: int | None = None, tries: int = 200) -> int:
    """A port free on ``host`` now, for a server started a moment later, taken at random
    from below the kernel's ephemeral range (and below ``below`` when given).

    A port the kernel hands out for ``bind(0)`` lies in the ephemeral range, from which
    every outgoing connection also takes its local port: between this call and the
    server's own bind, a client connecting anywhere could take it (a redis node failed
    to start on a port a connection of another test had taken). A port below that range
    is only ever taken by an explicit bind. Where the range leaves too few ports below
    it, bind(0) as before."""
    low = min(ephemeral_range()[0], below or 65536)
    rng = random.SystemRandom()
    if low - LOWEST_PORT >= 1000:
        for _ in range(tries):
            port = rng.randrange(LOWEST_PORT, low)
            try:
                with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                    s.bind((host, port))
                return port
            except OSError:
                continue
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start with :meth:`start`, stop with :meth:`stop`; ``url`` carries the password."""

    def __init__(
        self,
        data_dir: str,
        appendfsync: str = "always",
        port: int | None = None,
        tls: tuple[TLSFiles, TLSFiles] | None = None,
    ):
        if appendfsync not in APPENDFSYNC:
            raise ValueError(
                f"redis.embedded_appendfsync={appendfsync!r} is not supported; use always "
                "(nothing acknowledged is lost) or everysec (faster; a hard kill loses up to 1 s)"
            )
        if appendfsync == "everysec":
            log.warning(
                "redis.embedded_appendfsync=everysec: a SIGKILL of redis-server (or a power "
                "loss) can lose up to the last second of acknowledged writes"
            )
        self.data_dir = data_dir
        self.appendfsync = appendfsync
        self.port = port or free_port()
        self.password = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        # (the server's files, a client's files): TLS only on the port (redis.tls=true;
        # pipeline/redis_tls.make_run_certs), clients need a certificate of the same CA
        self.server_tls, self.client_tls = tls if tls else (None, None)
        self.extra_args: list[str] = []  # more redis-server options (pipeline/topology/ha.py)
        self.username = ""  # the user of url and client() ("": default; topology/cluster.py)

    @property
    def url(self) -> str:
        scheme = "rediss" if self.server_tls else "redis"
        return f"{scheme}://{self.username}:{self.password}@127.0.0.1:{self.port}/0"

    def _listen_args(self) -> list[str]:
        """Plain text on ``port``, or (TLS) no plain port and TLS on ``port``; a replica
        reaches its primary over TLS too (``tls-replication``), presenting the client
        certificate (the server's is for serverAuth only)."""
        if self.server_tls is None:
            return ["--port", str(self.port)]
        t, c = self.server_tls, self.client_tls or self.server_tls
        return [
            "--tls-replication",
            "yes",
            "--tls-client-cert-file",
            c.cert,
            "--tls-client-key-file",
            c.key,
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            t.cert,
            "--tls-key-file",
            t.key,
            "--tls-ca-cert-file",
            t.ca,
            "--tls-auth-clients",
            "yes",
        ]

    def start(self, timeout_s: float = 10.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise ValueError(
                "redis-server is not installed: run `make setup` "
                "(or `apt-get install redis-server`), or pass redis.url=redis://host:port/0"
            )
        os.makedirs(self.data_dir, exist_ok=True)
        args = [
            exe,
            *self._listen_args(),
            "--bind",
            "127.0.0.1",
            "--protected-mode",
            "yes",
            "--requirepass",
            self.password,
            "--dir",
            os.path.abspath(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            "--pidfile",
            os.path.join(os.path.abspath(self.data_dir), "redis.pid"),
            "--logfile",
            os.path.join(os.path.abspath(self.data_dir), "redis.log"),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        client = self.client(socket_connect_timeout=1, socket_timeout=1)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            try:
                client.ping()
                return
            except redis.exceptions.MasterDownError:
                return  # a replica not in sync yet that serves nothing stale: it answers
            except (redis.ConnectionError, redis.TimeoutError):  # not up, or not it yet
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} in {timeout_s}s")

    def client(self, **kwargs) -> redis.Redis:
        """A plain redis-py client of this server (no retries), TLS files included."""
        tls = self.client_tls.client_kwargs() if self.client_tls else {}
        return redis.Redis.from_url(self.url, **tls, **kwargs)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class UnsafeRedis(ValueError):
    """This Redis may not hold the run (it may evict, or its policy cannot be read);
    a pool stops at start-up in one line with EXIT_REFUSED (pipeline/runtime.py)."""


def check_no_eviction(client: redis.Redis) -> None:
    """Refuse a Redis that may evict stream data under memory pressure.

    Reads the policy with ``INFO memory`` (``maxmemory_policy``), which every role
    of deploy/redis/users.acl may run (``+info``), unlike CONFIG; a user that may
    not run INFO gets an :class:`UnsafeRedis` (a ValueError) saying so, never a
    skipped check.
    """
    try:
        policy = client.info("memory").get("maxmemory_policy")
    except redis.ResponseError as e:
        raise UnsafeRedis(
            f"cannot check redis maxmemory-policy: INFO was refused ({e}); allow this "
            "user `+info` (deploy/redis/users.acl grants it to every role)"
        ) from None
    if policy is None:
        raise UnsafeRedis("redis INFO memory has no maxmemory_policy; is this a Redis >= 4?")
    if policy != "noeviction":
        raise UnsafeRedis(
            f"redis maxmemory-policy is {policy!r}: it could evict rollouts; "
            "set `maxmemory-policy noeviction` on the server"
        )
