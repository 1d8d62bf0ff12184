"""The faults benchmark as a test: SIGKILL each pool, SIGSTOP one, restart
redis-server, and account for every group (none lost, none trained twice)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_pipeline_survives_the_fault_schedule(tmp_path):
    out = tmp_path / "faults.json"
    env = dict(os.environ, NONSTOP_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.bench",
            "faults",
            "--out",
            str(out),
            "--run-dir",
            str(tmp_path / "run"),
            "--tail-steps",
            "5",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["faults_injected"] >= 5
    kinds = {(f["kind"], f["target"]) for f in result["faults"]}
    assert {
        ("kill", "actor-0"),
        ("kill", "preprocessor-0"),
        ("kill", "trainer"),
        ("stop", "preprocessor-0"),
        ("restart", "redis"),
    } <= kinds
    assert result["all_recovered"], result["faults"]
    assert result["groups_lost"] == 0 and result["groups_duplicated"] == 0
    assert result["trained_not_produced"] == 0
    assert result["groups_trained"] > 0
    assert result["restarts"].get("trainer", 0) >= 1 and result["restarts"].get("redis", 0) >= 1
    assert proc.returncode == 0, proc.stdout[-3000:]
