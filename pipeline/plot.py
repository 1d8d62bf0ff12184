"""``python -m pipeline.plot RUN_DIR``: PNGs of a run from its ``metrics.jsonl``.

::

    reads   RUN_DIR/metrics.jsonl (events "group", "preprocessed", "step", "swap", "eval"),
            RUN_DIR/config.yaml (limits drawn as reference lines), RUN_DIR/summary.json
    writes  RUN_DIR/plots/{reward,policy_lag,throughput,stalls,eval}.png
    blocks  never (works on a live run too: a half-written last line is skipped)

- reward: mean reward of each trainer step and of generated groups (rolling mean);
  accuracy too when records carry an ``accuracy`` field.
- policy_lag: trainer version minus the oldest token version trained in each step,
  with ``trainer.max_lag``, and samples dropped as stale.
- throughput: trained samples/s and tokens/s; generated samples/s; each rate taken
  over at least 1/20 of the run and 3 events (no spike from the first events).
- stalls: per-actor pauses of generation for new weights (``swap`` records: the
  forward lock held for a staged swap, or for a whole in-place receive) and the
  trainer's wait for data between steps.
- eval: held-out greedy accuracy, pass@k and mean reward per policy version (``eval``
  records of the evaluator pool), against the version and against the wall time its
  checkpoint was written.

matplotlib (Agg backend) is needed: ``pip install -e '.[plot]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any

from pipeline.telemetry import surviving_steps

PLOTS = ("reward", "policy_lag", "throughput", "stalls", "eval")


def read_records(path: str) -> list[dict]:
    """Every complete JSON line (a live run may be mid-way through writing the last)."""
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist: pass a run directory (it has metrics.jsonl)")
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _config_value(run_dir: str, key: str) -> Any:
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return None
    from omegaconf import OmegaConf

    return OmegaConf.select(OmegaConf.load(path), key)


def rolling(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


class Series:
    """The records of one run split by event, on a shared clock (seconds from start)."""

    def __init__(self, records: list[dict]):
        records = [r for r in records if isinstance(r.get("time"), int | float)]
        self.t0 = min((r["time"] for r in records), default=0.0)
        self.by_event: dict[str, list[dict]] = defaultdict(list)
        for r in sorted(records, key=lambda r: r["time"]):
            self.by_event[r.get("event", "")].append(r)
        self.span = max((r["time"] for r in records), default=0.0) - self.t0
        self.unit, self.scale = ("min", 60.0) if self.span > 900 else ("s", 1.0)

    def t(self, rows: list[dict]) -> list[float]:
        return [(r["time"] - self.t0) / self.scale for r in rows]

    @property
    def steps(self) -> list[dict]:
        events = self.by_event["step"] + self.by_event["resume"]
        return surviving_steps(sorted(events, key=lambda r: r["time"]))

    @property
    def xlabel(self) -> str:
        return f"time since start ({self.unit})"


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


# ------------------------------------------------------------------ the figures


def plot_reward(plt, s: Series, window: int):
    acc = [r for r in s.steps + s.by_event["group"] if "accuracy" in r]
    fig, axes = plt.subplots(2 if acc else 1, 1, figsize=(9, 7 if acc else 4.5), squeeze=False)
    ax = axes[0][0]
    groups = [r for r in s.by_event["group"] if "reward" in r]
    if groups:
        ax.plot(s.t(groups), [r["reward"] for r in groups], ".", ms=3, alpha=0.3, color="C0")
        ax.plot(
            s.t(groups),
            rolling([r["reward"] for r in groups], window * 4),
            color="C0",
            label=f"generated groups (rolling mean of {window * 4})",
        )
    if s.steps:
        ax.plot(
            s.t(s.steps),
            rolling([r["reward_mean"] for r in s.steps], window),
            color="C3",
            lw=2,
            label=f"trained samples per step (rolling mean of {window})",
        )
    if not groups and not s.steps:
        _empty(ax, "no reward recorded yet")
    ax.set(title="reward", xlabel=s.xlabel, ylabel="mean reward")
    ax.legend(loc="best", fontsize=8) if groups or s.steps else None
    if acc:
        ax = axes[1][0]
        ax.plot(s.t(acc), rolling([r["accuracy"] for r in acc], window), color="C2")
        ax.set(title="accuracy", xlabel=s.xlabel, ylabel="accuracy")
    return fig


def plot_policy_lag(plt, s: Series, max_lag: Any):
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    steps = [r for r in s.steps if "version" in r and "oldest_version" in r]
    if steps:
        x = [r["step"] for r in steps]
        lag = [r["version"] - r["oldest_version"] for r in steps]
        ax.step(x, lag, where="post", color="C1", label="trainer version - oldest token version")
        if max_lag is not None:
            ax.axhline(max_lag, ls="--", color="gray", label=f"trainer.max_lag = {max_lag}")
        ax.legend(loc="best", fontsize=8)
        ax2.bar(x, [r.get("stale", 0) for r in steps], color="C3", label="stale samples dropped")
        ax2.bar(
            x,
            [r.get("spanning", 0) for r in steps],
            bottom=[r.get("stale", 0) for r in steps],
            color="C0",
            alpha=0.6,
            label="sequences spanning 2+ versions",
        )
        ax2.legend(loc="best", fontsize=8)
    else:
        _empty(ax, "no trainer step recorded yet")
    ax.set(title="policy lag of trained samples", ylabel="versions")
    ax2.set(xlabel="trainer step", ylabel="samples per step")
    return fig


RATE_SPAN_FRACTION = 20  # a rate covers at least 1/20 of the run ...
RATE_MIN_EVENTS = 3  # ... and at least this many events after the window's start


def rate_window_s(span_s: float) -> float:
    """The shortest time a rate is taken over: 1/20 of the run's span."""
    return span_s / RATE_SPAN_FRACTION


