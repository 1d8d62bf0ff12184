"""Episodes through the whole pipeline as real processes (launcher, redis-server,
actor, preprocessor, trainer) on the tiny random model: multi-turn episodes with tool
observations are produced, checked, scored and trained, and the summary counts them."""

from __future__ import annotations

import json

from pipeline.telemetry import read_jsonl
from tests.launching import run_leftovers, run_tiny


def test_multi_turn_episodes_train_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    code, out = run_tiny(
        tmp_path,
        run_dir,
        "trainer.max_steps=3",
        "task.kind=env",
        "task.env=tests.episode_builders:EchoEnv",
        "+task.env_args.turns=3",
        "sampling.max_new_tokens=16",
    )
    assert code == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["trainer_steps"] == 3
    assert summary["dead_lettered"] == 0 and summary["samples_trained"] >= 3 * 8
    e = summary["episodes"]
    assert e["episodes"] > 0 and e["turns"] == 3 * e["episodes"]
    assert e["multi_turn"] == e["episodes"] and e["tool_calls"] == 2 * e["episodes"]
    assert e["tool.ok"] == e["tool_calls"] and e["infra_failures"] == 0
    assert "episodes (multi-turn)" in out and "tool calls" in out
    # every group of episodes opened was published or is still open in the journal
    a = summary["accounting"]
    assert a["episode_groups_opened"] >= a["episode_groups_published"] > 0
    assert a["episode_groups_lost"] == 0 and a["episode_groups_taken_over"] == 0
    assert "episodes taken over" in out and e.get("episodes_resumed", 0) == 0
    steps = [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r.get("event") == "step"]
    # the loss covers sampled tokens only: at most 3 turns of 16, no observation ids
    assert len(steps) == 3 and all(0 < r["tokens"] <= 3 * 16 * r["samples"] for r in steps)
    assert any(r["loss"] != 0.0 for r in steps)  # rewards differ within groups: a signal
    assert run_leftovers(run_dir) == []
