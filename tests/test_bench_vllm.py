"""pipeline.bench.vllm: the added-gap measure on known arrivals, the row it reports, and
the swap part on real vLLM (the module's tiny random Llama engine, tests/vllm_real.py)."""

from __future__ import annotations

import pytest

from pipeline.bench.vllm import _row, added_gaps, parse, swap_part


def _gaps(times: list[float]) -> list[tuple[float, float]]:
    return list(zip(times, times[1:], strict=False))


def test_added_gap_is_the_longest_overlapping_gap_less_the_baseline():
    every = [round(0.05 * k, 6) for k in range(60)]  # a token every 50 ms, 0 .. 2.95 s
    stalled = [t for t in every if t <= 2.0] + [round(t + 0.1, 6) for t in every if t > 2.0]
    late = [t for t in every if t >= 2.03]  # started after the swap began: no baseline
    # the window overlaps a 50 ms gap and the 150 ms one: the longest counts
    out = added_gaps([_gaps(stalled), _gaps(every), _gaps(late)], 1.97, 2.06)
    assert out == pytest.approx([100.0, 0.0], abs=1e-6)  # 150 - 50 ms; 50 - 50; left out
    # a window the stall does not overlap adds nothing
    assert added_gaps([_gaps(stalled)], 2.5, 2.51) == pytest.approx([0.0], abs=1e-6)


def test_row_reports_percentiles_over_swaps_and_streams():
    events = [
        {"mode": "lock", "added_gap_ms": [1.0, 3.0], "swap_ms": 10.0, "hold_ms": 0.5},
        {"mode": "lock", "added_gap_ms": [5.0, 7.0], "swap_ms": 30.0, "hold_ms": None},
    ]
    row = _row("lock", events)
    assert row["update_mode"] == "lock" and row["swaps"] == 2 and row["samples"] == 4
    assert row["added_gap_ms_p50"] == 4.0 and row["added_gap_ms_max"] == 7.0
    assert row["per_swap_median_ms"] == [2.0, 6.0]
    assert row["swap_call_ms_p50"] == 20.0 and row["lock_hold_ms_p50"] == 0.5


@pytest.mark.vllm
@pytest.mark.slow
def test_swap_part_on_real_vllm(vllm_engine, tmp_path):
    """One lock and one pause swap while four requests stream: both versions go live
    and every row carries its numbers (a stream whose request restarts inside the swap's
    window is unmeasured there: the streams' restarts are staggered, so at most one)."""
    argv = ["--parts", "swap", "--model", "tiny-random", "--swaps", "1", "--streams", "4"]
    args = parse([*argv, "--modes", "lock,pause"])
    engine = vllm_engine.engine
    try:
        rows, extra = swap_part(args, engine, None, vllm_engine.model_dir, str(tmp_path))
        assert [r["update_mode"] for r in rows] == ["lock", "pause", "none (control)"]
        assert [e["version"] for e in extra["events"]] == [1, 2] and engine.version == 2
        for r in rows[:2]:
            assert r["swaps"] == 1 and r["samples"] >= 3, r
            assert r["swap_call_ms_p50"] > 0 and r["lock_hold_ms_p50"] > 0, r
            assert isinstance(r["added_gap_ms_p50"], float) and r["base_gap_ms_p50"] > 0, r
        assert extra["load"]["load_avg_before"] and extra["load"]["before"]["busiest"] is not None
    finally:
        engine.__dict__.pop("rpc", None)  # drop the bench's RpcTap
        engine.update_mode = "lock"
        vllm_engine.reset()