def _rates(times: list[float], amounts: list[float], window_s: float) -> tuple[list, list]:
    """At each event, the amount per second since the latest earlier event that is at
    least ``window_s`` and RATE_MIN_EVENTS events back; no point before that (so no
    spike from two events a millisecond apart at the start)."""
    prefix = [0.0]
    for a in amounts:
        prefix.append(prefix[-1] + a)
    xs, ys, j = [], [], -1
    for i, t in enumerate(times):
        while j + 1 <= i - RATE_MIN_EVENTS and t - times[j + 1] >= window_s:
            j += 1
        if j >= 0 and t > times[j]:
            xs.append(t)
            ys.append((prefix[i + 1] - prefix[j + 1]) / (t - times[j]))
    return xs, ys


def plot_throughput(plt, s: Series, group_size: int):
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    raw = lambda rows: [r["time"] - s.t0 for r in rows]  # noqa: E731
    to_x = lambda xs: [x / s.scale for x in xs]  # noqa: E731
    w = rate_window_s(s.span)
    if s.steps:
        xs, ys = _rates(raw(s.steps), [r.get("samples", 0) for r in s.steps], w)
        ax.plot(to_x(xs), ys, color="C3", label="trained samples/s")
        xs, ys = _rates(raw(s.steps), [r.get("tokens", 0) for r in s.steps], w)
        ax2.plot(to_x(xs), ys, color="C3", label="trained completion tokens/s")
        ax2.legend(loc="best", fontsize=8)
    groups = s.by_event["group"]
    if groups:
        xs, ys = _rates(raw(groups), [group_size] * len(groups), w)
        ax.plot(to_x(xs), ys, color="C0", label="generated samples/s (all actors)")
    if s.steps or groups:
        ax.legend(loc="best", fontsize=8)
    else:
        _empty(ax, "no throughput recorded yet")
    ax.set(title=f"throughput (rates over {w:.0f} s windows)", ylabel="samples / s")
    ax2.set(xlabel=s.xlabel, ylabel="tokens / s")
    return fig


