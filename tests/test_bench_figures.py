"""The arithmetic behind the async and scale benchmarks' headline figures, on records
whose answers are known: the steady-state rate leaves the start-up out, the async/sync
ratio is taken per interleaved pair, and the scale summary reports a Redis ceiling only
from a level where Redis was saturated (never projected from a mostly idle server)."""

from __future__ import annotations

import pytest

from pipeline.bench.async_ import compare, steady
from pipeline.bench.scale import summarize


def _steps(times: list[float], samples: int = 8, step_s: float = 2.0) -> list[dict]:
    return [{"time": t, "samples": samples, "step_s": step_s} for t in times]


def test_steady_rate_starts_at_the_warmup_step():
    # a slow first step (start-up) at t=30, then one step every 10 s
    steps = _steps([30.0, 40.0, 50.0, 60.0])
    turns = [{"time": t, "generate_s": 4.0, "groups": 2} for t in (35.0, 45.0, 55.0)]
    out = steady(steps, turns, [], warmup=0, g=4)
    assert out["steady_samples_per_s"] == pytest.approx(24 / 30)  # 3 steps after t=30
    assert out["steady_s_per_step"] == pytest.approx(10.0)
    assert out["steady_trainer_busy_s_per_step"] == pytest.approx(2.0)
    assert out["steady_trainer_idle_frac"] == pytest.approx(1 - 6 / 30, abs=1e-3)
    assert out["steady_actor_generate_s_per_sample"] == pytest.approx(12 / 24)
    later = steady(steps, turns, [], warmup=1, g=4)
    assert later["steady_samples_per_s"] == pytest.approx(16 / 20)
    assert later["steady_steps"] == 2


def test_steady_needs_two_steps_after_warmup():
    assert steady(_steps([1.0, 2.0]), [], [], warmup=1, g=4)["steady_samples_per_s"] is None


def test_ratio_is_per_interleaved_pair_with_median_and_range():
    rates = {("sync", 0): 0.5, ("async", 0): 0.6, ("sync", 1): 0.4, ("async", 1): 0.6}
    rates |= {("sync", 2): 0.5, ("async", 2): 0.45}
    rows = [
        {"setting": "normal", "mode": m, "repeat": k, "steady_samples_per_s": v}
        for (m, k), v in rates.items()
    ]
    (out,) = compare(rows)
    assert out["ratios"] == [1.2, 1.5, 0.9]
    assert (out["ratio_median"], out["ratio_min"], out["ratio_max"]) == (1.2, 0.9, 1.5)
    assert out["pairs"] == 3
    assert out["sync_steady_samples_per_s_median"] == 0.5


def _level(rate: float, trained: float, cpu: float, idle: float, sustained: bool) -> dict:
    return {
        "load": "redis", "shards": 1, "appendfsync": "everysec",
        "offered_samples_s": rate, "trained_samples_s": trained,
        "trained_entries_s": trained / 8, "trained_tokens_s": trained * 512,
        "rollouts_mb_s": trained * 0.0048, "redis_cpu_max": cpu,
        "redis_saturated": idle < 0.05, "sustained": sustained,
    }  # fmt: skip


def test_scale_ceiling_only_from_a_saturated_level():
    rows = [_level(1000, 1000, 0.25, 0.7, True), _level(2000, 2000, 0.5, 0.4, True)]
    (out,) = summarize(rows)
    assert out["sustained_samples_s"] == 2000
    # Redis never saturated: no ceiling and no projection from its CPU share
    assert out["saturated_trained_samples_s"] is None
    assert out["projection_full_core_samples_s"] is None
    rows.append(_level(4000, 3000, 0.75, 0.01, False))
    (out,) = summarize(rows)
    assert out["saturated_trained_samples_s"] == 3000
    assert out["saturated_redis_cpu"] == 0.75
    assert out["projection_full_core_samples_s"] == 4000
    assert out["first_unsustained_offered"] == 4000


def test_redis_ceiling_comes_only_from_a_saturated_level():
    """redis_ceiling's summary: the ceiling is the best saturated level's rate; with no
    saturated level there is none, only the highest rate seen."""
    from pipeline.bench.redis_ceiling import summarize as ceiling

    def row(mix, entries, idle):
        sat = idle < 0.05
        return {"mix": mix, "entries_s": entries, "samples_s": 8 * entries,
                "mb_in_s": entries * 0.035, "redis_run": 1 - idle, "saturated": sat}  # fmt: skip

    rows = [row("write", 5000, 0.30), row("write", 9000, 0.02), row("write", 8500, 0.01)]
    rows += [row("write+read", 4000, 0.40), row("write+read", 6000, 0.20)]
    out = {s["mix"]: s for s in ceiling(rows)}
    assert out["write"]["ceiling_entries_s"] == 9000 and out["write"]["ceiling_samples_s"] == 72000
    assert out["write"]["highest_unsaturated_entries_s"] == 5000
    assert out["write+read"]["ceiling_entries_s"] is None
    assert out["write+read"]["highest_unsaturated_entries_s"] == 6000
