"""``python -m pipeline.bench async [--out FILE] [--budget-s S] [--repeats N] ...``: the
pipelined (async) loop against the synchronous one on the CPU, each mode run
``--repeats`` times, interleaved (sync, async, sync, async, ...), so drift in the
machine's load hits both.

::

    runs    per setting (normal; longtail: a few very long answers per group), per
            repeat and per mode (sync, async): ``python -m pipeline.launch +exp=math``
            with the same model, task, seed and overrides, every pool pinned to the
            same CPUs in both modes (pipeline.cpus), stopped with SIGINT after
            --budget-s seconds of generation (from the actor's first batch)
    reads   each run's metrics.jsonl (trainer ``step`` and ``checkpoint``, actor
            ``group`` and ``turn``), /proc/stat and the load average (LoadProbe), and
            the checkpoints of repeat 0 (greedy held-out accuracy, evaluated after all
            runs, so evaluation never competes with them)
    writes  --out JSON (``rows``: one per run; ``summary``: per setting the async/sync
            ratio of each interleaved pair, its median, min and max), a Markdown table
            and a PNG beside it (and FILE.partial after each run until the end)

The headline is the steady-state rate: samples trained per second from the
``--warmup-steps``-th step record inside the window to the last one (start-up and the
first steps left out), with, over the same span, the trainer's busy seconds per step
(step + checkpoint) and the actor's generating seconds per sample, and their idle
shares. Also per run: the whole window's rate (start-up included; not a result), the
policy lag of every trained sample (trainer version at its step minus the oldest
version of its tokens), reward per step, held-out greedy accuracy against wall time,
the 1/5/15-min load average before and after and the CPU the rest of the machine used.
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

import numpy as np
from omegaconf import OmegaConf

from pipeline.bench.common import LoadProbe, device_name, print_table, write_json
from pipeline.telemetry import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
MODES = ("sync", "async")
# actor alone on CPU 0; trainer and preprocessor (no scorers: packing only) on CPU 1
CPUS = ["pipeline.cpus.actor=[0]", "pipeline.cpus.preprocessor=[1]", "pipeline.cpus.trainer=[1]"]
COMMON = [
    "actor.engine=hf",  # as measured in async-cpu-2026-11-24 (+exp=math now says auto)
    "trainer.samples_per_step=8",
    "task.group_size=4",
    "sampling.prompts_per_batch=2",
    "preprocessor.scorers=[]",
    "trainer.max_steps=100000",
    "trainer.keep_checkpoints=1000",
    "metrics.tensorboard=false",
    "launch.final_sync_timeout_s=1",
]
SETTINGS = {
    "normal": ["sampling.max_new_tokens=16", "sampling.temperature=0.7"],
    # temperature 1 and room for 64 tokens: most answers stay short, a few per group
    # ramble to the limit, and a batch lasts as long as its longest answer
    "longtail": ["sampling.max_new_tokens=64", "sampling.temperature=1.0"],
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
    """Launch, wait for the budget window to pass, stop; return the window's bounds and
    the machine's load over the run (start-up included)."""
    probe = LoadProbe()
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
    return {"t0": t0, "t_end": t0 + budget_s, "load": probe.end()}


def steady(steps: list[dict], turns: list[dict], saves: list[dict], warmup: int, g: int) -> dict:
    """Rates between the ``warmup``-th step and the last one of the window: samples trained
    per second over that span (the steps after the warmup-th, over the time from its
    record to the last's), and, per trained step in that span, the trainer's busy seconds
    (step and checkpoint) and the actor's generating seconds, and each one's idle share."""
    if len(steps) < warmup + 2:
        return {"steady_samples_per_s": None, "steady_steps": 0}
    a, b = steps[warmup]["time"], steps[-1]["time"]
    span = b - a
    after = steps[warmup + 1 :]
    inside = lambda r: a < r["time"] <= b  # noqa: E731
    train_s = sum(r["step_s"] for r in after)
    train_s += sum(r["checkpoint_s"] for r in saves if inside(r))
    mine = [r for r in turns if inside(r)]
    gen_s = sum(r["generate_s"] for r in mine)
    generated = sum(r["groups"] for r in mine) * g
    return {
        "steady_samples_per_s": round(sum(r["samples"] for r in after) / span, 4),
        "steady_steps": len(after),
        "steady_span_s": round(span, 1),
        "steady_s_per_step": round(span / len(after), 2),
        "steady_trainer_busy_s_per_step": round(train_s / len(after), 2),
        "steady_trainer_idle_frac": round(1 - min(train_s / span, 1), 3),
        "steady_actor_generate_s_per_sample": round(gen_s / generated, 3) if generated else None,
        "steady_actor_idle_frac": round(1 - min(gen_s / span, 1), 3),
    }