def plot_stalls(plt, s: Series):
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7))
    swaps: dict[str, list[dict]] = defaultdict(list)
    for r in s.by_event["swap"]:
        swaps[r.get("pool", "actor")].append(r)
    for i, (pool, rows) in enumerate(sorted(swaps.items())):
        modes = ", ".join(sorted({r.get("mode", "staged") for r in rows}))
        label = f"{pool} ({modes})"
        ax.plot(s.t(rows), [r["swap_ms"] for r in rows], "o-", ms=3, color=f"C{i}", label=label)
    if swaps:
        ax.legend(loc="best", fontsize=8)
    else:
        _empty(ax, "no weight swaps recorded (no 'swap' records in metrics.jsonl)")
    ax.set(
        title="generation paused by weight updates (forward lock held)",
        xlabel=s.xlabel,
        ylabel="lock held (ms)",
    )
    steps = s.steps
    if len(steps) > 1:
        saved = {r["step"]: r.get("checkpoint_s", 0.0) for r in s.by_event["checkpoint"]}
        gaps = [  # the time between two step records, less the step and a's checkpoint
            max(b["time"] - a["time"] - b.get("step_s", 0.0) - saved.get(a["step"], 0.0), 0.0)
            for a, b in zip(steps, steps[1:], strict=False)
        ]
        ax2.bar([r["step"] for r in steps[1:]], gaps, color="C4", label="trainer wait for data (s)")
        ax2.legend(loc="best", fontsize=8)
    else:
        _empty(ax2, "fewer than two trainer steps")
    ax2.set(title="trainer stalls", xlabel="trainer step", ylabel="seconds without a step")
    return fig


def plot_eval(plt, s: Series):
    """Held-out evaluation per policy version: against the version and against wall time."""
    rows = sorted(
        (r for r in s.by_event["eval"] if "greedy_accuracy" in r), key=lambda r: r["version"]
    )
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7))
    if not rows:
        _empty(ax, "no eval records (the evaluator pool writes them: eval.every_steps)")
        _empty(ax2, "no eval records")
    else:
        versions = [r["version"] for r in rows]
        ax.plot(versions, [r["greedy_accuracy"] for r in rows], "o-", color="C2", label="greedy")
        if all("pass_at_k" in r for r in rows):
            k = rows[-1].get("k", "k")
            ax.plot(versions, [r["pass_at_k"] for r in rows], "s--", color="C1", label=f"pass@{k}")
        ax.set_ylim(-0.02, 1.02)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(loc="best", fontsize=8)
        # a policy existed from when its checkpoint was written (the record's own time is
        # when the evaluation finished, later)
        when = [(r.get("checkpoint_time", r["time"]) - s.t0) / s.scale for r in rows]
        ax2.plot(when, [r["greedy_accuracy"] for r in rows], "o-", color="C2", label="greedy acc.")
        twin = ax2.twinx()
        twin.plot(when, [r["mean_reward"] for r in rows], "^:", color="C0", label="mean reward")
        twin.set_ylabel("mean reward")
        ax2.legend(loc="upper left", fontsize=8)
        twin.legend(loc="lower right", fontsize=8)
    problems = rows[-1].get("problems", "?") if rows else "?"
    ax.set(title=f"held-out evaluation ({problems} problems)", xlabel="policy version")
    ax.set_ylabel("accuracy")
    ax2.set(xlabel=f"checkpoint written, {s.xlabel}", ylabel="greedy accuracy")
    return fig


# ------------------------------------------------------------------ command line


def make_plots(run_dir: str, out_dir: str | None = None, window: int = 5) -> list[str]:
    """Write the PNGs; return their paths."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "matplotlib is not installed: pip install -e '.[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = Series(read_records(os.path.join(run_dir, "metrics.jsonl")))
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    group_size = _config_value(run_dir, "task.group_size") or 1
    figures = {
        "reward": plot_reward(plt, s, window),
        "policy_lag": plot_policy_lag(plt, s, _config_value(run_dir, "trainer.max_lag")),
        "throughput": plot_throughput(plt, s, group_size),
        "stalls": plot_stalls(plt, s),
        "eval": plot_eval(plt, s),
    }
    paths = []
    for name, fig in figures.items():
        fig.suptitle(os.path.basename(os.path.abspath(run_dir)), fontsize=9, color="gray")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.plot", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    p.add_argument("--out", help="where the PNGs go (default RUN_DIR/plots)")
    p.add_argument("--window", type=int, default=5, help="steps to smooth over (default 5)")
    args = p.parse_args(argv)
    try:
        paths = make_plots(args.run_dir, args.out, max(args.window, 1))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
