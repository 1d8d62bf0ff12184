"""``python -m pipeline.bench async [--out FILE] [--budget-s S] ...``: the pipelined
(async) loop against the synchronous one, side by side in one run, on the CPU.

::

    runs    per setting (normal; longtail: a few very long answers per group) and per
            mode (sync, async): ``python -m pipeline.launch +exp=math`` with the same
            model, task, seed and overrides, every pool pinned to the same CPUs in both
            modes (pipeline.cpus), stopped with SIGINT after --budget-s seconds of
            generation (from the actor's first batch)
    reads   each run's metrics.jsonl (trainer ``step``, actor ``group`` and ``turn``)
            and its checkpoints (greedy held-out accuracy, evaluated after all runs,
            so evaluation never competes with the runs)
    writes  --out JSON (rows with ``mode`` and ``async_vs_sync_samples_per_s``), a
            Markdown table and a PNG beside it

Measured inside the budget window: samples trained per second; the fraction of
the window the trainer spends outside its steps (idle: waiting for data) and the
actor outside generation (idle: waiting for room or for the next version); the
policy lag of every trained sample (trainer version at its step minus the oldest
version of its tokens); reward per step and held-out greedy accuracy against wall
time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from pipeline.bench.common import device_name, print_table, write_json
from pipeline.telemetry import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
MODES = ("sync", "async")
# actor alone on CPU 0; trainer and preprocessor (no scorers: packing only) on CPU 1
CPUS = ["pipeline.cpus.actor=[0]", "pipeline.cpus.preprocessor=[1]", "pipeline.cpus.trainer=[1]"]
COMMON = [
    "trainer.samples_per_step=8",
    "task.group_size=4",
    "engine.prompts_per_batch=2",
    "preprocessor.scorers=[]",
    "trainer.max_steps=100000",
    "trainer.keep_checkpoints=1000",
    "metrics.tensorboard=false",
    "launch.final_sync_timeout_s=1",
]
SETTINGS = {
    "normal": ["engine.max_new_tokens=16", "engine.temperature=0.7"],
    # temperature 1 and room for 64 tokens: most answers stay short, a few per group
    # ramble to the limit, and a batch lasts as long as its longest answer
    "longtail": ["engine.max_new_tokens=64", "engine.temperature=1.0"],
}


def launch(run_dir: Path, mode: str, overrides: list[str]) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "pipeline.launch", "+exp=math", f"run_dir={run_dir}"]
    cmd += [f"pipeline.mode={mode}", *CPUS, *overrides]
    log = open(run_dir.parent / f"{run_dir.name}.launcher.log", "w")  # noqa: SIM115
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def generation_start(records: list[dict]) -> float | None:
    """When the actor began its first batch (the budget window starts there)."""
    turns = [r for r in records if r.get("event") == "turn"]
    if not turns:
        return None
    first = min(turns, key=lambda r: r["time"])
    return first["time"] - first["generate_s"] - first["wait_s"]


def run_one(run_dir: Path, mode: str, overrides: list[str], budget_s: float) -> dict:
    """Launch, wait for the budget window to pass, stop; return the window's bounds."""
    load_before = os.getloadavg()[0]
    proc = launch(run_dir, mode, overrides)
    metrics, t0, deadline = run_dir / "metrics.jsonl", None, time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the {mode} run exited early; see {run_dir}/logs")
            t0 = t0 or generation_start(read_jsonl(str(metrics)))
            if t0 is not None and time.time() >= t0 + budget_s:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the {mode} run did not start generating in time")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"t0": t0, "t_end": t0 + budget_s, "load_before": load_before}


