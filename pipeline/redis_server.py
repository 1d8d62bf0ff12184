"""An embedded redis-server for one run: loopback only, per-run password,
AOF in the run directory, ``noeviction``.

Durability (``redis.embedded_appendfsync``): ``always`` (the default) makes
redis-server write and fsync the AOF before it replies to a command, so every
XADD, XACK and INCRBY a pool saw acknowledged is on disk and a SIGKILLed server
restarted from its AOF (pipeline/supervisor.py) has all of them. ``everysec``
fsyncs once a second in the background: about 4x the throughput on this
machine's disk (bench/results/scale-cpu-2026-11-23.md), but a hard kill (or a
power loss) can drop up to the last second of acknowledged writes, i.e. lost
groups. A clean SIGTERM loses nothing either way.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import time

import redis

log = logging.getLogger(__name__)
APPENDFSYNC = ("always", "everysec")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start with :meth:`start`, stop with :meth:`stop`; ``url`` carries the password."""

    def __init__(self, data_dir: str, appendfsync: str = "always", port: int | None = None):
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

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

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
            "--port",
            str(self.port),
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
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} in {timeout_s}s")

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
