"""Tensor parallelism in the vLLM worker extension (actor/engines/vllm/worker/tp.py) on the CPU: two
real processes, one per TP rank, joined by gloo as vLLM's workers are by NCCL, each a
fake Worker holding its shard and the real extension, driven with the same calls in
the same order (tests/tp_rank.py). What is not run here: vLLM itself with TP > 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actor.engines.vllm.worker.tp import merge_polls
from pipeline.redisd.server import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_two_tp_ranks_stage_their_shards_and_swap_between_the_same_steps(tmp_path):
    out, port = tmp_path / "rank.json", str(free_port("127.0.0.1"))
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115
        cmd = [sys.executable, "-m", "tests.tp_rank", str(out)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log))
    codes = [p.wait(timeout=180) for p in procs]
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], logs
    seen = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    for s in seen:
        assert s["info"]["tp_size"] == 2 and s["info"]["tp_rank"] == s["rank"]
        # (a) each rank holds exactly its shard of the version rank 0 received
        assert s["staged_1"] == 1 and s["weights_1"]
        # (b) asked for mid-step: that step finished on version 0, the next ran version 1
        assert s["live_mid_step"] == 0 and s["live_after"] == 1
        assert s["step_versions"] == [[0, 2], [1, 1]]
        assert s["live_between"] == 2 and s["weights_2"]  # between steps: at once
        # (c) a bucket lost on rank 0 fails the version on every rank, in time
        assert s["failed"] == 1 and s["staged_after_failure"] is None
        assert s["fail_s"] < 20
        assert s["weights_2_kept"]  # the live shard untouched
        assert s["staged_3"] == 3 and s["weights_3"]  # and the next try goes through
    assert "injected: bucket 2 lost" in seen[0]["error"]
    assert "TP rank 0 failed to receive bucket 2" in seen[1]["error"]
    assert seen[0]["step_versions"] == seen[1]["step_versions"]


def poll(live=1, staged=1, failed=0, error="", busy=0, swaps=(), versions=None):
    return {
        "live_version": live,
        "staged_version": staged,
        "swaps": list(swaps),
        "failed": failed,
        "last_error": error,
        "busy": busy,
        "orphan_holds": 0,
        "versions": versions or {},
    }


def test_merged_polls_report_a_state_only_when_every_rank_is_in_it():
    a = poll(staged=2, swaps=[{"version": 1, "hold_ms": 0.2}], versions={"r": [[1, 3]]})
    b = poll(staged=None, busy=1, failed=1, error="version 2: boom", swaps=[
        {"version": 1, "hold_ms": 0.5}
    ])  # fmt: skip
    merged = merge_polls([a, b])
    assert merged["staged_version"] is None  # rank 1 is not staged yet
    assert merged["busy"] == 1 and merged["failed"] == 1
    assert merged["last_error"] == "rank 1: version 2: boom"
    assert merged["swaps"] == [{"version": 1, "hold_ms": 0.5}]  # the slowest rank's hold
    assert merged["versions"] == {"r": [[1, 3]]}
    assert merge_polls([poll(staged=2), poll(staged=2)])["staged_version"] == 2


def test_ranks_on_different_live_versions_is_an_error():
    with pytest.raises(RuntimeError, match="rank 0: 1, rank 1: 2"):
        merge_polls([poll(live=1), poll(live=2)])


def test_tensor_parallel_settings_are_checked():
    from omegaconf import OmegaConf

    from pipeline.config import Config, validate_vllm

    cfg = OmegaConf.structured(Config)
    cfg.actor.engine, cfg.actor.vllm.tensor_parallel_size = "vllm", 2
    validate_vllm(cfg)  # TP 2 with full weights is built
    cfg.actor.vllm.tensor_parallel_size = 0
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be >= 1"):
        validate_vllm(cfg)
    cfg.actor.vllm.tensor_parallel_size = 2
    cfg.model.lora.rank = 8
    with pytest.raises(ValueError, match="with model.lora"):
        validate_vllm(cfg)