def measure(run_dir: Path, window: dict, budget_s: float, warmup: int) -> dict:
    """Throughput, idle fractions, lag distribution and curves inside the window."""
    records = read_jsonl(str(run_dir / "metrics.jsonl"))
    t0, t_end = window["t0"], window["t_end"]
    inside = lambda r: t0 <= r["time"] <= t_end  # noqa: E731
    steps = [r for r in records if r.get("event") == "step" and inside(r)]
    turns = [r for r in records if r.get("event") == "turn" and inside(r)]
    saves = [r for r in records if r.get("event") == "checkpoint" and inside(r)]
    versions = {r["group"]: r["versions"] for r in records if r.get("event") == "group"}
    cfg = OmegaConf.load(run_dir / "config.yaml")
    lags: Counter = Counter()
    for r in steps:
        for sid in r["sample_ids"]:
            lags[(r["step"] - 1) - versions[sid.rsplit("/", 1)[0]][0]] += 1
    samples = sum(r["samples"] for r in steps)
    busy_s = sum(r["step_s"] for r in steps) + sum(r["checkpoint_s"] for r in saves)
    trained_tokens = sum(r.get("tokens", 0) for r in steps)
    rewards = [r["reward_mean"] for r in steps]
    half = max(1, len(rewards) // 2)
    return {
        "steps": len(steps),
        "samples_trained": samples,
        "samples_per_s_window": round(samples / budget_s, 4),
        **steady(steps, turns, saves, warmup, int(cfg.task.group_size)),
        "trainer_idle_frac_window": round(1 - min(busy_s / budget_s, 1), 3),
        "actor_idle_frac_window": round(
            1 - min(sum(r["generate_s"] for r in turns) / budget_s, 1), 3
        ),
        "policy_lag": {str(k): v for k, v in sorted(lags.items())},
        "samples_per_step": int(cfg.trainer.samples_per_step),
        "mean_completion_tokens": round(trained_tokens / samples, 1) if samples else None,
        "reward_first_half": round(sum(rewards[:half]) / half, 3) if rewards else None,
        "reward_second_half": round(sum(rewards[half:]) / max(len(rewards) - half, 1), 3)
        if len(rewards) > 1
        else None,
        "reward_curve": [[round(r["time"] - t0, 1), r["reward_mean"]] for r in steps],
    }


def _median(xs: list[float]) -> float | None:
    return round(float(np.median(xs)), 4) if xs else None


def compare(rows: list[dict]) -> list[dict]:
    """Per setting: async / sync steady rate of each interleaved pair (repeat k's sync and
    async runs, back to back), their median and range, and the medians of each mode."""
    return [
        compare_setting(setting, [r for r in rows if r["setting"] == setting])
        for setting in dict.fromkeys(r["setting"] for r in rows)
    ]


def compare_setting(setting: str, rows: list[dict]) -> dict:
    by = {(r["mode"], r["repeat"]): r for r in rows}
    reps = sorted({k for _, k in by})

    def values(mode: str, key: str) -> list[float]:
        return [by[(mode, k)][key] for k in reps if by.get((mode, k), {}).get(key) is not None]

    rate = lambda m, k: by.get((m, k), {}).get("steady_samples_per_s")  # noqa: E731
    pairs = [k for k in reps if rate("sync", k) and rate("async", k)]
    ratios = [rate("async", k) / rate("sync", k) for k in pairs]
    keys = (
        "steady_samples_per_s",
        "steady_trainer_busy_s_per_step",
        "steady_actor_generate_s_per_sample",
        "steady_trainer_idle_frac",
        "steady_actor_idle_frac",
    )
    return {
        "setting": setting,
        "pairs": len(pairs),
        "ratios": [round(x, 3) for x in ratios],
        "ratio_median": round(_median(ratios), 3) if ratios else None,
        "ratio_min": round(min(ratios), 3) if ratios else None,
        "ratio_max": round(max(ratios), 3) if ratios else None,
        **{f"{m}_{key}_median": _median(values(m, key)) for key in keys for m in MODES},
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
    fig, axes = plt.subplots(3, len(settings), figsize=(6 * len(settings), 10), squeeze=False)
    color = {"sync": "C0", "async": "C1"}
    for col, setting in enumerate(settings):
        ax0, ax, ax2 = axes[0][col], axes[1][col], axes[2][col]
        mine = [x for x in rows if x["setting"] == setting]
        for mode in MODES:
            pts = [(r["repeat"], r["steady_samples_per_s"]) for r in mine if r["mode"] == mode]
            pts = [p for p in pts if p[1] is not None]
            if pts:
                ax0.plot(*zip(*pts, strict=True), "o", color=color[mode], label=mode)
        ax0.set_xticks(sorted({r["repeat"] for r in mine}))
        ax0.set(
            title=f"{setting}: samples/s between steps (after warm-up), per repeat",
            xlabel="repeat (sync then async, back to back)",
            ylabel="samples / s",
            ylim=(0, None),
        )
        ax0.legend(fontsize=8)
        for r in mine:
            curve, lab = r["reward_curve"], f"{r['mode']}" if r["repeat"] == 0 else None
            if curve:
                ax.plot(*zip(*curve, strict=True), "o-", ms=3, color=color[r["mode"]], label=lab)
            acc = r.get("accuracy_curve") or []
            if acc:
                ax2.plot(
                    [a[0] for a in acc], [a[2] for a in acc], "s-", color=color[r["mode"]],
                    label=f"{r['mode']} (repeat {r['repeat']})",
                )  # fmt: skip
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


RUN_COLS = [
    "setting", "repeat", "mode", "steps", "steady_steps", "steady_samples_per_s",
    "steady_s_per_step", "steady_trainer_busy_s_per_step", "steady_actor_generate_s_per_sample",
    "steady_trainer_idle_frac", "steady_actor_idle_frac", "samples_per_s_window", "policy_lag",
    "mean_completion_tokens", "load_1m", "other_cpu_cores",
]  # fmt: skip
SUMMARY_COLS = [
    "setting", "pairs", "ratio_median", "ratio_min", "ratio_max", "ratios",
    "sync_steady_samples_per_s_median", "async_steady_samples_per_s_median",
]  # fmt: skip


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return out + ["| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |" for r in rows]


def markdown(rows: list[dict], summary: list[dict], meta: dict) -> str:
    rows = [
        r
        | {
            "load_1m": f"{r['load']['load_avg_before'][0]} -> {r['load']['load_avg_after'][0]}",
            "other_cpu_cores": r["load"]["other_cpu_cores"],
        }
        for r in rows
    ]
    lines = [
        f"# async vs sync on the CPU ({meta['date']})",
        "",
        f"`{meta['command']}` ({meta['wall_s']:.0f} s). {meta['machine']}; model "
        f"{meta['model']}; budget {meta['budget_s']:g} s of generation per run; "
        f"{meta['repeats']} repeats per mode, interleaved (sync, async, sync, async, ...); "
        f"steady state = samples trained per second from step {meta['warmup_steps']} of the "
        f"window to its last step; pools pinned ({' '.join(CPUS)}); load: {meta['load_note']}",
        "",
        "## async / sync, steady state",
        "",
        *_table(summary, SUMMARY_COLS),
        "",
        "## every run",
        "",
        *_table(rows, RUN_COLS),
        "",
        *meta["notes"],
        "",
    ]
    return "\n".join(lines)


def notes(rows: list[dict], summary: list[dict]) -> list[str]:
    """Plain statements about what the numbers can and cannot show."""
    out = []
    for s in summary:
        if s["ratio_median"] is None:
            out.append(f"- {s['setting']}: no steady-state pair (too few steps per run)")
            continue
        out.append(
            f"- {s['setting']}: async / sync samples/s between steps: median "
            f"{s['ratio_median']:.2f}x (min {s['ratio_min']:.2f}, max {s['ratio_max']:.2f}) over "
            f"{s['pairs']} interleaved pairs; medians {s['sync_steady_samples_per_s_median']} "
            f"(sync) and {s['async_steady_samples_per_s_median']} (async) samples/s"
        )
        g = {m: s[f"{m}_steady_actor_generate_s_per_sample_median"] for m in MODES}
        t = {m: s[f"{m}_steady_trainer_busy_s_per_step_median"] for m in MODES}
        spp = next(r["samples_per_step"] for r in rows if r["setting"] == s["setting"])
        if None not in g.values() and None not in t.values():
            gen = {m: g[m] * spp for m in MODES}
            out.append(
                f"- {s['setting']}: per step of {spp} samples, the actor generated for "
                f"{gen['sync']:.1f} s (sync) / {gen['async']:.1f} s (async) and the trainer "
                f"was busy {t['sync']:.1f} s / {t['async']:.1f} s (medians). With sync's own "
                f"times, perfect overlap would give "
                f"{(gen['sync'] + t['sync']) / max(gen['sync'], t['sync']):.2f}x at most "
                f"(generate + train against the longer of the two)"
            )
    for r in rows:
        acc = [a[2] for a in r.get("accuracy_curve") or []]
        if acc:
            moved = max(acc) - min(acc) >= 0.1
            out.append(
                f"- {r['setting']}/{r['mode']} repeat {r['repeat']}: held-out greedy accuracy "
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
    meta, rows, summary = payload["meta"], payload["rows"], payload["summary"]
    meta["notes"] = notes(rows, summary) + meta.get("extra_notes", [])
    base = os.path.splitext(path)[0]
    with open(base + ".md", "w") as f:
        f.write(markdown(rows, summary, meta))
    plot(rows, base + ".png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench async")
    p.add_argument("--out", default="bench/results/async-cpu.json")
    p.add_argument("--budget-s", type=float, default=120.0, help="generation seconds per run")
    p.add_argument("--settings", default="normal,longtail")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved")
    p.add_argument(
        "--warmup-steps", type=int, default=2, help="steady state from this step of the window"
    )
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
    if args.repeats < 1 or args.warmup_steps < 0:
        raise ValueError("--repeats must be >= 1 and --warmup-steps >= 0")
    unknown = set(args.settings.split(",")) - set(SETTINGS)
    if unknown:
        raise ValueError(f"--settings: unknown {sorted(unknown)}; choose from {list(SETTINGS)}")
    start, work = time.time(), Path(tempfile.mkdtemp(prefix="bench-async-"))
    probe, rows = LoadProbe(), []
    for setting in args.settings.split(","):
        overrides = COMMON + SETTINGS[setting] + args.set
        overrides += [f"run.seed={args.seed}", f"trainer.checkpoint_every={args.checkpoint_every}"]
        for rep in range(args.repeats):
            for mode in MODES:  # interleaved: drift in the machine's load hits both modes
                run_dir = work / f"{setting}-{rep}-{mode}"
                print(f"{setting} #{rep} / {mode}: running {args.budget_s:g} s ...", flush=True)
                window = run_one(run_dir, mode, overrides, args.budget_s)
                row = {"setting": setting, "repeat": rep, "mode": mode, "run_dir": str(run_dir)}
                row |= window | measure(run_dir, window, args.budget_s, args.warmup_steps)
                rows.append(row)
                print_table([row], RUN_COLS[:12])
                write_json(args.out + ".partial", {"rows": rows})  # kept if stopped later
    summary = compare(rows)
    if not args.no_eval:  # after every run, so evaluation never competes with them
        ev = [f"eval.problems={args.eval_problems}", "eval.samples=1", "eval.batch_size=16"]
        init = None  # the same initial model in both modes: evaluated once
        for r in rows:
            if r["setting"] == "normal" and r["repeat"] == 0:
                print(f"evaluating {r['setting']} / {r['mode']} checkpoints ...", flush=True)
                init = init if init is not None else initial_accuracy(Path(r["run_dir"]), ev)
                curve = accuracy_curve(Path(r["run_dir"]), r["t0"], r["t_end"], ev)
                r["accuracy_curve"] = [[0.0, 0, init], *curve]
    for r in rows:
        if not args.keep:
            shutil.rmtree(r["run_dir"], ignore_errors=True)
    print_table(rows, RUN_COLS[:12])
    print_table(summary, SUMMARY_COLS)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m pipeline.bench async " + " ".join(argv or sys.argv[1:]),
        "machine": device_name(),
        "model": "smollm2-135m-instruct (+exp=math)",
        "budget_s": args.budget_s,
        "repeats": args.repeats,
        "warmup_steps": args.warmup_steps,
        "wall_s": time.time() - start,
        "load": probe.end(),
        "load_note": "per run in the rows (`load`: 1/5/15-min load average before and after, "
        "and other_cpu_cores: CPU the rest of the machine used during the run, in cores, "
        "from /proc/stat less this bench's own processes)",
    }
    write_json(args.out, {"meta": meta, "rows": rows, "summary": summary})
    os.remove(args.out + ".partial")
    render(args.out)
    return 0
