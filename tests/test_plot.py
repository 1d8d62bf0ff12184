"""Metrics of a finished tiny run: metrics.jsonl, TensorBoard event files, W&B
(through a stand-in module), and ``python -m pipeline.plot`` PNGs with curves on them."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from pipeline.telemetry import MetricsFile
from tests.launching import run_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNGS = ("reward", "policy_lag", "throughput", "stalls", "eval")
C2 = (0x2C, 0xA0, 0x2C)  # green: held-out greedy accuracy
# matplotlib's default colour cycle: C0 blue, C1 orange, C3 red, C4 purple
C0, C1, C3, C4 = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0xD6, 0x27, 0x28), (0x94, 0x67, 0xBD)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plot")
    run_dir = tmp / "run"
    code, out = run_tiny(tmp, run_dir, "trainer.max_steps=12")
    assert code == 0, out
    return run_dir


def _pixels_of(image: np.ndarray, rgb: tuple[int, int, int], tol: int = 12) -> int:
    px = (image[..., :3] * 255).astype(int)
    return int((np.abs(px - np.array(rgb)).max(axis=-1) <= tol).sum())


def test_plot_writes_pngs_that_show_the_curves(finished_run):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.plot", str(finished_run)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    images = {}
    for name in PNGS:
        path = finished_run / "plots" / f"{name}.png"
        assert str(path) in proc.stdout
        assert path.stat().st_size > 15_000, f"{path} is suspiciously small"
        images[name] = matplotlib.image.imread(str(path))
        assert images[name].shape[0] > 300 and images[name].std() > 0.05
    # the data curves are drawn, not just empty axes with a "no data" note
    assert _pixels_of(images["reward"], C3) > 300  # trained reward per step
    assert _pixels_of(images["reward"], C0) > 300  # generated groups
    assert _pixels_of(images["policy_lag"], C1) > 300  # version - oldest version
    assert _pixels_of(images["throughput"], C3) > 300  # samples/s and tokens/s
    assert _pixels_of(images["stalls"], C0) > 100  # actor-0 swap times
    assert _pixels_of(images["stalls"], C4) > 300  # trainer wait per step


def test_the_run_recorded_what_the_plots_need(finished_run):
    records = [json.loads(x) for x in (finished_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert len(steps) == 12
    assert all(r["version"] - r["oldest_version"] >= 0 for r in steps)
    swaps = [r for r in records if r["event"] == "swap"]
    assert swaps and all(r["pool"] == "actor-0" and r["swap_ms"] >= 0 for r in swaps)


def test_tensorboard_event_files_per_pool(finished_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for pool in ("trainer", "preprocessor-0", "actor-0"):
        assert list((finished_run / "tensorboard" / pool).glob("events.out.tfevents.*")), pool
    acc = EventAccumulator(str(finished_run / "tensorboard" / "trainer"))
    acc.Reload()
    rewards = acc.Scalars("step/reward_mean")
    assert [e.step for e in rewards] == list(range(1, 13))
    actor = EventAccumulator(str(finished_run / "tensorboard" / "actor-0"))
    actor.Reload()
    assert "group/reward" in actor.Tags()["scalars"]


def test_wandb_gets_the_same_records_when_configured(tmp_path, monkeypatch):
    calls = {"init": [], "log": [], "finish": 0}

    class Run:
        def log(self, data):
            calls["log"].append(data)

        def finish(self):
            calls["finish"] += 1

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls["init"].append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    settings = types.SimpleNamespace(tensorboard=False, wandb_project="nsrl", wandb_entity=None)
    m = MetricsFile(str(tmp_path / "metrics.jsonl"), settings)
    m.write(pool="trainer", role="trainer", event="step", step=1, loss=0.5, groups=["a"])
    m.write(pool="trainer", role="trainer", event="step", step=2, loss=0.25, groups=["b"])
    m.close()
    assert calls["init"][0]["project"] == "nsrl" and calls["init"][0]["name"] == "trainer"
    assert calls["log"] == [{"step/loss": 0.5}, {"step/loss": 0.25}]
    assert calls["finish"] == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_no_sink_is_required(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # "not installed"
    settings = types.SimpleNamespace(tensorboard=False, wandb_project="nsrl", wandb_entity=None)
    m = MetricsFile(str(tmp_path / "metrics.jsonl"), settings)
    assert m.sinks == []
    m.write(pool="actor-0", event="group", reward=1.0)
    m.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward"] == 1.0


def test_plot_reads_a_live_file_and_says_what_is_missing(tmp_path):
    pytest.importorskip("matplotlib")
    lines = [
        {"event": "step", "pool": "trainer", "step": i, "time": 100.0 + i, "reward_mean": 0.1 * i}
        | {"samples": 8, "tokens": 100, "version": i, "oldest_version": i - 1, "step_s": 0.5}
        for i in range(1, 6)
    ]
    lines += [
        {"event": "eval", "pool": "evaluator", "step": v, "version": v, "time": 103.0 + v}
        | {"greedy_accuracy": 0.2 * v, "pass_at_k": 0.25 * v, "k": 4, "mean_reward": 0.1 * v}
        | {"checkpoint_time": 100.5 + v, "problems": 16}
        for v in (1, 2, 3)
    ]
    text = "\n".join(json.dumps(r) for r in lines) + '\n{"event": "gro'  # half-written line
    (tmp_path / "metrics.jsonl").write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.plot", str(tmp_path), "--out", str(tmp_path / "p")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path / "p")) == sorted(f"{n}.png" for n in PNGS)
    import matplotlib.image

    evals = matplotlib.image.imread(str(tmp_path / "p" / "eval.png"))
    assert _pixels_of(evals, C2) > 300  # the held-out accuracy curve is drawn
    assert _pixels_of(evals, C1) > 100  # pass@k
    missing = subprocess.run(
        [sys.executable, "-m", "pipeline.plot", str(tmp_path / "nothing")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "metrics.jsonl" in missing.stderr


def test_the_first_throughput_point_is_not_a_spike():
    from pipeline.plot import _rates, rate_window_s

    # four groups published within 3 ms (one generate call), then one group a second
    times = [0.0, 0.001, 0.002, 0.003] + [1.0 + i for i in range(120)]
    window = rate_window_s(times[-1])
    assert window == pytest.approx(6.0)  # 1/20 of the run
    xs, ys = _rates(times, [4.0] * len(times), window)
    assert xs[0] >= window  # no point before a whole window has passed
    assert max(ys) <= 4.0 * 1.5  # the real rate is 4 samples/s; the old first point was 4000
    assert abs(ys[-1] - 4.0) < 0.2


def test_a_stall_outside_a_gap_is_unmeasured_not_zero():
    from pipeline.bench.weight_updates import stalls

    passes = [(0.0, 1.0), (1.1, 2.0), (3.0, 4.0)]  # gaps: 0.1 s and 1.0 s
    measured, unmeasured, usual = stalls(passes, [2.5, 5.0, -1.0])
    assert measured == [pytest.approx(1000.0)]  # the update at 2.5 s paused 2.0 -> 3.0
    assert unmeasured == 2  # after the last pass, before the first: counted, not 0
    assert usual == pytest.approx(550.0)


def test_progress_rates_wait_for_a_long_enough_window():
    from pipeline.run.progress import RATE_MIN_S, Progress, Rate

    rate = Rate()
    assert rate.add(0.0, 0) is None
    assert rate.add(0.5, 16) is None  # a burst right at the start is no rate yet
    assert rate.add(RATE_MIN_S - 1, 20) is None
    assert rate.add(RATE_MIN_S + 0.5, 31) == pytest.approx(31 / (RATE_MIN_S + 0.5))
    for t in range(40, 400, 10):  # then a steady 1 per second over a sliding window
        value = rate.add(float(t), 31 + (t - 30))
    assert value == pytest.approx(1.0)
    assert rate.add(401.0, 0) is None  # a counter that went back (restart) starts over
    statuses = {
        "trainer": {"role": "trainer", "step": "2", "version": "2", "samples_trained": "32"},
        "actor-0": {"role": "actor", "version": "1", "groups_produced": "9"},
    }
    line = Progress.line(statuses, 10, 12.0, (0.25, None))
    assert "0.25 groups/s" in line and "- samples/s" in line and "lag 1" in line


def test_the_device_label_names_where_the_work_ran(monkeypatch):
    import torch

    from pipeline.bench.common import device_name

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with a GPU
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: f"GPU{index}")
    assert device_name("cpu").startswith("cpu: ")  # ... measured on its CPU says cpu
    assert device_name() == device_name("cpu")
    assert device_name("cuda:1") == "GPU1" and device_name("cuda") == "GPU0"
