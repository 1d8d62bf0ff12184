"""Operated like a service (issue 34): every pool's /metrics and /health, the launcher's
real Prometheus, the Grafana dashboard's every query, systemd's watchdog protocol.

One tiny run (``metrics.prometheus=true``, scraped every second) serves the live checks:
while it runs, /health of a SIGSTOPped preprocessor turns 503 and back to 200 after
SIGCONT, a SIGKILLed actor comes back on a new port that Prometheus scrapes, and every
listening socket of the run (pools, their health servers, Prometheus) is on 127.0.0.1;
after it, Prometheus started again on the run's storage answers PromQL that equals
summary.json (a garbage entry XADDed to the rollouts stream makes the dead letters 1),
and every panel of deploy/grafana/nonstop-rl.json returns data (the actor's swap-gap,
staging and back-pressure histograms among them).

Checked to fail: with ``judge`` in pipeline/health_server.py returning '' the SIGSTOP check
fails; with ``nonstop_published_version`` renamed in pipeline/prom.py the summary and
dashboard checks fail; with metrics.http.host defaulting to 0.0.0.0 the listener check
lists the health servers; with Notifier.tick's WATCHDOG line removed the watchdog test
fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import redis

from tests.launching import ROOT, launch_tiny, marked_processes, wait_for_step, wait_until
from tests.listen_builders import CONFIGURED, ListenerWatch, _name

DASHBOARD = ROOT / "deploy" / "grafana" / "nonstop-rl.json"
MAX_QUEUE_GROUPS = 4  # the live run's actor.max_queue_groups
BACKPRESSURE_SERIES = "nonstop_backpressure_wait_seconds_count{"


def get(url: str, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def targets(run_dir: Path) -> dict[str, str]:
    try:
        found = json.loads((run_dir / "prometheus" / "targets.json").read_text())
    except (OSError, ValueError):
        return {}
    return {t["labels"]["pool"]: t["targets"][0] for t in found}


def pid_of(run_dir: Path, name: str) -> int:
    pids = [p for p in marked_processes("NONSTOP_RUN_DIR", str(run_dir.resolve()))]
    return next(
        p
        for p in pids
        if _name(p) == name
        and "pipeline.health_server"
        not in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
    )


class PromQL:
    def __init__(self, url: str):
        self.url = url

    def query(self, expr: str, at: float) -> list:
        q = urllib.parse.urlencode({"query": expr, "time": at})
        code, body = get(f"{self.url}/api/v1/query?{q}", timeout=10)
        assert code == 200, body
        return json.loads(body)["data"]["result"]

    def query_range(self, expr: str, start: float, end: float) -> list:
        q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": 1})
        code, body = get(f"{self.url}/api/v1/query_range?{q}", timeout=10)
        assert code == 200, body
        return json.loads(body)["data"]["result"]

    def value(self, expr: str, at: float) -> float:
        result = self.query(expr, at)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])


class NotifySocket:
    """A stand-in for systemd's notify socket: records (time, sender pid, message), the
    sender known from its credentials (SO_PASSCRED), as systemd knows it."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.settimeout(0.2)
        self.got: list[tuple[float, int, str]] = []
        self.done = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        size = socket.CMSG_SPACE(12)  # struct ucred: pid, uid, gid
        while not self.done.is_set():
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, size)
            except TimeoutError:
                continue
            pid = next(
                int.from_bytes(d[:4], "little")
                for level, kind, d in anc
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
            )
            self.got.append((time.time(), pid, data.decode()))

    def of(self, pid: int) -> list[tuple[float, str]]:
        return [(t, m) for t, p, m in self.got if p == pid]

    def close(self) -> None:
        self.done.set()
        self.reader.join(5)
        self.sock.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory, wrap):
    if shutil.which("prometheus") is None:
        pytest.skip("no prometheus binary (make setup installs Debian's)")
    tmp = tmp_path_factory.mktemp("prom")
    run_dir = tmp / "run"
    notify = NotifySocket(tmp / "notify")
    proc = launch_tiny(
        tmp,
        run_dir,
        "trainer.max_steps=8",
        f"actor.max_queue_groups={MAX_QUEUE_GROUPS}",
        "metrics.prometheus=true",
        "metrics.prometheus_scrape_s=1",
        "metrics.http.health_deadline_s=3",
        wrap=wrap,
        env_extra={"NOTIFY_SOCKET": notify.path},
    )
    lister = ListenerWatch(proc, run_dir).start()
    facts: dict = {"start": time.time()}
    try:
        wait_for_step(run_dir, proc)
        facts["dead_injected"] = inject_garbage(run_dir)
        pools = targets(run_dir)
        # the actor first: killed at the first step, the run cannot end before its
        # restart is up (8 tiny steps took 13 s after a faster trainer step; killed at
        # the end of the checks below, the restart came after the last publish)
        old_actor = pools["actor-0"]
        os.kill(pid_of(run_dir, "actor-0"), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while targets(run_dir).get("actor-0") in (None, old_actor) and time.monotonic() < deadline:
            time.sleep(0.2)
        facts["actor_ports"] = (old_actor, targets(run_dir).get("actor-0"))
        pre = "http://" + pools["preprocessor-0"]
        facts["health_before"] = get(pre + "/health")
        pid = pid_of(run_dir, "preprocessor-0")
        facts["preprocessor_pid"] = pid
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        facts["stopped_at"] = time.time()
        try:  # what the tests below judge is recorded here, never asserted
            facts["health_stopped"] = _poll(pre + "/health", 503, timeout=10)
            facts["stop_to_503_s"] = time.monotonic() - stopped
            time.sleep(max(0.0, 4 - (time.monotonic() - stopped)))  # long enough to miss pings
            # and until the actor is held back: with the preprocessor stopped nothing is
            # retired, so actor.max_queue_groups groups in flight must hold it (the
            # back-pressure panel's data; under load the actor never got that far ahead
            # on its own, and the panel stayed empty)
            facts["actor_held_back"] = _held_back(run_dir, pid_of(run_dir, "actor-0"), 90)
        finally:
            facts["continued_at"] = time.time()
            os.kill(pid, signal.SIGCONT)
        facts["health_after"] = _poll(pre + "/health", 200, timeout=10)
        facts["after_health_ok"] = time.time()
        # the hold ends once the trainer retires groups again: its record fills the
        # back-pressure histogram, which Prometheus must scrape twice for rate() to have a
        # value (a 3-worker test run once ended with that panel empty)
        facts["backpressure_served_s"] = _served_for(
            "http://" + targets(run_dir)["actor-0"], BACKPRESSURE_SERIES, 3.0, 90
        )
        out, _ = proc.communicate(timeout=300)
    finally:
        lister.stop()
        notify.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    facts["end"] = time.time()
    # Prometheus again, on the run's storage, to query what it scraped
    port = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{port.getsockname()[1]}"
    port.close()
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={run_dir / 'prometheus' / 'prometheus.yml'}",
            f"--storage.tsdb.path={run_dir / 'prometheus' / 'data'}",
            f"--web.listen-address={address}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: _ready(f"http://{address}"), timeout=60, every=0.3)
        yield {
            "code": proc.returncode,
            "out": out,
            "run_dir": run_dir,
            "listeners": lister,
            "promql": PromQL(f"http://{address}"),
            "notify": notify,
            **facts,
        }
    finally:
        prom.terminate()
        prom.wait(30)


def inject_garbage(run_dir: Path) -> int:
    """XADD one entry that is no rollout group to the live run's rollouts stream (the
    preprocessor dead-letters it); returns 1."""
    import redis

    from pipeline.config import load_config
    from pipeline.streams import Names, publish

    names = Names.of(load_config(str(run_dir / "config.yaml"), []))
    port, auth = ((run_dir / "redis" / f).read_text().strip() for f in ("port", "auth"))
    client = redis.Redis("127.0.0.1", int(port), password=auth)
    try:
        publish(client, names.rollouts, b"\x00not a rollout group", group="garbage")
    finally:
        client.close()
    return 1


def _poll(url: str, want: int, timeout: float) -> tuple[int, str]:
    """GET until it answers ``want`` or ``timeout`` passes; the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        got = get(url)
        if got[0] == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _held_back(run_dir: Path, pid: int, timeout: float) -> tuple[bool, dict[str, str]]:
    """Wait until actor-0's status hash (process ``pid``) says it is held back for its
    backlog; whether it did within ``timeout``, and its status fields."""
    port, auth = (run_dir / "redis" / "port").read_text(), (run_dir / "redis" / "auth").read_text()
    client = redis.Redis.from_url(f"redis://:{auth.strip()}@127.0.0.1:{port.strip()}/0")
    key = next(client.scan_iter(match="*:status:actor-0"))
    deadline, fields = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        fields = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
        mine = fields.get("pid") == str(pid) and fields.get("state") == "waiting"
        if mine and float(fields.get("backlog", 0)) >= MAX_QUEUE_GROUPS:
            client.close()
            return True, fields
        time.sleep(0.2)
    client.close()
    return False, fields


def _served_for(url: str, series: str, want_s: float, timeout: float) -> float:
    """Seconds ``url``/metrics has served ``series`` (up to ``want_s``; 0: never within
    ``timeout``, or the pool stopped answering first)."""
    deadline, first = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            served = series in get(url + "/metrics")[1]
        except OSError:
            break
        now = time.monotonic()
        if served and first is None:
            first = now
        if first is not None and now - first >= want_s:
            break
        time.sleep(0.2)
    return 0.0 if first is None else time.monotonic() - first


def _ready(url: str) -> bool:
    try:
        return get(url + "/-/ready")[0] == 200
    except OSError:
        return False


def test_run_prints_prometheus_and_every_pool_is_scraped(live):
    assert live["code"] == 0, live["out"][-3000:]
    assert "prometheus: http://127.0.0.1:" in live["out"]
    promql, end = live["promql"], live["end"]
    scraped = promql.query('max_over_time(up{job="nonstop-rl"}[10m]) == 1', end)
    pools = {r["metric"]["pool"] for r in scraped}
    assert {"actor-0", "preprocessor-0", "trainer"} <= pools, scraped


def test_promql_equals_summary_at_the_end(live):
    summary = json.loads((live["run_dir"] / "summary.json").read_text())
    promql, end = live["promql"], live["end"]
    trained = promql.value('max_over_time(nonstop_samples_trained{pool="trainer"}[10m])', end)
    published = promql.value("max_over_time(nonstop_published_version[10m])", end)
    dead = promql.value("sum(max_over_time(nonstop_dead_lettered[10m]))", end)
    assert trained == summary["samples_trained"] > 0
    assert published == summary["newest_published_version"] == 8
    assert dead == summary["dead_lettered"] == live["dead_injected"] == 1


def test_health_turns_503_for_a_stopped_preprocessor_and_back(live):
    assert live["health_before"] == (200, "ok\n")
    code, reason = live["health_stopped"]
    assert code == 503 and reason.startswith("stalled"), reason
    assert live["stop_to_503_s"] < 3 + 3  # the deadline, plus a refresh and the poll
    assert live["health_after"] == (200, "ok\n")


def test_a_restarted_actor_is_scraped_under_its_new_port(live):
    old, new = live["actor_ports"]
    assert old != new
    up = live["promql"].query(f'max_over_time(up{{instance="{new}"}}[10m]) == 1', live["end"])
    assert [r["metric"]["pool"] for r in up] == ["actor-0"], up


def test_every_listener_of_a_watched_run_is_on_the_configured_address(live):
    """Every listener of the run (the default engine's pools, their health servers,
    redis-server, the trainer's transfer store and gloo device, the actor's, and
    Prometheus) is on 127.0.0.1 for the whole run."""
    lister = live["listeners"]
    lister.check(CONFIGURED, {"prometheus", "redis-server", "trainer", "actor-0"}, live["out"])
    health = {s for s in lister.seen if s[0] == "python" or s[0].startswith("python")}
    assert len({s[2] for s in health}) >= 3, lister.seen  # a health server per pool at least


def test_every_dashboard_query_returns_data_on_the_live_run(live):
    """vLLM's own metrics (``vllm:*``) come with actor.engine=vllm only: their panels are
    checked on the real engine (tests/test_vllm_real.py, every ``vllm:`` name of the
    dashboard is served there); every other panel here."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"] if "vllm:" not in t["expr"]]
    assert len(exprs) >= 30
    held, status = live["actor_held_back"]  # the back-pressure panel's data
    assert held, f"the actor was never held back by its backlog: {status}"
    served = live["backpressure_served_s"]
    assert served >= 2.5, f"the actor served its back-pressure histogram for {served:.1f} s"
    promql = live["promql"]
    empty = [e for e in exprs if not promql.query_range(e, live["start"], live["end"])]
    assert not empty, f"panels whose query returns no data: {empty}"


