"""The arithmetic behind the async and scale benchmarks' headline figures, on records
whose answers are known: the steady-state rate leaves the start-up out, the async/sync
ratio is taken per interleaved pair, and the scale summary reports a Redis ceiling only
from a level where Redis was saturated (never projected from a mostly idle server)."""

from __future__ import annotations

import json

import pytest

from pipeline.bench.async_ import compare, steady
from pipeline.bench.scale import main as scale_main
from pipeline.bench.scale.ceiling import CEILING_COLUMNS, ceilings
from pipeline.bench.scale.ramp import summarize


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
        "load": "redis", "mode": "single", "appendfsync": "everysec",
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


def _ceiling_row(mode, rnd, entries, idle, us):
    return {"mode": mode, "round": rnd, "entries_s": entries, "samples_s": 8 * entries,
            "mb_s": entries * 0.035, "main_idle_min": idle, "saturated": idle < 0.05,
            "main_us_per_sample": us / 2, "redis_us_per_sample": us, "redis_cpu": 0.9,
            "replica_cpu_share": 0.0 if mode == "single" else 0.4, "write_p50_ms": 1.0,
            "write_p99_ms": 5.0, "wait_p50_ms": None if mode == "single" else 0.5,
            "wait_p99_ms": None if mode == "single" else 2.0}  # fmt: skip


def test_mode_ceilings_and_ratios_come_from_saturated_levels_per_round():
    """scale --load ceiling's summary: a mode's ceiling in a round is its best saturated
    level; the ratio to single is per round (both saturated), median and min-max; the
    CPU-per-sample ratio is taken at each mode's best level, saturated or not."""
    rows = [
        _ceiling_row("single", 0, 5000, 0.20, 10), _ceiling_row("single", 0, 8000, 0.01, 12),
        _ceiling_row("sentinel", 0, 4000, 0.02, 30), _ceiling_row("single", 1, 10000, 0.02, 11),
        _ceiling_row("sentinel", 1, 3000, 0.01, 33), _ceiling_row("sentinel", 1, 3500, 0.3, 22),
        _ceiling_row("single", 2, 9000, 0.03, 12), _ceiling_row("sentinel", 2, 2000, 0.4, 24),
    ]  # fmt: skip
    out = ceilings(rows)
    per = {r["mode"]: r for r in out["per_mode"]}
    assert per["single"]["saturated_rounds"] == "3/3"
    assert (per["single"]["ceiling_entries_s"], per["single"]["ceiling_min"]) == (9000, 8000)
    assert per["single"]["ceiling_max"] == 10000
    assert per["sentinel"]["saturated_rounds"] == "2/3"  # round 2 never saturated
    assert per["sentinel"]["ceiling_entries_s"] == 3500  # median of 4000 and 3000
    assert per["sentinel"]["best_entries_s"] == 3500  # 4000, 3500 (unsaturated), 2000
    assert per["single"]["wait_p50_ms"] is None and per["sentinel"]["wait_p99_ms"] == 2.0
    ratio = {(r["ratio"], r["of"]): r for r in out["ratios"]}
    c = ratio["sentinel/single", "ceiling"]
    assert c["per_round"] == [0.5, 0.3, None]
    assert (c["median"], c["min"], c["max"]) == (0.4, 0.3, 0.5)
    cost = ratio["sentinel/single", "redis_us_per_sample"]
    assert cost["per_round"] == [2.5, 2.0, 2.0]  # best levels: 30/12, 22/11, 24/12


