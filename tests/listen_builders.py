"""What the listener checks share: the configured address, the ``wrap`` fixture (a
private mount namespace where this host's name resolves to its network address) and
:class:`ListenerWatch` (every listener of a run while it goes). The checks ride on runs
other tests make anyway (one run serves both: a run costs 1-3 minutes of CI):
tests/test_prom.py (the default run with metrics), tests/test_e2e_vllm.py (real vLLM),
tests/test_trainer_group.py (two DeepSpeed ranks); tests/test_listeners.py has the
listing itself and the stores."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
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


class ListenerWatch:
    """Every TCP socket in LISTEN state of a launched run's processes (the launcher's
    descendants and every process marked with the run directory, pipeline.listeners
    .listening), polled every 0.2 s on a thread from entry until exit or the launcher
    ends: ``seen`` {(name, address, port)}."""

    def __init__(self, proc: subprocess.Popen, run_dir):
        from pipeline.listeners import listening
        from tests.launching import marked_processes

        self.seen: set[tuple[str, str, int]] = set()
        self._done = threading.Event()
        mark = str(Path(run_dir).resolve())

        def watch() -> None:
            while not self._done.is_set() and proc.poll() is None:
                pids = _descendants(proc.pid) | set(marked_processes("NONSTOP_RUN_DIR", mark))
                for x in listening(pids):
                    self.seen.add((_name(x.pid), x.address, x.port))
                time.sleep(0.2)

        self._thread = threading.Thread(target=watch, daemon=True)

    def start(self) -> ListenerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)

    def __enter__(self) -> ListenerWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def check(self, configured: str, pools: set[str], out: str) -> None:
        """``pools`` were seen listening (so the listing saw the run), and every listener
        was on ``configured``."""
        names = {s[0] for s in self.seen}
        assert pools <= names, f"never seen listening: {pools - names}; seen {self.seen}"
        wrong = sorted(s for s in self.seen if s[1] != configured)
        assert not wrong, f"listening past {configured}: {wrong}\n{out[-2000:]}"
