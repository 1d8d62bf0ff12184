"""Evaluation: the held-out split, ``python -m pipeline.eval`` on a tiny checkpoint
from a problem file, and the periodic evaluator pool in a real run."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.launch import SYNCED
from pipeline.models import TINY_MODEL, load_model, materialize_model
from pipeline.tasks import ArithmeticTask, reward
from pipeline.telemetry import read_jsonl
from tests.launching import ROOT, run_tiny, tiny_cache


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_heldout_problems_never_appear_in_training_draws(difficulty):
    heldout = ArithmeticTask(difficulty).heldout(64)
    assert len(heldout) >= 20
    assert len({p.question for p in heldout}) == len(heldout)  # distinct problems
    assert heldout == ArithmeticTask(difficulty, seed=5).heldout(64)  # the same for any seed
    questions = {p.question for p in heldout}
    for seed in (0, 1, 2):  # actors draw with different seeds
        task = ArithmeticTask(difficulty, seed=seed)
        drawn = {task.sample().question for _ in range(3000)}
        assert not drawn & questions


def _eval(*args, cache) -> subprocess.CompletedProcess:
    env = dict(os.environ, NONSTOP_CACHE=tiny_cache(cache), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "pipeline.eval", *map(str, args), "--no-progress"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _tiny_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint folder as the trainer leaves it: HF weights + trainer_state.json."""
    model, tokenizer = load_model(materialize_model(TINY_MODEL, str(tmp_path / "cache")))
    path = tmp_path / "ckpts" / "step-000003"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "trainer_state.json").write_text(json.dumps({"version": 3, "entry_id": "0-0"}))
    return path


