"""The whole pipeline as real processes: launcher, redis-server, actor,
preprocessor and trainer, on a tiny random-weight model."""

import json
import signal
import subprocess
from collections import Counter

from pipeline.telemetry import read_jsonl
from tests.launching import launch_tiny, run_leftovers, run_tiny, wait_for_step


def test_pipeline_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    code, out = run_tiny(tmp_path, run_dir, "trainer.max_steps=6")
    assert code == 0, out
    assert "run summary" in out

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "finished"
    assert summary["trainer_steps"] == 6
    assert summary["samples_trained"] >= 6 * 8
    # under load the publisher sends only the newest of versions queued behind a send
    # (trainer/weight_publisher.py): every version is published or counted unreceived
    assert summary["weight_updates_published"] + summary["weight_versions_unreceived"] == 6
    assert summary["weight_updates_published"] >= 2
    assert summary["weight_updates_applied"]["actor-0"] >= 2
    assert summary["weight_problems"] == [] and summary["weight_versions_failed"]["actor-0"] == 0
    assert run_leftovers(run_dir) == []
    records = read_jsonl(str(run_dir / "metrics.jsonl"))
    # each pool's CPU over the run (the launcher's cpu records, from /proc): every pool
    # used some, none more than the machine has, and the summary says so
    cpu = summary["cpu"]
    assert {"actor-0", "preprocessor-0", "trainer"} <= set(cpu["cpu_s"]), cpu
    assert all(v > 0 for v in cpu["cpu_s"].values()) and cpu["wall_s"] > 0
    assert 0 < sum(cpu["share"].values()) <= cpu["cores"] * 1.05, cpu
    assert "cores busy over the run" in out and "trainer" in out.split("cores busy")[1]
    assert [r for r in records if r.get("event") == "cpu"][-1]["cpu_s"] == cpu["cpu_s"]
    # the trainer's idle share: each step record's wait for its data, summed over steps 2-6
    steps = [r for r in records if r.get("event") == "step"]
    wait = summary["trainer_wait"]
    assert wait["steps"] == 5 and all(r["wait_s"] >= 0 for r in steps), wait
    assert wait["wait_s"] == round(sum(r["wait_s"] for r in steps[1:]), 2), wait
    assert wait["step_s"] == round(sum(r["step_s"] for r in steps[1:]), 2), wait
    assert 0 <= wait["idle_share"] < 1 and "trainer waiting for data" in out
    # Whether a swap lands inside one of the hf engine's generation batches (about 50 ms
    # each here) is timing: two CI-like runs had no sequence spanning versions, one none
    # trained, one none published. The swap between two forward passes with sequences
    # going on is asserted where it is not left to timing: test_engine.py (hf) and, across
    # real processes, test_e2e_vllm.py (real vLLM, back-pressure off). Here: every
    # published group's versions lie within what the trainer published, and the trainer
    # counts no more spanning sequences than the actor published.
    groups = [r for r in records if r.get("event") == "group"]
    assert groups and all(0 <= lo <= hi <= 6 for lo, hi in (r["versions"] for r in groups))
    spanning = sum(r["spanning"] for r in groups)
    assert 0 <= summary["sequences_spanning_versions"] <= spanning
    for key in (
        "stale_samples_dropped",
        "reward_mean_first_window",
        "reward_mean_last_window",
        "wall_seconds",
    ):
        assert key in summary

    produced = [r["group"] for r in records if r.get("event") == "group"]
    trained = [sid for r in records if r.get("event") == "step" for sid in r["sample_ids"]]
    assert len(produced) == len(set(produced)), "a group id was produced twice"
    assert trained and len(trained) == len(set(trained)), "a sample was trained twice"
    assert {sid.rsplit("/", 1)[0] for sid in trained} <= set(produced)
    per_group = Counter(sid.rsplit("/", 1)[0] for sid in trained)
    assert max(per_group.values()) <= 4  # group_size

    for name in ("trainer", "preprocessor-0", "actor-0"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    assert (run_dir / "config.yaml").exists()
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step-000006"
    assert (ckpt / "step-000006" / "model.safetensors").exists()
    state = json.loads((ckpt / "step-000006" / "trainer_state.json").read_text())
    assert state["version"] == 6 and state["samples_trained"] == summary["samples_trained"]


def test_failing_pool_stops_the_run_and_is_named(tmp_path):
    bad = tmp_path / "problems.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "no answer"}\n')
    code, out = run_tiny(
        tmp_path,
        tmp_path / "r",
        "task.kind=file",
        f"task.path={bad}",
        "launch.restart_policy=never",
        timeout=120,
    )
    assert code == 1, out
    assert "pool actor-0 exited" in out
    assert "problems.jsonl" in out and "answer" in out  # the actor's own error, from its log
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["outcome"].startswith("failed: actor-0")


def test_relaunch_resumes_from_checkpoint_and_stream_position(tmp_path):
    run_dir = tmp_path / "run"
    code, out = run_tiny(tmp_path, run_dir, "trainer.max_steps=2")
    assert code == 0, out
    code, out = run_tiny(tmp_path, run_dir, "trainer.max_steps=4")
    assert code == 0, out
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_steps"] == 4
    records = read_jsonl(str(run_dir / "metrics.jsonl"))
    steps = [r["step"] for r in records if r.get("event") == "step"]
    assert steps == [1, 2, 3, 4]  # no step redone, none skipped
    trained = [sid for r in records if r.get("event") == "step" for sid in r["sample_ids"]]
    assert len(trained) == len(set(trained)), "a sample was trained in both launches"
    state = json.loads((run_dir / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert state["samples_trained"] == len(trained)


def test_ctrl_c_stops_every_pool_and_writes_a_summary(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch_tiny(tmp_path, run_dir, "trainer.max_steps=100000")
    wait_for_step(run_dir, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "interrupted" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "interrupted" and summary["trainer_steps"] >= 1
    leftovers = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", "pool processes outlived the launcher"
    assert run_leftovers(run_dir) == []  # nor anything a pool started (by its env marker)
