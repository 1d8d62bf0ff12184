"""The launcher's supervisor: keeps the pools (and an embedded redis-server)
running under a restart policy, with a watchdog for silent hangs.

::

    reads   each pool's exit status; its status hash (heartbeat, progress); each pool's
            CPU time from /proc (pipeline/run/cpu_meter.py, its whole process group)
    writes  launcher events (exit, watchdog, restart, redis-restart) to metrics.jsonl,
            and a ``cpu`` record (CPU seconds and share per pool) every CPU_RECORD_S
    acts    restarts a crashed pool (launch.restart_policy, launch.max_restarts),
            SIGKILLs a pool silent for launch.watchdog_s (then the policy applies),
            restarts a dead embedded redis-server on its port and AOF (redis=ha: a
            dead node only as the replica of the primary the sentinels name, never as
            the primary it was: pipeline/topology/ha.py),
            stops the run when a pool exits with EXIT_DATA_LOST, EXIT_REFUSED (Redis
            refused it: ACL, credentials, eviction policy) or EXIT_MISMATCH (an actor
            cannot take the trainer's weights: transport or kind) or runs out of restarts

A group (the trainer's ranks ``trainer``, ``trainer-1``, ...) lives and dies
together: when one member exits or is killed, the others are killed too and
the whole group is started again (one restart of the group), with a fresh
``MASTER_PORT`` and ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` per member; it then
resumes from its last checkpoint. The group is finished when its first member
(rank 0) exits with 0.

Nothing is left behind: every pool process starts a session of its own, so it
leads a process group that holds whatever it starts (the vllm engine's
``VLLM::EngineCore`` process and its workers, spawned by vLLM with no watch on
their parent). Whenever a pool exits or is killed (a crash, the watchdog, a
group restart), the supervisor SIGKILLs what is left of its process group
before it restarts it or stops the run, so a SIGKILLed actor's engine core never
outlives it; a pool's normal end (the trainer's ranks exiting 0) is left to
:meth:`Supervisor.stop`. A pool is reaped only after its group was signalled:
until then its pid, and so its group id, cannot be given to another process.
:meth:`Supervisor.stop` sends SIGTERM to each pool (it shuts down its own
children in order: the vllm engine ends its engine core), waits up to
``launch.stop_timeout_s`` and then SIGKILLs each pool's whole process group,
leader or leftovers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections import Counter

from pipeline.redisd.server import EmbeddedRedis, free_port
from pipeline.run.cpu_meter import CpuMeter
from pipeline.runtime import EXIT_DATA_LOST, EXIT_MISMATCH, EXIT_REFUSED
from pipeline.telemetry import MetricsFile
from pipeline.topology.cluster import LocalCluster
from pipeline.topology.ha import RedisHA

# an embedded redis that exited is started again each supervision round; this many
# starts failing in a row (it exits at once, or does not answer within its start timeout)
# end the run with the error and the end of its redis.log
REDIS_START_ATTEMPTS = 5
CPU_RECORD_S = 10.0  # seconds between the supervisor's ``cpu`` records


def tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def signals_held(signums=(signal.SIGINT, signal.SIGTERM)):
    """SIGINT and SIGTERM arriving inside are held, then raised again once it ends, for
    the handlers in place (the launcher's raise KeyboardInterrupt). In the main thread
    only (the only one that can set handlers); elsewhere it holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {n: signal.signal(n, lambda signum, _frame: got.append(signum)) for n in signums}
    try:
        yield
    finally:
        for n, handler in old.items():
            signal.signal(n, handler)
        if got:
            signal.raise_signal(got[0])


class RedisNotRestarted(RuntimeError):
    """The embedded redis exited and REDIS_START_ATTEMPTS starts in a row failed: the run
    ends (pipeline/launch.py says this in one line, exit code 1)."""


class Supervisor:
    def __init__(
        self,
        cfg,
        run_dir: str,
        env: dict[str, str],
        cmds: dict[str, list[str]],
        server: EmbeddedRedis | RedisHA | LocalCluster | None = None,
        groups: dict[str, list[str]] | None = None,
    ):
        self.cfg, self.run_dir, self.env, self.cmds, self.server = cfg, run_dir, env, cmds, server
        # group -> members in rank order; a process outside every group is its own group
        self.groups = groups or {}
        self.group_of = {m: g for g, members in self.groups.items() for m in members}
        self.rank_env: dict[str, dict[str, str]] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.spawned_at: dict[str, float] = {}
        self.restarts: Counter = Counter()
        self.redis_start_failures = 0  # embedded redis starts failed in a row
        self.events = MetricsFile(os.path.join(run_dir, "metrics.jsonl"))
        self.cpu, self.cpu_recorded = CpuMeter(), time.monotonic()
        os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)

    def log_path(self, name: str) -> str:
        return os.path.join(self.run_dir, "logs", f"{name}.log")

    def event(self, kind: str, pool: str, **detail) -> None:
        self.events.write(pool="launcher", event=kind, target=pool, **detail)

    def spawn(self, name: str) -> None:
        # a Ctrl-C or SIGTERM between the fork and the record would leave a pool that
        # stop() does not know: it is held until the pool is recorded
        with signals_held(), open(self.log_path(name), "ab") as log:
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
        port = str(free_port())
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
            if proc is not None:
                kill_process_group(proc)

    def check(self, statuses: dict[str, dict[str, str]]) -> tuple[str, int] | None:
        """One supervision round; returns (outcome, exit code) when the run is over."""
        self.measure_cpu()
        self.check_redis()
        self._watchdog(statuses)
        for name, proc in list(self.procs.items()):
            code = _exit_status(proc)  # not reaped yet: its process group id stays ours
            if code is None or self.procs[name] is not proc:  # running, or its group restarted
                continue
            if name == "trainer" and code == 0:
                return "finished", 0  # stop() gives its group the grace period
            group = self.group_of.get(name)
            if code == 0 and group is not None and name != self.groups[group][0]:
                continue  # a rank > 0 done at the end; rank 0 decides
            kill_process_group(proc)  # what it started dies with it (vLLM's engine core)
            if code == EXIT_DATA_LOST:
                return self._fatal(name, code, "redis lost the run's data")
            if code == EXIT_REFUSED:
                return self._fatal(
                    name, code, "redis refused it; a restart cannot fix that, see its last line"
                )
            if code == EXIT_MISMATCH:
                return self._fatal(
                    name, code, "its settings disagree with the trainer's, see its last line"
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

    def wait_for_exit(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, returning as soon as a pool that was running exits:
        the next round (restart, or the finished trainer) comes at once instead of up
        to a progress interval later."""
        running = [p for p in self.procs.values() if not _exited(p)]
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if any(_exited(p) for p in running):
                return
            time.sleep(min(0.05, left))

    def measure_cpu(self, record: bool = False) -> None:
        """Sample the pools' CPU; write a ``cpu`` record every CPU_RECORD_S (or now)."""
        self.cpu.sample({name: proc.pid for name, proc in self.procs.items()})
        if record or time.monotonic() - self.cpu_recorded >= CPU_RECORD_S:
            self.events.write(pool="launcher", event="cpu", **self.cpu.record())
            self.cpu_recorded = time.monotonic()

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
            if _exited(proc):
                continue
            st = statuses.get(name, {})
            beat = float(st.get("heartbeat", 0)) if st.get("pid") == str(proc.pid) else 0.0
            if not beat or "progress" not in st:  # still importing, loading its model or
                # joining (no main-loop tick yet): a separate, longer deadline
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
                kill_process_group(proc)

    def check_redis(self) -> None:
        # Sentinel promotes (RedisHA.watch), a cluster fails over (LocalCluster.watch)
        if isinstance(self.server, RedisHA | LocalCluster):
            self.server.watch(lambda line: print(f"\n{line}", flush=True), self.event)
            return
        server = self.server
        if server is None or server.proc is None or server.proc.poll() is None:
            return
        code = server.proc.returncode
        if not self.redis_start_failures:  # its exit, said once (not after a failed start)
            print(
                f"\nembedded redis exited with {code}; restarting it on port "
                f"{server.port} from its AOF",
                flush=True,
            )
            self.event("exit", "redis", code=code)
        try:
            server.start()
        except (RuntimeError, TimeoutError, OSError) as e:  # the port still held, a slow load
            self.redis_start_failures += 1
            self.event("restart_failed", "redis", error=str(e)[:500])
            if self.redis_start_failures >= REDIS_START_ATTEMPTS:
                log = os.path.join(server.data_dir, "redis.log")
                raise RedisNotRestarted(
                    f"the embedded redis did not start again after {self.redis_start_failures}"
                    f" attempts ({e}); the last lines of {log}:\n{tail(log)}"
                ) from None
            print(
                f"\nembedded redis did not start again ({e}); trying again "
                f"({self.redis_start_failures}/{REDIS_START_ATTEMPTS})",
                flush=True,
            )
            return  # the next round starts it again (its process has exited)
        self.redis_start_failures = 0
        self.event("restart", "redis")

    def stop(self, only: list[str] | None = None, why: str = "the run ends") -> None:
        """SIGTERM every pool (``only``: those named), wait up to launch.stop_timeout_s,
        then SIGKILL each one's whole process group (a pool that did not stop, and
        whatever any pool left). Each pool stopped gets a ``stop`` record saying ``why``."""
        self.measure_cpu(record=True)  # the run's CPU per pool, for summary.json
        procs = {n: p for n, p in self.procs.items() if only is None or n in only}
        for n, p in procs.items():
            if not _exited(p):
                self.event("stop", n, why=why)
                _signal_group(p, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                os.kill(p.pid, signal.SIGTERM)  # the pool: it stops its own children in order
        deadline = time.monotonic() + self.cfg.launch.stop_timeout_s
        # the pools, and what they started (a resource tracker unlinking shared memory
        # after its pool exits), get the grace period to end on their own
        while time.monotonic() < deadline and any(
            not _exited(p) or _group_alive(p.pid) for p in procs.values()
        ):
            time.sleep(0.05)
        for n, p in procs.items():
            if not _exited(p):
                print(
                    f"{n} did not stop in {self.cfg.launch.stop_timeout_s}s; "
                    "killing its process group"
                )
            elif p.returncode is None and _group_alive(p.pid):
                print(f"{n} exited but left processes running; killing its process group")
            kill_process_group(p)


def _exited(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` has exited, without reaping it: until it is reaped its pid, and so
    its process group's id, cannot be given to another process."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped by someone else
        return True


def _exit_status(proc: subprocess.Popen) -> int | None:
    """``proc``'s exit code as Popen.returncode gives it (-N: killed by signal N), or None
    while it runs, without reaping it (see :func:`_exited`)."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped by someone else
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count): Linux /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != b"Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            return True
    return False


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads (spawned in a session of its own:
    its group id is its pid), only while ``proc`` is not reaped (the id is still ours)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):  # no process left in the group
            os.killpg(proc.pid, sig)


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL the pool ``proc`` and every process in its process group (what it started:
    vLLM's engine core and workers), alive or exited, then reap it."""
    _signal_group(proc, signal.SIGKILL)
    proc.wait()
