"""Shared by the deploy tests (tests/test_deploy.py, tests/test_deploy_cluster.py): the
systemd units read as systemd reads them, a filesystem root to verify them in
(``unit_root``, a fixture: tests/conftest.py imports it), the env file's variables, and
stopping the processes a test started as the units would (tests/test_redis_ha.py too)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
LIB = "/usr/local/lib/nonstop-rl"  # where the units expect deploy/bin


def unit_file(name: str) -> dict[str, list[str]]:
    """key -> values of a unit file (keys may repeat)."""
    out: dict[str, list[str]] = {}
    for line in (DEPLOY / "systemd" / name).read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


@pytest.fixture(scope="module")
def unit_root(tmp_path_factory):
    """A filesystem root holding systemd's own units, ours, and the executables ours name."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is missing: `make setup` installs Debian's systemd package")
    root = tmp_path_factory.mktemp("root")
    system = next(p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")))
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)
    shutil.copytree(DEPLOY / "systemd", root / "etc/systemd/system", dirs_exist_ok=True)
    shutil.copytree(DEPLOY / "bin", root / LIB.lstrip("/"))
    return root


def verify_units(root: Path, *units: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            "systemd-analyze",
            "verify",
            f"--root={root}",
            "--man=no",
            "--generators=no",
            *(str(root / "etc/systemd/system" / u) for u in units),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def env_file(path: Path) -> dict[str, str]:
    """KEY=value lines as systemd's EnvironmentFile= reads them (comments, quotes)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value[1:-1] if value[:1] == value[-1:] == '"' else value
    return env


def stop_processes(procs, timeout_s: float = 30) -> None:
    """SIGTERM every process still running (as systemd stops a unit), wait for each, and
    SIGKILL one that outlives ``timeout_s``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