def test_scale_ceiling_run_on_real_servers(tmp_path):
    """A short --load ceiling run on real single, sentinel and cluster servers: the table
    has every column; a level paced far below the ceiling (20 writes/s) carries that
    rate through the real durable write (WAIT acknowledged by the replica) and is
    reported NOT saturated, so no ceiling comes from it."""
    out = tmp_path / "scale.json"
    args = ["--load", "ceiling", "--modes", "single,sentinel,cluster", "--rounds", "1"]
    args += ["--levels", "2x1@20", "--level-s", "1.5", "--warmup-s", "0.5", "--writers", "1"]
    args += ["--completion-tokens", "64", "--prompt-tokens", "16", "--out", str(out)]
    assert scale_main(args) == 0
    payload = json.loads(out.read_text())
    rows = {r["mode"]: r for r in payload["rows"]}
    assert set(rows) == {"single", "sentinel", "cluster"}
    for mode, r in rows.items():
        assert set(CEILING_COLUMNS) <= set(r), mode
        assert r["errors"] == 0 and r["wait_short"] == 0, (mode, r["first_error"])
        assert 12 <= r["entries_s"] <= 28, (mode, r["entries_s"])  # the server's own count
        assert r["samples_s"] == pytest.approx(8 * r["entries_s"], rel=0.01)
        assert r["main_idle_min"] > 0.5 and r["saturated"] is False, mode
        assert r["write_p50_ms"] is not None and r["load_avg_1m"] >= 0
    assert rows["single"]["replica_cpu"] == 0 and rows["single"]["waits_s"] == 0
    assert rows["single"]["wait_p50_ms"] is None and rows["sentinel"]["wait_p99_ms"] >= 0
    for mode in ("sentinel", "cluster"):  # the durable path: a WAIT behind every write
        assert rows[mode]["waits_s"] == pytest.approx(rows[mode]["entries_s"], rel=0.15), mode
    assert rows["sentinel"]["replica_cpu"] > 0 and rows["cluster"]["replica_cpu"] > 0
    assert len(rows["cluster"]["main_idle_each"]) == 6 and rows["cluster"]["partitions"] == 3
    per = {r["mode"]: r for r in payload["ceilings"]["per_mode"]}
    assert all(
        p["ceiling_entries_s"] is None and p["saturated_rounds"] == "0/1" for p in per.values()
    )
    md = out.with_suffix(".md").read_text()
    assert "## Ceilings" in md and "sentinel/single" in md


def test_vllm_start_break_even_and_what_the_compile_cache_did():
    """The vllm_start bench's verdict: the extra start over the time saved per token
    (a compiled engine 10 s slower to start and 100 against 80 tokens/s pays back after
    10 / (1/80 - 1/100) = 4,000 tokens; one no faster never does), and vLLM's log lines
    about its compile cache read back as what happened."""
    from pipeline.bench.vllm_start import compile_cache
    from pipeline.bench.vllm_start import summarize as start_summary

    def run(mode, start, tps):
        return {"mode": mode, "start_s": start, "tokens": 1000, "gen_s": 1000 / tps,
                "init_engine_s": None, "compile_cache": "-"}  # fmt: skip

    runs = [run("eager", 20.0, 80.0), run("eager", 22.0, 79.0), run("eager", 21.0, 81.0)]
    runs += [run("compile", 31.0, 100.0), run("compile", 30.0, 101.0), run("compile", 32.0, 99.0)]
    rows, verdict = start_summary(runs)
    assert [r["mode"] for r in rows] == ["eager", "compile"]
    assert rows[0]["start_s_median"] == 21.0 and rows[1]["tokens_per_s_median"] == 100.0
    assert verdict["extra_start_s"] == pytest.approx(10.0)
    assert verdict["break_even_tokens"] == pytest.approx(10.0 / (1 / 80 - 1 / 100))
    _, never = start_summary([run("eager", 20.0, 80.0), run("compile", 30.0, 80.0)])
    assert never["break_even_tokens"] is None
    failed = (
        "WARNING [decorators.py:333] [backbone] Compiling model again due to a load failure "
        "from /c/model, reason: 'function' object has no attribute 'finalize_loading'\n"
        "INFO [decorators.py:743] [backbone] saved AOT compiled function to /c/model\n"
    )
    assert compile_cache(failed) == (
        "load failed: 'function' object has no attribute 'finalize_loading'; saved"
    )
    assert compile_cache("INFO Directly load AOT compilation from path /c/model") == "loaded"
    assert compile_cache("nothing about a cache") == "no AOT cache line"
