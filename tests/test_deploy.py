"""deploy/: the systemd units (verified by systemd-analyze, and their commands run as
systemd would run them), the Redis and pool start scripts, and the Slurm scripts on a
real single-host Slurm (slow)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.deploy_builders import LIB, env_file, unit_file, verify_units
from tests.launching import tiny_cache
from tests.slurm_builders import sbatch, slurm_env, tail_of, wait_done

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNITS = sorted(p.name for p in (DEPLOY / "systemd").iterdir())
INSTANCES = {  # what systemd-analyze verifies: templates as instances
    u: u.replace("@.", "@0.") for u in UNITS
}
POOL_UNITS = ("nonstop-trainer.service", "nonstop-preprocessor@.service", "nonstop-actor@.service")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ systemd units


def test_pool_units_are_type_notify_with_a_watchdog():
    """systemd restarts a pool that hangs without dying: it says READY=1 and pings
    WATCHDOG=1 (pipeline/prom.py Notifier; tests/test_prom.py sees it on a live run)."""
    for unit in POOL_UNITS:
        text = (DEPLOY / "systemd" / unit).read_text()
        assert re.search(r"^Type=notify$", text, re.M), unit
        assert re.search(r"^WatchdogSec=\d+", text, re.M), unit
        assert re.search(r"^NotifyAccess=(main|all)$", text, re.M), unit
        assert re.search(r"^TimeoutStartSec=", text, re.M), unit  # READY after the model loads


def test_units_pass_systemd_analyze_verify(unit_root):
    proc = verify_units(unit_root, *INSTANCES.values())
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stderr
    # the check is real: a unit naming a missing program, or a misspelt key, is reported
    broken = unit_root / "etc/systemd/system/nonstop-broken.service"
    broken.write_text("[Service]\nExecStart=/usr/local/lib/nonstop-rl/nope\nRestart=sometimes\n")
    proc = verify_units(unit_root, "nonstop-broken.service")
    assert proc.returncode != 0 and "nope" in proc.stderr, proc.stderr
    assert "restart spec" in proc.stderr


def test_units_read_one_env_file_restart_and_are_limited():
    for name in UNITS:
        if name.endswith(".target"):
            continue
        u = unit_file(name)
        assert u["EnvironmentFile"] == ["/etc/nonstop-rl/env"], name
        assert u["Restart"] == ["on-failure"], name
        for key in ("MemoryMax", "TasksMax", "LimitNOFILE"):
            assert key in u, (name, key)
        assert u["PartOf"] == ["nonstop-rl.target"] and u["WantedBy"] == ["nonstop-rl.target"]
        assert u["ExecStart"][0].startswith(LIB + "/"), name
    for name in POOL_UNITS:
        u = unit_file(name)
        role = name.removeprefix("nonstop-").split("@")[0].split(".")[0]
        assert u["ExecStart"][0].split()[1] == role
        assert u["SyslogIdentifier"][0].startswith(f"nonstop-{role}")
        assert "nonstop-redis.service" in u["After"][0]
    assert "CUDA_VISIBLE_DEVICES=%i" in unit_file("nonstop-actor@.service")["Environment"]
    redis_unit = unit_file("nonstop-redis.service")
    assert redis_unit["ExecStart"] == [f"{LIB}/nonstop-redis-start /etc/nonstop-rl/redis.conf"]


# ------------------------------------------------------------------ the start scripts


def test_env_example_names_everything_the_units_need():
    env = env_file(DEPLOY / "env.example")
    for key in ("NONSTOP_REDIS_URL", "NONSTOP_RUN", "NONSTOP_CONFIG", "NONSTOP_PYTHON"):
        assert env.get(key), key
    assert re.fullmatch(r"redis://:[^@]+@[\w.-]+:\d+/0", env["NONSTOP_REDIS_URL"])


@pytest.fixture
def fake_venv(tmp_path):
    """A venv-shaped folder whose python is this interpreter (links made in it stay here)."""
    real = Path(sys.prefix)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    if (real / "pyvenv.cfg").exists():
        shutil.copy(real / "pyvenv.cfg", venv / "pyvenv.cfg")
        (venv / "lib").symlink_to(real / "lib")
    return venv


def test_pool_script_runs_the_role_under_its_name(tmp_path, fake_venv):
    config = tmp_path / "config.yaml"
    config.write_text("run:\n  name: x\n")
    probe = (
        "import sys; print(open('/proc/self/comm').read().strip()); print(' '.join(sys.argv[1:]))"
    )
    env = dict(
        os.environ,
        NONSTOP_PYTHON=str(fake_venv / "bin" / "python"),
        NONSTOP_CONFIG=str(config),
        NONSTOP_REDIS_URL="redis://:pw@127.0.0.1:1/0",
        NONSTOP_RUN="exp1",
        NONSTOP_TRANSFER_HOST="10.1.2.3",
        NONSTOP_POOL_ARGS="trainer.max_steps=7 sampling.top_k=5",
        PYTHONPATH=str(tmp_path),
    )
    # a stand-in "trainer" module prints what it was started as
    (tmp_path / "trainer.py").write_text(probe)
    out = subprocess.run(
        [DEPLOY / "bin" / "nonstop-pool", "trainer", "trainer", "trainer.lr=0.1"],
        cwd=tmp_path,  # python -m looks in the working directory first
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    comm, argv = out.stdout.splitlines()
    assert comm == "nonstop-trainer"
    assert argv == (
        f"--config {config} --name trainer run.name=exp1 trainer.max_steps=7 sampling.top_k=5 "
        "trainer.transfer_host=10.1.2.3 trainer.lr=0.1"
    )
    assert (fake_venv / "bin" / "nonstop-trainer").is_symlink()
    bad = subprocess.run(
        [DEPLOY / "bin" / "nonstop-pool", "actor", "actor-0"],
        env={k: v for k, v in env.items() if k != "NONSTOP_CONFIG"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "NONSTOP_CONFIG" in bad.stderr


def _start_redis(tmp_path: Path, url: str, **extra) -> subprocess.Popen:
    env = dict(
        os.environ,
        NONSTOP_REDIS_URL=url,
        NONSTOP_REDIS_DIR=str(tmp_path / "redis-data"),
        NONSTOP_REDIS_RUNTIME=str(tmp_path / "redis-run"),
        NONSTOP_REDIS_SERVER=shutil.which("redis-server") or "/usr/bin/redis-server",
        **extra,
    )
    return subprocess.Popen(
        [DEPLOY / "bin" / "nonstop-redis-start", DEPLOY / "redis" / "nonstop-redis.conf"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for_redis(url: str, proc: subprocess.Popen) -> redis.Redis:
    client = redis.Redis.from_url(url, socket_timeout=5)
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not answer"
            time.sleep(0.1)


def test_redis_start_script_runs_debian_redis_with_the_shipped_config(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make setup)")
    port, password = _free_port(), "0123abcd" * 4
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    proc = _start_redis(tmp_path, url)
    try:
        client = _wait_for_redis(url, proc)
        conf = client.config_get("*")
        assert conf["maxmemory-policy"] == "noeviction"
        assert conf["appendonly"] == "yes" and conf["appendfsync"] == "always"
        assert conf["bind"] == "127.0.0.1 -::1" and conf["protected-mode"] == "yes"
        assert conf["dir"] == str(tmp_path / "redis-data")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="wrong").ping()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline  # the password stays out of ps
        include = tmp_path / "redis-run" / "runtime.conf"
        assert stat.S_IMODE(include.stat().st_mode) == 0o600
        client.xadd("s", {"k": "v"})
    finally:
        _stop(proc)
    assert list((tmp_path / "redis-data" / "appendonlydir").iterdir())  # the AOF was written
    for bad_url in ("redis://127.0.0.1:6379/0", "redis://:p@ss word@127.0.0.1:6379/0"):
        refused = _start_redis(tmp_path, bad_url)
        try:
            assert refused.wait(30) == 2, bad_url
        finally:
            _stop(refused)
        assert "password" in refused.stderr.read()


def _exec_start(unit: str, instance: str = "0") -> list[str]:
    """A unit's ExecStart with its specifiers filled in and deploy/ paths for installed ones."""
    line = unit_file(unit)["ExecStart"][0]
    line = line.replace("%i", instance).replace("%H", socket.gethostname())
    line = line.replace(LIB, str(DEPLOY / "bin"))
    line = line.replace("/etc/nonstop-rl/redis.conf", str(DEPLOY / "redis" / "nonstop-redis.conf"))
    return line.split()


