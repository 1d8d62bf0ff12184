"""``python -m pipeline.bench learn [--out FILE] [--steps N] [--repeats R] ...``: does it
learn, and which objective learns faster? The default objective against the others of
the family (README "The objective"), same seed, task, model and budget, interleaved.

::

    runs    per repeat, per variant in turn (default, truncated_is, no_std, ...):
            ``python -m pipeline.launch +exp=math trainer.max_steps=N`` with the
            variant's overrides, the evaluator on (version 0 and the final version,
            greedy, on the held-out split), to its end
    reads   each run's metrics.jsonl: trainer ``step`` (reward per step, time), evaluator
            ``eval`` (held-out greedy accuracy, mean reward)
    writes  --out JSON (``rows``: one per run; ``summary``: per variant the median and
            range over repeats of the final held-out accuracy, its gain over version 0,
            the reward of the last steps, wall seconds), a Markdown table and a PNG
            (reward against step and against wall time; accuracy before and after)

Same seed in every variant and repeat: the repeats differ only by what the machine
does to the timing of the pipelined run (which versions generated which samples), so
their spread is the pipeline's own noise at this budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pipeline.bench.common import LoadProbe, device_name, print_table, stop_process, write_json
from pipeline.telemetry import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {
    "default": [],
    "truncated_is": ["trainer.off_policy=truncated_is"],
    "no_std": ["trainer.advantage_std=none"],
    "seq_mean": ["trainer.loss_aggregation=seq_mean_token_mean"],
    "k3_ratio_kl": ["trainer.kl_coef=0.05", "trainer.kl_estimator=k3_ratio"],
}
COMMON = ["metrics.tensorboard=false"]


def run_one(run_dir: Path, overrides: list[str], timeout_s: float, logs: Path) -> dict:
    """One whole run to its end (the launcher waits for the final evaluation); the
    launcher's output goes to ``logs``, which outlives the run directory."""
    probe, t0 = LoadProbe(), time.monotonic()
    cmd = [sys.executable, "-m", "pipeline.launch", "+exp=math", f"run_dir={run_dir}"]
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{run_dir.name}.launcher.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, *COMMON, *overrides],
            cwd=ROOT,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"{run_dir.name} did not finish in {timeout_s:.0f}s; see {log}"
            ) from None
        finally:  # timed out, Ctrl-C or SIGTERM: the launcher stops its pools and Redis
            stop_process(proc, signal.SIGTERM)
    if code != 0:
        raise RuntimeError(f"{run_dir.name} exited {code}; see {log}")
    return {"wall_s": round(time.monotonic() - t0, 1), "load": probe.end()}


