"""A single-host Slurm for tests (tests/test_deploy.py, tests/test_redis_ha.py): the
``slurm`` fixture (registered in tests/conftest.py), a job's environment, sbatch and
waiting for a job."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launching import tiny_cache

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def slurm_env(conf: Path, run_dir: Path, cache: Path, **extra) -> dict[str, str]:
    return dict(
        os.environ,
        SLURM_CONF=str(conf),
        NONSTOP_RUN_DIR=str(run_dir),
        NONSTOP_PYTHON=sys.executable,
        NONSTOP_CACHE=tiny_cache(cache),
        HF_HUB_OFFLINE="1",
        **extra,
    )


def sbatch(env: dict, script: str, out: Path, *args: str) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={out}", *args, f"deploy/slurm/{script}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_done(env: dict, job: str, timeout: float, log: Path) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, code = _job_state(env, job)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "UNANSWERED"):
            return state, code
        time.sleep(0.2)  # scontrol is cheap: the job's end is seen within 0.2 s
    pytest.fail(f"job {job} still {state} ({code}) after {timeout}s:\n{tail_of(log)}")


def tail_of(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text().splitlines()[-n:]) if path.exists() else f"(no {path})"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real single-host Slurm: slurmctld and six slurmd (n1..n6) on localhost."""
    if os.geteuid() != 0:
        pytest.skip("the single-host Slurm needs root (slurmd launches jobs as their user)")
    if not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged")):
        setup = subprocess.run(
            ["make", "-s", "slurm-setup"], cwd=ROOT, capture_output=True, text=True, timeout=600
        )
        if setup.returncode != 0:
            pytest.skip(f"could not install slurm-wlm and munge: {setup.stderr[-500:]}")
    state = tmp_path_factory.mktemp("slurm")
    script = DEPLOY / "slurm" / "local-cluster.sh"
    up = subprocess.run(
        [script, "start", str(state), "6"], capture_output=True, text=True, timeout=120
    )
    if up.returncode != 0:
        logs = "".join(tail_of(p, 10) for p in (state / "log").glob("*.log"))
        subprocess.run([script, "stop", str(state)], timeout=60)
        pytest.fail(f"single-host Slurm did not start: {up.stderr}\n{logs}")
    try:
        yield state / "slurm.conf"
    finally:
        env = dict(os.environ, SLURM_CONF=str(state / "slurm.conf"))
        subprocess.run(["scancel", "--user", "root"], env=env, timeout=30)
        time.sleep(1)
        subprocess.run([script, "stop", str(state)], timeout=60)


def _job_state(env: dict, job: str) -> tuple[str, str]:
    """(JobState, ExitCode) as slurmctld reports them; ("GONE", "?") once it no longer
    knows the job; ("UNANSWERED", the error) when scontrol got no answer (slurmctld or
    munge too slow on a loaded machine): not an end state, asked again."""
    out = subprocess.run(
        ["scontrol", "show", "job", job], env=env, capture_output=True, text=True, timeout=30
    )
    state = re.search(r"JobState=(\S+)", out.stdout)
    code = re.search(r"ExitCode=(\S+)", out.stdout)
    if state is None and "Invalid job id" not in out.stderr:
        return "UNANSWERED", (out.stderr or out.stdout).strip()[-300:]
    return (state.group(1) if state else "GONE"), (code.group(1) if code else "?")