def test_pools_ping_systemds_watchdog_and_a_stopped_one_stops(live):
    """READY=1 once from each pool, then WATCHDOG=1 about every second; none from the
    preprocessor while it is SIGSTOPped, and again after SIGCONT."""
    notify = live["notify"]
    pid = live["preprocessor_pid"]
    got = notify.of(pid)
    assert [m for _, m in got].count("READY=1") == 1, got[:5]
    assert got[0][1] == "READY=1"
    stopped, continued = live["stopped_at"], live["continued_at"]
    before = [t for t, m in got if m == "WATCHDOG=1" and t < stopped]
    during = [t for t, m in got if m == "WATCHDOG=1" and stopped + 0.5 < t < continued]
    after = [t for t, m in got if m == "WATCHDOG=1" and t > continued]
    assert len(before) >= 2 and not during and after, (before[-3:], during, after[:3])
    assert continued - stopped > 2  # the stop was long enough to miss pings
    senders = {p for _, p, m in notify.got if m == "READY=1"}
    assert len(senders) >= 4  # trainer, preprocessor, actor-0 and its restart


def _refused(tmp, *overrides, path=None) -> str:
    env = {"PATH": path} if path is not None else None
    proc = launch_tiny(tmp, Path(tmp) / "run", *overrides, env_extra=env)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-2000:]
    return [line for line in out.splitlines() if line.startswith("error:")][0]


