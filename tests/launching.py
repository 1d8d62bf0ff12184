"""Starting the real launcher on the tiny model from tests: one place for the
command line, the environment (private model cache, no hub) and waiting."""

import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.telemetry import read_jsonl

ROOT = Path(__file__).resolve().parent.parent


def launch_tiny(tmp, run_dir, *overrides, env_extra=None) -> subprocess.Popen:
    """``python -m pipeline.launch +exp=tiny run_dir=...`` with stdout+stderr piped."""
    env = dict(
        os.environ, NONSTOP_CACHE=str(Path(tmp) / "cache"), HF_HUB_OFFLINE="1", **(env_extra or {})
    )
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.launch", "+exp=tiny", f"run_dir={run_dir}", *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_tiny(tmp, run_dir, *overrides, env_extra=None, timeout=300) -> tuple[int, str]:
    """Run the tiny pipeline to the end; (exit code, everything it printed)."""
    proc = launch_tiny(tmp, run_dir, *overrides, env_extra=env_extra)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def wait_for_step(run_dir, proc: subprocess.Popen, timeout=120) -> None:
    """Block until the trainer has logged a step (the launcher must still be running)."""
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not any(r.get("event") == "step" for r in read_jsonl(str(metrics))):
        assert proc.poll() is None, "the launcher exited before the first trainer step"
        assert time.monotonic() < deadline, "no trainer step in time"
        time.sleep(0.2)