def measure(run_dir: Path) -> dict:
    records = read_jsonl(str(run_dir / "metrics.jsonl"))
    steps = sorted((r for r in records if r.get("event") == "step"), key=lambda r: r["step"])
    evals = sorted((r for r in records if r.get("event") == "eval"), key=lambda r: r["version"])
    if not steps or len(evals) < 2:
        raise RuntimeError(f"{run_dir}: {len(steps)} steps and {len(evals)} evaluations")
    t0 = min(r["time"] for r in records if "time" in r)
    last = steps[-max(1, len(steps) // 4) :]
    return {
        "steps": len(steps),
        "acc_v0": evals[0]["greedy_accuracy"],
        "acc_final": evals[-1]["greedy_accuracy"],
        "acc_gain": round(evals[-1]["greedy_accuracy"] - evals[0]["greedy_accuracy"], 4),
        "eval_mean_reward_final": evals[-1]["mean_reward"],
        "final_version": evals[-1]["version"],
        "reward_last_quarter": round(float(np.mean([r["reward_mean"] for r in last])), 4),
        "kl_last": steps[-1].get("kl"),
        "clip_frac_mean": round(float(np.mean([r.get("clip_frac", 0.0) for r in steps])), 4),
        "reward_curve": [[r["step"], round(r["time"] - t0, 1), r["reward_mean"]] for r in steps],
    }


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]

        def stat(key: str, mine=mine) -> tuple:
            xs = [r[key] for r in mine if r.get(key) is not None]
            if not xs:
                return None, None, None
            return round(float(np.median(xs)), 4), round(min(xs), 4), round(max(xs), 4)

        row = {"variant": variant, "runs": len(mine)}
        for key in ("acc_v0", "acc_final", "acc_gain", "reward_last_quarter", "wall_s"):
            med, lo, hi = stat(key)
            row[key] = med
            row[f"{key}_range"] = f"{lo}-{hi}" if med is not None else "-"
        out.append(row)
    return out


COLUMNS = ["variant", "runs", "acc_v0", "acc_final", "acc_final_range", "acc_gain"]
COLUMNS += ["acc_gain_range", "reward_last_quarter", "reward_last_quarter_range", "wall_s"]


def markdown(payload: dict) -> str:
    lines = [
        f"# learn: {payload['setup']}",
        "",
        f"device: {payload['device']}; {payload['repeats']} interleaved repeats per variant; "
        f"started {payload['started']}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in payload["summary"]:
        lines.append("| " + " | ".join(str(r.get(c)) for c in COLUMNS) + " |")
    lines += ["", "Per run:", ""]
    lines.append(
        "| variant | repeat | acc v0 -> final | reward last quarter | wall s | load 1-min |"
    )
    lines.append("|---|---|---|---|---|---|")
    for r in payload["rows"]:
        load = r["load"]
        lines.append(
            f"| {r['variant']} | {r['repeat']} | {r['acc_v0']:.3f} -> {r['acc_final']:.3f} | "
            f"{r['reward_last_quarter']:.3f} | {r['wall_s']} | "
            f"{load['load_avg_before'][0]} -> {load['load_avg_after'][0]} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    colors = dict(zip(dict.fromkeys(r["variant"] for r in rows), plt.cm.tab10.colors, strict=False))
    for r in rows:
        curve = np.asarray(r["reward_curve"])
        kw = dict(color=colors[r["variant"]], alpha=0.7, label=f"{r['variant']} #{r['repeat']}")
        a.plot(curve[:, 0], curve[:, 2], **kw)
        b.plot(curve[:, 1], curve[:, 2], **kw)
        c.plot([0, r["final_version"]], [r["acc_v0"], r["acc_final"]], marker="o", **kw)
    a.set(xlabel="trainer step", ylabel="reward (mean of the step's samples)")
    b.set(xlabel="wall seconds since start", ylabel="reward")
    c.set(xlabel="policy version", ylabel="held-out greedy accuracy")
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench learn", description=__doc__)
    p.add_argument("--out", default="outputs/bench/learn.json")
    p.add_argument("--steps", type=int, default=10, help="trainer.max_steps of each run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default="default,truncated_is,no_std", help=",".join(VARIANTS))
    p.add_argument("--eval-problems", type=int, default=32)
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per run")
    p.add_argument("--render", help="a JSON (or its .partial) to summarise and redraw")
    p.add_argument("extra", nargs="*", help="Hydra overrides for every run")
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            payload = json.load(f)
        finish(payload, args.out)
        return 0
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    overrides = [
        f"trainer.max_steps={args.steps}",
        f"trainer.checkpoint_every={args.steps}",  # the evaluator reads the final one
        f"eval.every_steps={args.steps}",
        f"eval.problems={args.eval_problems}",
        "eval.samples=2",
        *args.extra,
    ]
    payload = {
        "setup": f"+exp=math trainer.max_steps={args.steps} " + " ".join(overrides[1:]),
        "device": device_name("cpu"),
        "repeats": args.repeats,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "variants": {v: VARIANTS[v] for v in variants},
        "rows": [],
    }
    work = Path(tempfile.mkdtemp(prefix="bench-learn-"))
    total, n = args.repeats * len(variants), 0
    try:
        for repeat in range(args.repeats):
            for variant in variants:  # interleaved: drift in the load hits every variant
                n += 1
                print(f"[{n}/{total}] {variant} repeat {repeat} ...", flush=True)
                run_dir = work / f"{variant}-{repeat}"
                row = {"variant": variant, "repeat": repeat}
                logs = Path(os.path.splitext(args.out)[0] + "-logs")
                row |= run_one(run_dir, overrides + VARIANTS[variant], args.timeout_s, logs)
                row |= measure(run_dir)
                print(
                    f"    acc {row['acc_v0']:.3f} -> {row['acc_final']:.3f}, reward last "
                    f"quarter {row['reward_last_quarter']:.3f}, {row['wall_s']} s",
                    flush=True,
                )
                payload["rows"].append(row)
                write_json(args.out + ".partial", payload)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    finish(payload, args.out)
    if os.path.exists(args.out + ".partial"):
        os.remove(args.out + ".partial")
    return 0


def finish(payload: dict, out: str) -> None:
    """The summary per variant, printed and saved with the Markdown table and the PNG."""
    payload["summary"] = summarize(payload["rows"])
    print_table(payload["summary"], COLUMNS)
    write_json(out, payload)
    base = os.path.splitext(out)[0]
    with open(base + ".md", "w") as f:
        f.write(markdown(payload))
    plot(payload["rows"], base + ".png")