def test_bad_metrics_settings_are_refused_in_one_line_before_the_run_starts(tmp_path):
    """The launcher's checks (pipeline/run/prometheus.py check_metrics, called before anything
    starts); the launcher itself once, for the missing binary: exit 2, one line."""
    from omegaconf import OmegaConf

    from pipeline.config import Config
    from pipeline.run.prometheus import check_metrics

    cfg = OmegaConf.structured(Config)
    cfg.metrics.http.enabled = True
    cfg.metrics.http.host = "192.0.2.254"  # TEST-NET-1: on no interface here
    with pytest.raises(ValueError, match=r"metrics.http.host=192.0.2.254: .*127.0.0.1"):
        check_metrics(cfg)
    cfg.metrics.http.host, cfg.metrics.http.port = "127.0.0.1", 9400
    with pytest.raises(ValueError, match=r"metrics.http.port=9400: .*metrics.http.port=0"):
        check_metrics(cfg)
    line = _refused(tmp_path / "c", "metrics.prometheus=true", path=str(tmp_path))
    assert "metrics.prometheus=true" in line and "apt-get install prometheus" in line, line
    assert not (tmp_path / "c" / "run" / "config.yaml").exists()  # nothing started


def test_a_port_in_use_is_refused_naming_the_key():
    from pipeline.prom import bind

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"metrics.http.port={port}: in use"):
            bind("127.0.0.1", port)


