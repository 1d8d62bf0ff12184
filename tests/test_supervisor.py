"""The supervisor stops each pool's whole process group: real processes, each pool
starting a child that ignores SIGTERM (as vLLM's engine core outlived a SIGKILLed
actor), found afterwards by an environment marker in /proc."""

import os
import signal
import sys
import time
import uuid

from omegaconf import OmegaConf

from pipeline.config import Config
from pipeline.run.supervisor import Supervisor
from pipeline.runtime import EXIT_MISMATCH
from tests.launching import marked_processes, wait_until

# a pool: starts a child (in the pool's process group) that ignores SIGTERM, writes
# "<pool pid> <child pid>" to argv[1]; on SIGTERM it exits leaving the child ("leave")
# or ignores SIGTERM too ("ignore")
POOL = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
if sys.argv[2] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()} {child.pid}\\n")
time.sleep(600)
"""


def make_supervisor(tmp_path, mode: str, stop_timeout_s: float = 2.0):
    cfg = OmegaConf.structured(Config)
    cfg.launch.restart_policy, cfg.launch.max_restarts = "on-failure", 3
    cfg.launch.watchdog_s, cfg.launch.stop_timeout_s = 0, stop_timeout_s
    marker = uuid.uuid4().hex
    pids = tmp_path / "pids"
    cmds = {"actor-0": [sys.executable, "-c", POOL, str(pids), mode]}
    env = dict(os.environ, NONSTOP_RUN_DIR=marker)
    return Supervisor(cfg, str(tmp_path), env, cmds), marker, pids


def cleanup(sup, marker: str) -> None:
    """Stop the supervisor and kill whatever of the test is left (when the test failed)."""
    sup.stop()
    for pid in marked_processes("NONSTOP_RUN_DIR", marker):
        os.kill(pid, signal.SIGKILL)


def started(pids, n: int = 1) -> list[tuple[int, int]]:
    wait_until(lambda: pids.exists() and len(pids.read_text().splitlines()) >= n, 30)
    return [tuple(map(int, line.split())) for line in pids.read_text().splitlines()]


def test_stop_kills_what_a_pool_left_behind(tmp_path, capsys):
    """The pool exits on SIGTERM and leaves its child: stop() kills the child too."""
    sup, marker, pids = make_supervisor(tmp_path, "leave")
    sup.spawn_all()
    try:
        [(pool, child)] = started(pids)
        assert set(marked_processes("NONSTOP_RUN_DIR", marker)) == {pool, child}
        sup.stop()
        assert sup.procs["actor-0"].returncode == 0  # it stopped on SIGTERM, in time
        wait_until(lambda: not marked_processes("NONSTOP_RUN_DIR", marker), 5)
        out = capsys.readouterr().out
        assert "did not stop" not in out
        assert "actor-0 exited but left processes running; killing its process group" in out
    finally:
        cleanup(sup, marker)


def test_stop_kills_the_group_of_a_pool_that_ignores_sigterm(tmp_path, capsys):
    sup, marker, pids = make_supervisor(tmp_path, "ignore", stop_timeout_s=1.0)
    sup.spawn_all()
    try:
        started(pids)
        t0 = time.monotonic()
        sup.stop()
        assert 1.0 <= time.monotonic() - t0 < 10
        assert sup.procs["actor-0"].returncode == -signal.SIGKILL
        assert "actor-0 did not stop in 1.0s; killing its process group" in capsys.readouterr().out
        wait_until(lambda: not marked_processes("NONSTOP_RUN_DIR", marker), 5)
    finally:
        cleanup(sup, marker)


def test_a_sigkilled_pools_children_die_before_it_is_restarted(tmp_path, capsys):
    """SIGKILL the pool alone (its child survives that): the supervisor kills the rest of
    its process group as soon as it sees the exit, then restarts the pool."""
    sup, marker, pids = make_supervisor(tmp_path, "leave")
    sup.spawn_all()
    try:
        [(pool, child)] = started(pids)
        os.kill(pool, signal.SIGKILL)
        wait_until(lambda: sup.check({}) is None and sup.restarts["actor-0"] == 1, 10)
        assert "actor-0 exited with code -9; restarting it (1/3)" in capsys.readouterr().out
        [_, (pool2, child2)] = started(pids, 2)
        assert set(marked_processes("NONSTOP_RUN_DIR", marker)) == {pool2, child2}
        assert child not in marked_processes("NONSTOP_RUN_DIR", marker)
        sup.stop()
        wait_until(lambda: not marked_processes("NONSTOP_RUN_DIR", marker), 5)
    finally:
        cleanup(sup, marker)


def test_the_watchdog_kills_the_whole_group(tmp_path):
    sup, marker, pids = make_supervisor(tmp_path, "leave")
    sup.cfg.launch.startup_timeout_s = 0.5  # no heartbeat: silent from the start
    sup.cfg.launch.watchdog_s = 0.5
    sup.spawn_all()
    try:
        [(pool, child)] = started(pids)
        time.sleep(0.6)
        sup.cfg.launch.max_restarts = 0  # the watchdog's kill ends the run: nothing respawns
        outcome = sup.check({})
        assert outcome == ("failed: actor-0 exited with -9", 1)
        wait_until(lambda: not marked_processes("NONSTOP_RUN_DIR", marker), 5)
    finally:
        cleanup(sup, marker)


def test_a_pool_still_loading_is_judged_by_the_startup_deadline(tmp_path, capsys):
    """A pool that beats but has not ticked its main loop yet (no ``progress``: loading
    its model) gets launch.startup_timeout_s, not launch.watchdog_s; once it reports
    progress, a main loop silent past watchdog_s is killed."""
    sup, marker, pids = make_supervisor(tmp_path, "leave")
    sup.cfg.launch.watchdog_s, sup.cfg.launch.startup_timeout_s = 0.5, 60
    sup.spawn_all()
    try:
        [(pool, child)] = started(pids)
        time.sleep(0.8)  # past watchdog_s since the spawn
        now, pid = time.time(), str(sup.procs["actor-0"].pid)
        sup._watchdog({"actor-0": {"heartbeat": str(now), "pid": pid}})
        assert sup.procs["actor-0"].poll() is None, "killed while loading"
        assert "watchdog" not in capsys.readouterr().out
        stale = {"heartbeat": str(now), "progress": str(now - 1.0), "pid": pid}
        sup._watchdog({"actor-0": stale})  # its main loop silent for 1 s > 0.5 s
        wait_until(lambda: sup.procs["actor-0"].poll() is not None, 5)
        assert "watchdog: actor-0" in capsys.readouterr().out
    finally:
        cleanup(sup, marker)


def test_a_pool_whose_settings_disagree_is_not_restarted(tmp_path, capsys):
    """EXIT_MISMATCH (weights transport or kind differ between pools): the run stops."""
    cfg = OmegaConf.structured(Config)
    cfg.launch.restart_policy, cfg.launch.max_restarts, cfg.launch.watchdog_s = "on-failure", 3, 0
    script = f"print('the transports differ'); raise SystemExit({EXIT_MISMATCH})"
    cmds = {"actor-0": [sys.executable, "-c", script]}
    sup = Supervisor(cfg, str(tmp_path), dict(os.environ), cmds)
    sup.spawn_all()
    try:
        outcome = None
        deadline = time.monotonic() + 60
        while outcome is None and time.monotonic() < deadline:
            outcome = sup.check({})
            time.sleep(0.05)
        assert outcome == (f"failed: actor-0 exited with {EXIT_MISMATCH}", 1)
        assert sup.restarts["actor-0"] == 0
        assert "the transports differ" in capsys.readouterr().out
    finally:
        sup.stop()


def test_a_finished_trainers_children_get_the_grace_period(tmp_path):
    """The trainer's normal end (exit 0): what it left (a resource tracker unlinking shared
    memory) may finish within launch.stop_timeout_s before its group is killed."""
    done = tmp_path / "done"
    child = f"import time; time.sleep(1); open({str(done)!r}, 'w').close()"
    script = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}])"
    cfg = OmegaConf.structured(Config)
    cfg.launch.watchdog_s, cfg.launch.stop_timeout_s = 0, 20
    sup = Supervisor(
        cfg, str(tmp_path), dict(os.environ), {"trainer": [sys.executable, "-c", script]}
    )
    sup.spawn_all()
    try:
        outcome = None
        deadline = time.monotonic() + 60
        while outcome is None and time.monotonic() < deadline:
            outcome = sup.check({})
            time.sleep(0.05)
        assert outcome == ("finished", 0)
        sup.stop()
        assert done.exists(), "the trainer's child was killed before it could finish"
    finally:
        sup.stop()


def test_a_pool_reports_progress_only_once_its_main_loop_ticks(tmp_path, rclient):
    """The heartbeat thread starts before the pool loads its model: until the main loop's
    first tick the status hash carries no ``progress`` (a former process's is deleted),
    so the supervisor's watchdog applies launch.startup_timeout_s, not watchdog_s, to
    loading (a progress stamped at start-up had the watchdog kill pools while they
    loaded); after a tick it carries that tick's time."""
    import threading

    from pipeline.runtime import Pool, PoolStatus, heartbeat
    from pipeline.streams import Names, mark_run
    from pipeline.telemetry import MetricsFile

    names = Names("test", "hb")
    mark_run(rclient, names)
    status = PoolStatus(rclient, names, "actor-0", "actor")
    rclient.hset(status.key, mapping={"progress": "1.0", "pid": "1"})  # a former process's
    pool = Pool(
        cfg=OmegaConf.structured(Config),
        name="actor-0",
        role="actor",
        client=rclient,
        names=names,
        stop=threading.Event(),
        status=status,
        metrics=MetricsFile(str(tmp_path / "metrics.jsonl")),
    )
    threading.Thread(target=heartbeat, args=(pool, 0.05), daemon=True).start()
    try:
        wait_until(lambda: rclient.hget(status.key, "pid") == str(os.getpid()).encode(), 5)
        assert rclient.hget(status.key, "heartbeat") is not None
        assert rclient.hget(status.key, "progress") is None
        pool.tick()
        wait_until(lambda: rclient.hget(status.key, "progress") is not None, 5)
        assert float(rclient.hget(status.key, "progress")) == pool.last_tick
    finally:
        pool.stop.set()


def _hold(port: int):
    """A listening socket on 127.0.0.1:``port``: a redis-server started on that port
    exits at once ("Address already in use")."""
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the old one's TIME_WAIT
    s.bind(("127.0.0.1", port))
    s.listen(1)
    return s


def _redis_supervisor(tmp_path):
    from pipeline.redisd.server import EmbeddedRedis

    cfg = OmegaConf.structured(Config)
    server = EmbeddedRedis(str(tmp_path / "redis"))
    server.start()
    server.client().set("kept", "1")
    return Supervisor(cfg, str(tmp_path), dict(os.environ), {}, server), server


def test_an_embedded_redis_that_cannot_start_again_is_retried_each_round(tmp_path, capsys):
    """The redis restart after a crash fails once (its port held): the launcher says so
    and starts it again on the next round, from its AOF, instead of ending the run."""
    sup, server = _redis_supervisor(tmp_path)
    try:
        server.proc.kill()
        server.proc.wait()
        held = _hold(server.port)
        sup.check_redis()
        out = capsys.readouterr().out
        assert "embedded redis exited with -9" in out
        assert "did not start again" in out and "(1/5)" in out, out
        assert server.proc.poll() is not None  # the failed start left nothing running
        held.close()
        sup.check_redis()
        assert server.proc.poll() is None
        assert server.client().get("kept") == b"1"  # from its AOF
        assert sup.redis_start_failures == 0
        assert "exited with" not in capsys.readouterr().out  # the exit was said once
    finally:
        server.stop()


def test_an_embedded_redis_that_never_starts_again_ends_the_run_saying_why(tmp_path):
    import pytest

    from pipeline.run.supervisor import REDIS_START_ATTEMPTS, RedisNotRestarted

    sup, server = _redis_supervisor(tmp_path)
    try:
        server.proc.kill()
        server.proc.wait()
        held = _hold(server.port)
        for _ in range(REDIS_START_ATTEMPTS - 1):
            sup.check_redis()
        with pytest.raises(RedisNotRestarted, match="after 5 attempts") as e:
            sup.check_redis()
        assert "redis.log" in str(e.value)
        held.close()
    finally:
        server.stop()


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound(monkeypatch):
    """A port for a server started a moment later is never one an outgoing connection
    may take meanwhile (pipeline/redisd/server.py free_port); a cluster node's bus port
    P + 10000 neither (pipeline/topology/cluster.py bus_port)."""
    import socket

    from pipeline.redisd import server as redis_server
    from pipeline.redisd.server import LOWEST_PORT, ephemeral_range, free_port
    from pipeline.topology.cluster import bus_port

    low = ephemeral_range()[0]
    for port in [free_port() for _ in range(50)]:
        assert LOWEST_PORT <= port < low, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    for port in [bus_port() for _ in range(20)]:
        assert port >= LOWEST_PORT and port + 10000 < low, port
    # a range that leaves no room below it: the kernel's pick, as before
    monkeypatch.setattr(redis_server, "ephemeral_range", lambda: (10500, 60999))
    assert free_port() >= 10500


def test_a_signal_right_after_a_pools_fork_is_held_until_the_pool_is_recorded(
    tmp_path, monkeypatch
):
    """Ctrl-C or SIGTERM to the launcher between a pool's fork and its record in
    ``procs`` left that pool unknown to stop(): running on, orphaned (the async bench's
    SIGTERM test, 2026-11-29). The signal is held until the pool is recorded, then
    raised for the launcher's handler. Checked to fail with ``signals_held`` left out of
    Supervisor.spawn (the pool runs on, unrecorded)."""
    import pipeline.run.supervisor as supervisor

    real = supervisor.subprocess.Popen

    def popen_then_signal(*args, **kw):
        proc = real(*args, **kw)
        os.kill(os.getpid(), signal.SIGTERM)  # the signal lands right after the fork
        return proc

    def interrupt(signum, _frame):
        raise KeyboardInterrupt(signum)

    sup, marker, pids = make_supervisor(tmp_path, "leave")
    monkeypatch.setattr(supervisor.subprocess, "Popen", popen_then_signal)
    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        try:
            sup.spawn_all()
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the held SIGTERM was never raised again")
        assert "actor-0" in sup.procs, "the pool was started but not recorded"
        assert signal.getsignal(signal.SIGTERM) is interrupt  # the handler put back
        started(pids)
        sup.stop()
        wait_until(lambda: not marked_processes("NONSTOP_RUN_DIR", marker), 5)
    finally:
        signal.signal(signal.SIGTERM, old)
        cleanup(sup, marker)
