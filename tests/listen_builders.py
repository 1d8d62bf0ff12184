"""What the listener tests share (tests/test_listeners.py, tests/test_prom.py): the
configured address, the ``wrap`` fixture (a private mount namespace where this host's
name resolves to its network address), a process tree and a process's name."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

CONFIGURED = "127.0.0.1"  # trainer.transfer_host, redis.bind and MASTER_ADDR defaults


def _network_address() -> str | None:
    import psutil

    for _, addrs in sorted(psutil.net_if_addrs().items()):
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


@pytest.fixture(scope="module")
def wrap(tmp_path_factory) -> tuple[str, ...]:
    """The command prefix that runs the launcher where this host's name resolves to its
    network address (empty where no private mount namespace can be made)."""
    addr = _network_address()
    if addr is None or shutil.which("unshare") is None:
        return ()
    hosts = tmp_path_factory.mktemp("ns") / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n::1 localhost\n{addr} {socket.gethostname()}\n")
    script = f'mount --bind {hosts} /etc/hosts && exec "$@"'
    prefix = ("unshare", "-m", "sh", "-c", script, "sh")
    probe = subprocess.run(
        [*prefix, "getent", "hosts", socket.gethostname()], capture_output=True, text=True
    )
    return prefix if probe.returncode == 0 and addr in probe.stdout else ()


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def _name(pid: int) -> str:
    """A pool's name (its --name), else the process's own (comm: redis-server,
    VLLM::Worker, ...)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    if b"--name" in words[:-1]:
        return words[words.index(b"--name") + 1].decode()
    return comm
