"""Starting the real launcher on the tiny model from tests: one place for the
command line, the environment (private model cache, no hub), waiting, and finding
the processes a run left (by the ``NONSTOP_RUN_DIR`` its launcher gives every pool)."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.telemetry import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
_TINY_SEED: list[Path] = []  # the tiny model, built once per test session


def tiny_cache(cache) -> str:
    """``cache`` (a private model cache, a run's NONSTOP_CACHE) holding the tiny model
    already, copied from one built once per test session: a launched run finds it
    instead of building it (importing transformers and writing it: ~5 s of every launch
    on 2 cores). The model is the same bytes (a seeded build); building it from nothing
    stays tested (tests/test_models.py: a build is deterministic, and cached)."""
    from pipeline.models import TINY_DIR, TINY_MODEL, materialize_model

    if not _TINY_SEED:
        seed = Path(tempfile.mkdtemp(prefix="nonstop-tiny-seed-"))
        atexit.register(shutil.rmtree, seed, True)
        _TINY_SEED.append(Path(materialize_model(TINY_MODEL, str(seed))))
    target = Path(cache) / TINY_DIR
    if not (target / "config.json").is_file():
        shutil.copytree(_TINY_SEED[0], target, dirs_exist_ok=True)
    return str(cache)


def launch_tiny(tmp, run_dir, *overrides, env_extra=None, wrap=()) -> subprocess.Popen:
    """``python -m pipeline.launch +exp=tiny run_dir=...`` with stdout+stderr piped;
    ``wrap``: a command that execs the rest (e.g. into a namespace)."""
    env = dict(
        os.environ,
        NONSTOP_CACHE=tiny_cache(Path(tmp) / "cache"),
        HF_HUB_OFFLINE="1",
        **(env_extra or {}),
    )
    launch = [sys.executable, "-m", "pipeline.launch", "+exp=tiny", f"run_dir={run_dir}"]
    return subprocess.Popen(
        [*wrap, *launch, *overrides],
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


def marked_processes(key: str, value: str) -> list[int]:
    """Live processes (not zombies) whose environment has ``key=value``: a run's pools
    and everything they started (vLLM's engine core and workers inherit it)."""
    want, found = f"{key}={value}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if want in env and state != b"Z":
            found.append(int(entry))
    return found


def run_leftovers(run_dir) -> list[str]:
    """``pid cmdline`` of every live process of the run in ``run_dir`` (its marker)."""
    out = []
    for pid in marked_processes("NONSTOP_RUN_DIR", str(Path(run_dir).resolve())):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        out.append(f"{pid} {cmd.strip()}")
    return out


def wait_until(check, timeout: float, every: float = 0.05) -> None:
    """Call ``check`` until it returns true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not true within {timeout}s: {check}"
        time.sleep(every)


def wait_for_step(run_dir, proc: subprocess.Popen, timeout=120) -> None:
    """Block until the trainer has logged a step (the launcher must still be running)."""
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not any(r.get("event") == "step" for r in read_jsonl(str(metrics))):
        assert proc.poll() is None, "the launcher exited before the first trainer step"
        assert time.monotonic() < deadline, "no trainer step in time"
        time.sleep(0.2)