def test_inspect_writes_prometheus_targets_for_hosts_without_the_launcher(rclient, tmp_path):
    """systemd and Slurm hosts: ``python -m pipeline.inspect --prometheus-targets FILE``
    (deploy/prometheus/) writes each pool's metrics_url from its status hash."""
    from pipeline.streams import Names, mark_run

    names = Names("nonstop", "svc")
    mark_run(rclient, names)
    rclient.hset(names.status("actor-0"), mapping={"role": "actor", "metrics_url": "h1:9400"})
    rclient.hset(names.status("trainer"), mapping={"role": "trainer", "metrics_url": "h2:9402"})
    rclient.hset(names.status("old"), mapping={"role": "actor"})  # no endpoint: left out
    out = tmp_path / "targets.json"
    url = rclient.connection_pool.connection_kwargs
    proc = subprocess.run(
        [
            sys.executable, "-m", "pipeline.inspect", "--json", "--run", "svc",
            "--url", f"redis://:{url['password']}@{url['host']}:{url['port']}/0",
            "--prometheus-targets", str(out),
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = {
        t["labels"]["pool"]: (t["targets"], t["labels"]["role"])
        for t in json.loads(out.read_text())
    }
    assert found == {"actor-0": (["h1:9400"], "actor"), "trainer": (["h2:9402"], "trainer")}


def test_shipped_and_generated_prometheus_configs_pass_promtool(tmp_path):
    """deploy/prometheus/prometheus.yml and the launcher's (pipeline/run/prometheus.py)."""
    if shutil.which("promtool") is None:
        pytest.skip("no promtool (Debian's prometheus package has it)")
    from pipeline.run.prometheus import config_text

    made = tmp_path / "prometheus.yml"
    made.write_text(config_text(str(tmp_path / "targets.json"), 0.5))
    (tmp_path / "targets.json").write_text("[]")
    for path in (ROOT / "deploy" / "prometheus" / "prometheus.yml", made):
        proc = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_health_says_loading_then_redis_unreachable_and_200_after_each(tmp_path):
    """A pool (tests/health_pool.py: the real runtime, its first tick held back by a gate
    as a model load holds it) on its own redis-server: /health answers 503 "loading"
    before the main loop ticks, 200 once it does, 503 "redis unreachable" within a few
    seconds of the redis-server stopping (not after the client's 60 s of retries, and
    not "stalled"), and 200 again once the same server is back."""
    from pipeline.config import load_config
    from pipeline.redisd.server import EmbeddedRedis
    from pipeline.streams import Names
    from tests.config_builders import actor_config

    server = EmbeddedRedis(str(tmp_path / "redis"))
    server.start()
    proc = None
    try:
        cfg_path = actor_config(tmp_path, server.url)
        status = Names.of(load_config(cfg_path, [])).status("preprocessor-0")
        gate = tmp_path / "gate"
        env = dict(os.environ, HF_HUB_OFFLINE="1", NONSTOP_REDIS_URL=server.url)
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "tests.health_pool", str(gate),
                "--config", cfg_path, "--name", "preprocessor-0",
                "metrics.http.enabled=true", "metrics.http.every_s=0.2",
                "metrics.http.health_deadline_s=3",
            ],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        client = server.client()
        wait_until(lambda: client.hget(status, "metrics_url"), timeout=60, every=0.1)
        url = f"http://{client.hget(status, 'metrics_url').decode()}/health"
        loading = _poll(url, 503, timeout=5)
        gate.touch()
        ticking = _poll(url, 200, timeout=10)
        server.stop()
        stopped = time.monotonic()
        unreachable = _poll(url, 503, timeout=15)
        to_503 = time.monotonic() - stopped
        server.start()
        back = _poll(url, 200, timeout=60)
    finally:
        if proc is not None:
            proc.terminate()
            out, _ = proc.communicate(timeout=60)
        server.stop()
    assert loading == (503, "loading: the main loop has not started\n"), out[-2000:]
    assert ticking == (200, "ok\n"), out[-2000:]
    code, reason = unreachable
    assert code == 503 and reason.startswith("redis unreachable"), (reason, out[-2000:])
    assert to_503 < 2 + 2 * 0.2 + 2, to_503  # redis_s (2 s), a facts write, the poll
    assert back == (200, "ok\n"), out[-2000:]