def measure(run_dir: Path, window: dict, budget_s: float) -> dict:
    """Throughput, idle fractions, lag distribution and curves inside the window."""
    records = read_jsonl(str(run_dir / "metrics.jsonl"))
    t0, t_end = window["t0"], window["t_end"]
    inside = lambda r: t0 <= r["time"] <= t_end  # noqa: E731
    steps = [r for r in records if r.get("event") == "step" and inside(r)]
    turns = [r for r in records if r.get("event") == "turn" and inside(r)]
    saves = [r for r in records if r.get("event") == "checkpoint" and inside(r)]
    versions = {r["group"]: r["versions"] for r in records if r.get("event") == "group"}
    lags: Counter = Counter()
    for r in steps:
        for sid in r["sample_ids"]:
            lags[(r["step"] - 1) - versions[sid.rsplit("/", 1)[0]][0]] += 1
    samples = sum(r["samples"] for r in steps)
    busy_s = sum(r["step_s"] for r in steps) + sum(r["checkpoint_s"] for r in saves)
    trained_tokens = sum(r.get("tokens", 0) for r in steps)
    rewards = [r["reward_mean"] for r in steps]
    half = max(1, len(rewards) // 2)
    steady = None  # between the first and the last step: start-up left out
    if len(steps) > 1:
        span = steps[-1]["time"] - steps[0]["time"]
        steady = round(sum(r["samples"] for r in steps[1:]) / span, 4) if span > 0 else None
    return {
        "steps": len(steps),
        "samples_trained": samples,
        "samples_per_s": round(samples / budget_s, 4),
        "samples_per_s_between_steps": steady,
        "trainer_idle_frac": round(1 - min(busy_s / budget_s, 1), 3),
        "actor_idle_frac": round(1 - min(sum(r["generate_s"] for r in turns) / budget_s, 1), 3),
        "policy_lag": {str(k): v for k, v in sorted(lags.items())},
        "mean_completion_tokens": round(trained_tokens / samples, 1) if samples else None,
        "reward_first_half": round(sum(rewards[:half]) / half, 3) if rewards else None,
        "reward_second_half": round(sum(rewards[half:]) / max(len(rewards) - half, 1), 3)
        if len(rewards) > 1
        else None,
        "reward_curve": [[round(r["time"] - t0, 1), r["reward_mean"]] for r in steps],
        "load_avg_1m_before": round(window["load_before"], 2),
    }


def accuracy_curve(run_dir: Path, t0: float, t_end: float, cfg_overrides: list[str]) -> list:
    """[seconds since t0, version, greedy held-out accuracy] per checkpoint in the window."""
    from pipeline.config import load_config
    from pipeline.eval import evaluate_checkpoint
    from pipeline.evaluator import checkpoints

    cfg = load_config(str(run_dir / "config.yaml"), cfg_overrides)
    out = []
    for path, version in checkpoints(str(run_dir)):
        written = os.path.getmtime(os.path.join(path, "trainer_state.json"))
        if written <= t_end:
            res = evaluate_checkpoint(path, cfg)
            out.append([round(written - t0, 1), version, res.greedy_accuracy])
    return out


def initial_accuracy(run_dir: Path, cfg_overrides: list[str]) -> float:
    from pipeline.config import load_config
    from pipeline.eval import evaluate_checkpoint

    cfg = load_config(str(run_dir / "config.yaml"), cfg_overrides)
    return evaluate_checkpoint(cfg.model.path, cfg).greedy_accuracy


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({r["setting"] for r in rows}, key=list(SETTINGS).index)
    fig, axes = plt.subplots(2, len(settings), figsize=(6 * len(settings), 7), squeeze=False)
    for col, setting in enumerate(settings):
        ax, ax2 = axes[0][col], axes[1][col]
        for i, r in enumerate(x for x in rows if x["setting"] == setting):
            curve = r["reward_curve"]
            if curve:
                ax.plot(*zip(*curve, strict=True), "o-", ms=3, color=f"C{i}", label=r["mode"])
            acc = r.get("accuracy_curve") or []
            if acc:
                ax2.plot(
                    [a[0] for a in acc], [a[2] for a in acc], "s-", color=f"C{i}", label=r["mode"]
                )
        ax.set(title=f"{setting}: reward of trained samples", xlabel="seconds", ylabel="reward")
        ax.legend(fontsize=8)
        ax2.set(title=f"{setting}: held-out greedy accuracy", xlabel="seconds", ylabel="accuracy")
        if not ax2.lines:
            ax2.text(0.5, 0.5, "not evaluated", ha="center", transform=ax2.transAxes)
        else:
            ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def markdown(rows: list[dict], meta: dict) -> str:
    cols = ["setting", "mode", "steps", "samples_per_s", "async_vs_sync_samples_per_s"]
    cols += [
        "samples_per_s_between_steps",
        "trainer_idle_frac",
        "actor_idle_frac",
        "policy_lag",
        "mean_completion_tokens",
    ]
    cols += ["reward_first_half", "reward_second_half", "accuracy"]
    lines = [
        f"# async vs sync on the CPU ({meta['date']})",
        "",
        f"`{meta['command']}` ({meta['wall_s']:.0f} s). {meta['machine']}; model "
        f"{meta['model']}; budget {meta['budget_s']:g} s of generation per run; pools pinned "
        f"({' '.join(CPUS)}); load: {meta['load_note']}",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        acc = r.get("accuracy_curve") or []
        r = r | {"accuracy": " -> ".join(f"{a[2]:.2f}" for a in acc) or "-"}
        lines.append("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    return "\n".join(lines + ["", *meta["notes"], ""])


def notes(rows: list[dict]) -> list[str]:
    """Plain statements about what the numbers can and cannot show."""
    out = []
    for r in rows:
        acc = [a[2] for a in r.get("accuracy_curve") or []]
        if acc:
            moved = max(acc) - min(acc) >= 0.1
            out.append(
                f"- {r['setting']}/{r['mode']}: held-out greedy accuracy "
                f"{' -> '.join(f'{a:.2f}' for a in acc)} over {r['steps']} steps"
                + ("" if moved else ": the run is too short for accuracy to move")
            )
    lags = [r for r in rows if r["mode"] == "sync" and set(r["policy_lag"]) - {"0"}]
    if lags:
        out.append(f"- WARNING: sync rows with non-zero lag: {[r['setting'] for r in lags]}")
    return out


def render(path: str) -> None:
    """Rewrite the Markdown table and the plot from a saved JSON."""
    import json

    with open(path) as f:
        payload = json.load(f)
    meta, rows = payload["meta"], payload["rows"]
    meta["notes"] = notes(rows) + meta.get("extra_notes", [])
    base = os.path.splitext(path)[0]
    with open(base + ".md", "w") as f:
        f.write(markdown(rows, meta))
    plot(rows, base + ".png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench async")
    p.add_argument("--out", default="bench/results/async-cpu.json")
    p.add_argument("--budget-s", type=float, default=120.0, help="generation seconds per run")
    p.add_argument("--settings", default="normal,longtail")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=2)
    p.add_argument("--eval-problems", type=int, default=16)
    p.add_argument("--no-eval", action="store_true", help="skip held-out accuracy")
    p.add_argument("--set", nargs="*", default=[], help="extra overrides for every run")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--render", metavar="JSON", help="only rewrite the table and plot of JSON")
    args = p.parse_args(argv)
    if args.render:
        render(args.render)
        return 0
    start, work = time.time(), Path(tempfile.mkdtemp(prefix="bench-async-"))
    rows = []
    for setting in args.settings.split(","):
        overrides = COMMON + SETTINGS[setting] + args.set
        overrides += [f"run.seed={args.seed}", f"trainer.checkpoint_every={args.checkpoint_every}"]
        for mode in MODES:
            run_dir = work / f"{setting}-{mode}"
            print(f"{setting} / {mode}: running {args.budget_s:g} s ...", flush=True)
            window = run_one(run_dir, mode, overrides, args.budget_s)
            row = {"setting": setting, "mode": mode, "run_dir": str(run_dir)}
            rows.append(row | window | measure(run_dir, window, args.budget_s))
        pair = {r["mode"]: r for r in rows if r["setting"] == setting}
        ratio = pair["async"]["samples_per_s"] / max(pair["sync"]["samples_per_s"], 1e-9)
        for r in pair.values():
            r["async_vs_sync_samples_per_s"] = round(ratio, 3)
    if not args.no_eval:  # after every run, so evaluation never competes with them
        ev = [f"eval.problems={args.eval_problems}", "eval.samples=1", "eval.batch_size=16"]
        init = None  # the same initial model in both modes: evaluated once
        for r in rows:
            if r["setting"] == "normal":
                print(f"evaluating {r['setting']} / {r['mode']} checkpoints ...", flush=True)
                init = init if init is not None else initial_accuracy(Path(r["run_dir"]), ev)
                curve = accuracy_curve(Path(r["run_dir"]), r["t0"], r["t_end"], ev)
                r["accuracy_curve"] = [[0.0, 0, init], *curve]
    for r in rows:
        if not args.keep:
            shutil.rmtree(r["run_dir"], ignore_errors=True)
    cols = ["setting", "mode", "steps", "samples_per_s", "async_vs_sync_samples_per_s"]
    print_table(rows, cols + ["trainer_idle_frac", "actor_idle_frac", "mean_completion_tokens"])
    for r in rows:
        print(f"{r['setting']}/{r['mode']} policy lag: {r['policy_lag']}")
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m pipeline.bench async " + " ".join(argv or sys.argv[1:]),
        "machine": device_name(),
        "model": "smollm2-135m-instruct (+exp=math)",
        "budget_s": args.budget_s,
        "wall_s": time.time() - start,
        "load_note": "1-min load average before each run is in the rows (other processes "
        "shared both cores)",
    }
    write_json(args.out, {"meta": meta, "rows": rows})
    render(args.out)
    return 0
