"""The launcher's supervisor: keeps the pools (and an embedded redis-server)
running under a restart policy, with a watchdog for silent hangs.

::

    reads   each pool's exit status; its status hash (heartbeat, progress)
    writes  launcher events (exit, watchdog, restart, redis-restart) to metrics.jsonl
    acts    restarts a crashed pool (launch.restart_policy, launch.max_restarts),
            SIGKILLs a pool silent for launch.watchdog_s (then the policy applies),
            restarts a dead embedded redis-server on its port and AOF,
            stops the run when a pool exits with EXIT_DATA_LOST or EXIT_REFUSED (Redis
            refused it: ACL, credentials, eviction policy) or runs out of restarts

A group (the trainer's ranks ``trainer``, ``trainer-1``, ...) lives and dies
together: when one member exits or is killed, the others are killed too and
the whole group is started again (one restart of the group), with a fresh
``MASTER_PORT`` and ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` per member; it then
resumes from its last checkpoint. The group is finished when its first member
(rank 0) exits with 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections import Counter

from pipeline.redis_server import EmbeddedRedis
from pipeline.runtime import EXIT_DATA_LOST, EXIT_REFUSED
from pipeline.telemetry import MetricsFile


def tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


class Supervisor:
    def __init__(
        self,
        cfg,
        run_dir: str,
        env: dict[str, str],
        cmds: dict[str, list[str]],
        server: EmbeddedRedis | None = None,
        groups: dict[str, list[str]] | None = None,
    ):
        self.cfg, self.run_dir, self.env, self.cmds, self.server = cfg, run_dir, env, cmds, server
        # group -> members in rank order; a process outside every group is its own group
        self.groups = groups or {}
        self.group_of = {m: g for g, members in self.groups.items() for m in members}
        self.rank_env: dict[str, dict[str, str]] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.shard_servers: list[EmbeddedRedis] = []  # redis.shards 1.. (embedded)
        self.spawned_at: dict[str, float] = {}
        self.restarts: Counter = Counter()
        self.events = MetricsFile(os.path.join(run_dir, "metrics.jsonl"))
        os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)

    def log_path(self, name: str) -> str:
        return os.path.join(self.run_dir, "logs", f"{name}.log")

    def event(self, kind: str, pool: str, **detail) -> None:
        self.events.write(pool="launcher", event=kind, target=pool, **detail)

    def spawn(self, name: str) -> None:
        with open(self.log_path(name), "ab") as log:
            self.procs[name] = subprocess.Popen(
                self.cmds[name],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env | self.rank_env.get(name, {}),
                start_new_session=True,
            )
        self.spawned_at[name] = time.time()

    def spawn_group(self, group: str) -> None:
        """Start every member of a group, with the torch.distributed variables."""
        members = self.groups[group]
        port = str(_free_port())
        for rank, name in enumerate(members):
            self.rank_env[name] = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(len(members)),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
            self.spawn(name)

    def spawn_all(self) -> None:
        for group in self.groups:
            self.spawn_group(group)
        for name in self.cmds:
            if name not in self.group_of:
                self.spawn(name)

    def _kill_group(self, group: str) -> None:
        for name in self.groups[group]:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()

    def check(self, statuses: dict[str, dict[str, str]]) -> tuple[str, int] | None:
        """One supervision round; returns (outcome, exit code) when the run is over."""
        self.check_redis()
        self._watchdog(statuses)
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or self.procs[name] is not proc:  # running, or its group restarted
                continue
            if name == "trainer" and code == 0:
                return "finished", 0
            group = self.group_of.get(name)
            if code == 0 and group is not None and name != self.groups[group][0]:
                continue  # a rank > 0 done at the end; rank 0 decides
            if code == EXIT_DATA_LOST:
                return self._fatal(name, code, "redis lost the run's data")
            if code == EXIT_REFUSED:
                return self._fatal(
                    name, code, "redis refused it; a restart cannot fix that, see its last line"
                )
            self.event("exit", name, code=code)
            unit = group or name
            policy = self.cfg.launch.restart_policy
            if policy == "never" or self.restarts[unit] >= self.cfg.launch.max_restarts:
                return self._fatal(
                    name, code, f"restart policy {policy!r}, {self.restarts[unit]} restarts used"
                )
            self.restarts[unit] += 1
            what = f"its group {group} ({len(self.groups[group])} ranks)" if group else "it"
            print(
                f"\n{name} exited with code {code}; restarting {what} "
                f"({self.restarts[unit]}/{self.cfg.launch.max_restarts})",
                flush=True,
            )
            if group:
                self._kill_group(group)
                self.spawn_group(group)
            else:
                self.spawn(name)
            self.event("restart", unit, attempt=self.restarts[unit])
        return None

    def _fatal(self, name: str, code: int, why: str) -> tuple[str, int]:
        print(
            f"\npool {name} exited with code {code} ({why}); stopping the run. "
            f"Last lines of {self.log_path(name)}:\n{tail(self.log_path(name))}",
            flush=True,
        )
        return f"failed: {name} exited with {code}", 1

    def _watchdog(self, statuses: dict[str, dict[str, str]]) -> None:
        limit = self.cfg.launch.watchdog_s
        if limit <= 0:
            return
        now = time.time()
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            st = statuses.get(name, {})
            beat = float(st.get("heartbeat", 0)) if st.get("pid") == str(proc.pid) else 0.0
            if not beat:  # still importing and loading: a separate, longer deadline
                last, allowed = self.spawned_at[name], self.cfg.launch.startup_timeout_s
            else:
                last, allowed = min(beat, float(st.get("progress", beat))), limit
            if now - last > allowed:
                print(
                    f"\nwatchdog: {name} (pid {proc.pid}) made no progress for "
                    f"{now - last:.0f}s (limit {allowed:g}s); killing it",
                    flush=True,
                )
                self.event("watchdog", name, silent_s=round(now - last, 1))
                proc.send_signal(signal.SIGKILL)
                proc.wait()

    def check_redis(self) -> None:
        for k, server in enumerate([self.server, *self.shard_servers]):
            if server is None or server.proc is None or server.proc.poll() is None:
                continue
            code, name = server.proc.returncode, f"redis-shard{k}" if k else "redis"
            print(
                f"\nembedded {name} exited with {code}; restarting it on port "
                f"{server.port} from its AOF",
                flush=True,
            )
            self.event("exit", name, code=code)
            server.start()
            self.event("restart", name)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.launch.stop_timeout_s
        for n, p in self.procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{n} did not stop in {self.cfg.launch.stop_timeout_s}s; killing it")
                p.kill()
                p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