def test_eval_cli_scores_a_tiny_checkpoint_on_a_problem_file(tmp_path):
    ckpt = _tiny_checkpoint(tmp_path)
    problems = tmp_path / "problems.jsonl"
    rows = [
        {"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(3) for b in (1, 2)
    ]
    rows.append({"question": "GSM8K style", "answer": "some work\n#### 4"})
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "result.json"
    proc = _eval(
        ckpt,
        "task.kind=file",
        f"task.path={problems}",
        "model.name=tiny",
        "eval.samples=3",
        "eval.batch_size=4",
        "eval.max_new_tokens=12",
        "--out",
        out,
        cache=tmp_path / "cache",
    )
    assert proc.returncode == 0, proc.stderr
    assert "greedy accuracy" in proc.stdout and "pass@3" in proc.stdout  # the table
    result = json.loads(out.read_text())
    assert result["version"] == 3
    assert result["problems"] == len(rows) and len(result["per_problem"]) == len(rows)
    assert result["source"] == str(problems) and result["k"] == 3
    assert result["per_problem"][-1]["answer"] == "4"  # the GSM8K answer was read
    per = result["per_problem"]
    assert all(len(r["sampled"]) == 3 for r in per)
    for r in per:  # each greedy score is the task's reward of the text it recorded
        assert r["greedy"] == reward(r["greedy_text"], r["answer"])
    assert result["greedy_accuracy"] == pytest.approx(sum(r["greedy"] for r in per) / len(per))
    mean = sum(sum(r["sampled"]) for r in per) / (3 * len(per))
    assert result["mean_reward"] == pytest.approx(mean)
    assert result["pass_at_k"] == pytest.approx(sum(max(r["sampled"]) for r in per) / len(per))
    assert 0 < result["mean_completion_tokens"] <= 12


def test_eval_cli_rejects_what_it_cannot_evaluate(tmp_path):
    proc = _eval(tmp_path / "nowhere", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "is not a directory" in proc.stderr
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "empty_run" / "config.yaml").write_text("run:\n  name: x\n")
    proc = _eval(tmp_path / "empty_run", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "no checkpoint yet" in proc.stderr
    ckpt = _tiny_checkpoint(tmp_path)
    proc = _eval(ckpt, "eval.samples=0", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "eval.samples" in proc.stderr


def test_periodic_eval_records_each_checkpointed_version(tmp_path):
    run_dir = tmp_path / "run"
    code, out = run_tiny(
        tmp_path,
        run_dir,
        "trainer.max_steps=4",
        "eval.every_steps=2",
        "eval.problems=6",
        "eval.samples=2",
        "eval.max_new_tokens=8",
    )
    assert code == 0, out
    evals = [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r.get("event") == "eval"]
    # version 0 first (eval.at_start), then every 2 steps, the final one included
    assert [r["version"] for r in evals] == [0, 2, 4]
    before_after = f"{evals[0]['greedy_accuracy']:.3f} -> {evals[-1]['greedy_accuracy']:.3f}"
    row = re.search(r"held-out greedy accuracy +(.*)", out)
    assert row and row.group(1) == f"{before_after} (v0 -> v4)", out[-2000:]
    for r in evals:
        assert r["pool"] == "evaluator" and r["problems"] == 6 and r["k"] == 2
        assert 0 <= r["greedy_accuracy"] <= 1 and 0 <= r["mean_reward"] <= r["pass_at_k"] + 1e-9
    # the final checkpoint on every CPU it may use (training is over), the others on one
    assert [r["threads"] for r in evals] == [1, 1, len(os.sched_getaffinity(0))]
    # the actor and the preprocessor stopped once they had the last version, before the
    # launcher waited for the final evaluation; the evaluator at the end
    stops = {
        r["target"]: (r["why"], r["time"])
        for r in read_jsonl(str(run_dir / "metrics.jsonl"))
        if r.get("event") == "stop"
    }
    assert stops["actor-0"][0] == stops["preprocessor-0"][0] == SYNCED, stops
    assert stops["evaluator"][0] == "the run ends" and stops["evaluator"][1] > evals[-1]["time"]
    # the CLI on the run directory evaluates its latest checkpoint and writes RUN/eval/
    proc = _eval(run_dir, "eval.problems=4", "eval.samples=2", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((run_dir / "eval" / "step-000004.json").read_text())
    assert saved["version"] == 4 and saved["problems"] == 4
    assert saved["source"].startswith("arithmetic held-out split")


def test_one_prefill_gives_what_generate_gives_with_rows_leaving_at_their_stop(tmp_path):
    """pipeline.eval.complete (one prefill per prompt, its cache repeated for the samples,
    finished rows leaving the batch) against transformers' generate on the tiny model:
    prompts of different lengths (left padding), a stop token that ends some completions
    early. Greedy: the same tokens as generate's greedy; sampled at a temperature near 0:
    the greedy tokens again (each sampled row continues its own prompt's cache)."""
    import torch

    from pipeline.eval import complete

    model, tok = load_model(materialize_model(TINY_MODEL, tiny_cache(tmp_path / "cache")))
    prompts = [[5 + i, 17, 30 + 7 * i, 42][: 2 + i % 3] + [9] * (i % 2) for i in range(6)]
    torch.manual_seed(0)
    free, _ = complete(model, tok, prompts, 1, {"max_new_tokens": 10, "temperature": 1.0})
    # a token that some greedy completions emit early and others not at all: a stop
    counts: dict[int, int] = {}
    for c in free:
        for t in set(c[1:6]):
            counts[t] = counts.get(t, 0) + 1
    stop = max((t for t, n in counts.items() if n < len(free)), key=lambda t: counts[t])
    tok.eos_token_id = stop

    def generate(p: list[int]) -> list[int]:
        out = model.generate(
            input_ids=torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=[stop],
            pad_token_id=tok.pad_token_id,
        )[0, len(p) :].tolist()
        return out[: out.index(stop)] if stop in out else out

    expected = [generate(p) for p in prompts]
    assert any(len(e) < 10 for e in expected) and any(len(e) == 10 for e in expected)
    greedy, sampled = complete(model, tok, prompts, 2, {"max_new_tokens": 10, "temperature": 1e-6})
    assert greedy == expected
    assert sampled == [e for e in expected for _ in range(2)]
    # and at temperature 1 the samples differ from greedy somewhere: they are sampled
    torch.manual_seed(1)
    _, hot = complete(model, tok, prompts, 2, {"max_new_tokens": 10, "temperature": 1.0})
    assert hot != [e for e in expected for _ in range(2)]
