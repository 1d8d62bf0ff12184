"""The faults benchmark as a test: SIGKILL each pool, SIGSTOP one, restart
redis-server; every fault must take effect (the process is gone, a new pid
reports; the server comes back with a new run_id), and every produced group
must be accounted for: produced = trained + stale + no_signal + dead_lettered
+ in_flight + lost, with nothing lost or trained twice."""

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from pipeline.accounting import account
from pipeline.telemetry import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TERMS = ("trained", "stale", "no_signal", "dead_lettered", "in_flight_at_end", "lost")


def check_fault_took_effect(fault: dict) -> None:
    effect = fault["effect"]
    assert fault["effective"] is not None, fault
    assert effect["old_pid_state"] in ("gone", "zombie"), fault  # the hit process died
    assert effect["new_pid"] not in (None, 0, fault["pid"]), fault  # and another came back
    if fault["kind"] == "stop":
        assert effect["was_stopped"], fault  # SIGSTOP held it before the watchdog killed it
    if fault["target"] == "redis":
        assert effect["new_run_id"] != fault["run_id"], fault  # a new server process


@pytest.mark.slow
def test_pipeline_survives_the_fault_schedule(tmp_path):
    out, run_dir = tmp_path / "faults.json", tmp_path / "run"
    env = dict(os.environ, NONSTOP_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.bench", "faults", "--out", str(out)]
        + ["--run-dir", str(run_dir), "--tail-steps", "5"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for fault in result["faults"]:
        check_fault_took_effect(fault)
    assert result["all_recovered"], result["faults"]

    # the conservation, recomputed here from the run's own files
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_jsonl(str(run_dir / "metrics.jsonl"))
    group_size = OmegaConf.load(run_dir / "config.yaml").task.group_size
    terms = account(records, summary["in_flight"], summary["dead_letter_entries"], group_size)
    produced = {r["group"] for r in records if r.get("event") == "group"}
    assert terms["groups_produced"] == len(produced) == result["groups_produced"] > 0
    assert terms["groups_produced"] == sum(terms[f"groups_{t}"] for t in TERMS)
    assert terms["groups_lost"] == 0, terms["groups_lost_ids"]
    assert terms["samples_lost"] == 0 and terms["samples_conflicting"] == 0
    assert terms["groups_duplicated"] == 0
    assert terms["groups_trained"] > 0
    assert result["restarts"].get("trainer", 0) >= 1 and result["restarts"].get("redis", 0) >= 1
    assert proc.returncode == 0, proc.stdout[-3000:]