def test_the_units_commands_run_a_whole_pipeline(tmp_path, fake_venv):
    """Every unit's command, with the env file's variables, as systemd would start them
    (no systemd here): Redis, trainer, preprocessor@0, actor@0 on the tiny model."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make setup)")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    compose = subprocess.run(
        [sys.executable, "-m", "pipeline.launch", "+exp=tiny", f"run_dir={run_dir}"]
        + ["trainer.max_steps=3", "--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert compose.returncode == 0, compose.stderr
    (run_dir / "config.yaml").write_text(compose.stdout)
    env = dict(os.environ) | env_file(DEPLOY / "env.example")
    env |= {
        "NONSTOP_REDIS_URL": f"redis://:{'ab12' * 8}@127.0.0.1:{_free_port()}/0",
        "NONSTOP_RUN": "deploytest",
        "NONSTOP_CONFIG": str(run_dir / "config.yaml"),
        "NONSTOP_PYTHON": str(fake_venv / "bin" / "python"),
        "NONSTOP_CACHE": tiny_cache(tmp_path / "cache"),
        "NONSTOP_TRANSFER_HOST": "127.0.0.1",
        "NONSTOP_REDIS_DIR": str(tmp_path / "redis-data"),
        "NONSTOP_REDIS_RUNTIME": str(tmp_path / "redis-run"),
        "NONSTOP_REDIS_SERVER": shutil.which("redis-server"),
        "PYTHONPATH": str(ROOT),  # the checkout, installed or not
    }
    procs: dict[str, subprocess.Popen] = {}
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, argv: list[str]) -> None:
        with open(logs / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=log, stderr=log)

    try:
        start("redis", _exec_start("nonstop-redis.service"))
        _wait_for_redis(env["NONSTOP_REDIS_URL"], procs["redis"])
        for unit in POOL_UNITS:
            start(unit.split("@")[0].split(".")[0], _exec_start(unit))
        assert procs["nonstop-trainer"].wait(180) == 0, (logs / "nonstop-trainer.log").read_text()
        comm = Path(f"/proc/{procs['nonstop-actor'].pid}/comm").read_text().strip()
        assert comm == "nonstop-actor"  # the process is named by its role
        status = subprocess.run(
            [sys.executable, "-m", "pipeline.inspect", "--json", "--run", "deploytest"]
            + ["--url", env["NONSTOP_REDIS_URL"], "--prefix", "nonstop"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        pools = json.loads(status.stdout)["pools"]
        host = socket.gethostname()
        assert pools["trainer"]["state"] == "finished" and pools["trainer"]["version"] == 3
        assert pools[f"actor-{host}-0"]["throughput"]["weight_updates_applied"] >= 1
        assert pools[f"preprocessor-{host}-0"]["throughput"]["kept"] >= 1
    finally:
        for name in ("nonstop-actor", "nonstop-preprocessor", "nonstop-trainer", "redis"):
            if name in procs:
                _stop(procs[name])
    for name in ("nonstop-actor", "nonstop-preprocessor"):
        assert procs[name].returncode == 0, (logs / f"{name}.log").read_text()  # SIGTERM: clean
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000003"


# ------------------------------------------------------------------ Slurm (slow)


# run.sbatch's four groups resized on the command line: Redis, the preprocessor, the
# trainer's two ranks on two nodes, two actors (a Redis Cluster: tests/test_deploy_cluster.py)
HET_GROUPS = ["-N1", "-n1", "-c1", ":", "-N1", "-n1", "-c2", ":", "-N2", "-n2", "-c2", ":"]
HET_GROUPS += ["-N1", "-n2", "-c2"]


def _nodes(spec: str) -> set[str]:
    """n[1-2] / n3 -> node names."""
    m = re.fullmatch(r"(\w+?)\[(\d+)-(\d+)\]", spec)
    return (
        {f"{m.group(1)}{i}" for i in range(int(m.group(2)), int(m.group(3)) + 1)} if m else {spec}
    )


@pytest.mark.slow
def test_slurm_heterogeneous_job_runs_the_whole_pipeline(slurm, tmp_path):
    """Every component on its own nodes: one Redis, two trainer ranks
    (trainer.world_size=2) on two nodes."""
    run_dir = tmp_path / "run"
    compose = "+exp=tiny trainer.max_steps=6 trainer.world_size=2"
    env = slurm_env(slurm, run_dir, tmp_path / "cache", NONSTOP_COMPOSE=compose)
    log = tmp_path / "run.out"
    job = sbatch(env, "run.sbatch", log, *HET_GROUPS)
    state, code = wait_done(env, job, 300, log)
    assert (state, code) == ("COMPLETED", "0:0"), tail_of(log)
    text = log.read_text()
    assert "redis-server on" in text and "run summary" in text
    groups = dict(re.findall(r"(\w+)=(\S+)", re.search(r"nodes: (.*)", text).group(1)))
    nodes = {name: _nodes(spec) for name, spec in groups.items()}
    assert len(nodes["redis"]) == 1 and len(nodes["trainer"]) == 2, nodes
    assert len(set().union(*nodes.values())) == 5, nodes  # no two groups share a node
    assert "trainer: 2 nodes x 1 ranks, rendezvous" in text
    trainer_nodes = set(re.findall(r"trainer node \d on (\w+)", text))
    assert trainer_nodes == nodes["trainer"], text
    assert set(re.findall(r"redis-server on node (\w+)", text)) == nodes["redis"], text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["trainer_steps"] == 6
    acc = summary["accounting"]
    assert acc["groups_lost"] == 0 and acc["groups_duplicated"] == 0, acc
    data = b"".join(p.read_bytes() for p in (run_dir / "redis" / "appendonlydir").iterdir())
    assert b"tiny:rollouts" in data  # the AOF in the run directory
    assert set(summary["weight_updates_applied"]) == {"actor-0", "actor-1"}
    assert min(summary["weight_updates_applied"].values()) >= 1
    states = {name: p["state"] for name, p in summary["pools"].items()}
    assert states == {
        "trainer": "finished",
        "trainer-1": "finished",
        "preprocessor-0": "stopped",  # SIGTERM to the steps' tasks: clean stops
        "actor-0": "stopped",
        "actor-1": "stopped",
    }
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000006"
    assert not (run_dir / "redis" / "url").exists()  # Redis stopped with the job
    assert "ready to exit" in (run_dir / "redis" / "redis.log").read_text()  # SIGTERM: clean


@pytest.mark.slow
def test_slurm_per_pool_jobs_find_each_other(slurm, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    compose = subprocess.run(
        [sys.executable, "-m", "pipeline.launch", "+exp=tiny", f"run_dir={run_dir}"]
        + ["trainer.max_steps=4", "--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    (run_dir / "config.yaml").write_text(compose.stdout)
    env = slurm_env(slurm, run_dir, tmp_path / "cache")
    # pools first, Redis last: they wait for its URL in the run directory
    actor = sbatch(env, "actor.sbatch", tmp_path / "actor.out")
    prep = sbatch(env, "preprocessor.sbatch", tmp_path / "prep.out")
    trainer = sbatch(env, "trainer.sbatch", tmp_path / "trainer.out")
    redis_job = sbatch(env, "redis.sbatch", tmp_path / "redis.out")
    try:
        state, code = wait_done(env, trainer, 240, tmp_path / "trainer.out")
        assert (state, code) == ("COMPLETED", "0:0"), tail_of(tmp_path / "trainer.out")
        inspect = subprocess.run(
            [sys.executable, "-m", "pipeline.inspect", "--run-dir", str(run_dir), "--json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert inspect.returncode == 0, inspect.stderr
        pools = json.loads(inspect.stdout)["pools"]
        assert pools["trainer"]["state"] == "finished"
        assert pools[f"actor-{actor}-0"]["throughput"]["weight_updates_applied"] >= 1
        assert pools[f"preprocessor-{prep}-0"]["throughput"]["kept"] >= 1
    finally:
        subprocess.run(["scancel", actor, prep], env=env, timeout=30)
    for job, out in ((actor, "actor.out"), (prep, "prep.out")):
        wait_done(env, job, 90, tmp_path / out)
        assert "stopped:" in (tmp_path / out).read_text()  # scancel: SIGTERM, clean stop
    subprocess.run(["scancel", redis_job], env=env, timeout=30)
    wait_done(env, redis_job, 90, tmp_path / "redis.out")
    assert list((run_dir / "redis" / "appendonlydir").iterdir())
