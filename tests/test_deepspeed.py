"""The trainer backends on 2 CPU ranks over gloo (tests/trainer_ranks.py is one rank).

Tolerance: ZeRO-2 and ZeRO-3 reduce gradients in another order than the torch
backend's single all-reduce, so fp32 losses of later steps differ in the last
bits; they must agree to a relative 1e-5 (grad norms 1e-4). Measured on the 2-core
CPU over 4 steps: losses differ by at most 1.4e-7 relative (ZeRO-3; ZeRO-2 5.9e-8),
grad norms by 2.5e-7. The first step's loss, computed before any update, must agree
to 1e-7 (it was identical).

The weights an actor receives from the ZeRO-3 trainer (gathered from both ranks'
shards, after a checkpoint restore halfway) are compared, per parameter, with an
independent reference: the torch backend's weights after the same STEPS steps on the
same data, on one rank. AdamW moves each element by at most about lr = 1e-3 per step
(4e-3 over 4 steps); the reduction-order differences above give at most 3.4e-6 (a
v_proj element; the embedding 7.7e-7, most matrices under 4e-7), measured on the
2-core CPU. The tolerance is 1e-4 per element: 30x the measured difference, 1/10 of one
step's update and 1/40 of the movement, and every parameter must have moved by more
than 10x it. Rank 0's own shard in place of the gather (the other half of each tensor
zero) is off by the missing weights themselves (mean |w| 0.016, up to 0.07 in the tiny
model): the test fails on the first parameter (checked once).
"""

from __future__ import annotations

import signal

import pytest

from pipeline.models import materialize_model
from tests.deepspeed_builders import (
    STEPS,
    assert_weights_match,
    run_ranks,
    start_ranks,
    wait_for,
)

pytest.importorskip("deepspeed", reason="deepspeed is installed by `make setup`")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return materialize_model("tiny", str(tmp_path_factory.mktemp("m")))


@pytest.fixture(scope="module")
def torch_losses(tiny, tmp_path_factory):
    """The reference: the torch backend on one rank; its weights after STEPS steps are
    saved in ``result["weights"]`` (a safetensors file)."""
    tmp = tmp_path_factory.mktemp("torch")
    weights = tmp / "torch.safetensors"
    result = run_ranks(tmp / "torch.json", tiny, "torch", 0, 1, "--weights", str(weights), tmp=tmp)
    return result | {"weights": str(weights)}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_losses_match_the_torch_backend(tiny, torch_losses, tmp_path, stage):
    ds = run_ranks(tmp_path / "ds.json", tiny, "deepspeed", stage, 2, tmp=tmp_path)
    assert len(ds["loss"]) == len(torch_losses["loss"]) == STEPS
    assert ds["loss"][0] == pytest.approx(torch_losses["loss"][0], rel=1e-7, abs=1e-9)
    assert ds["loss"] == pytest.approx(torch_losses["loss"], rel=1e-5, abs=1e-7)
    assert ds["grad_norm"] == pytest.approx(torch_losses["grad_norm"], rel=1e-4)
    assert len(set(ds["loss"])) == STEPS  # the weights moved: every step's loss differs


@pytest.mark.slow
def test_torch_backend_on_two_ranks_matches_one(tiny, torch_losses, tmp_path):
    two = run_ranks(tmp_path / "t2.json", tiny, "torch", 0, 2, tmp=tmp_path)
    assert two["loss"] == pytest.approx(torch_losses["loss"], rel=1e-5, abs=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "stage"), [("deepspeed", 3), ("torch", 0)])
def test_checkpoint_restored_after_a_kill_gives_the_same_next_losses(
    tiny, torch_losses, tmp_path, redis_server, backend, stage
):
    """Group A checkpoints after step 2, trains on, and is SIGKILLed; group B resumes
    from the checkpoint: steps 3 and 4 (weights, then optimizer moments) bit for bit.
    Under ZeRO-3, group B then publishes to a real actor, which must receive exactly
    DeepSpeed's gathered 16-bit state dict."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "a.json"
    procs = start_ranks(
        out, tiny, backend, stage, 2, "--ckpt", str(ckpt), "--save-at", "2", "--hang", tmp=tmp_path
    )
    try:
        first = wait_for(out, procs)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    received = tmp_path / "received.safetensors"
    publish = ["--publish", redis_server.url, "--weights", str(received)] if stage == 3 else []
    second = run_ranks(
        tmp_path / "b.json",
        tiny,
        backend,
        stage,
        2,
        "--ckpt",
        str(ckpt),
        "--resume",
        *publish,
        tmp=tmp_path,
    )
    assert second["start"] == 2
    assert second["loss"] == first["loss"][2:]  # exact float equality
    assert second["grad_norm"] == first["grad_norm"][2:]
    if stage == 3:  # the weights an actor received from the ZeRO-3 trainer
        assert_weights_match(str(received), torch_losses["weights"], tiny)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_a_non_finite_step_is_not_applied_on_two_ranks(tiny, tmp_path, stage):
    """Step 1 of 4 runs with NaN logits on both ranks: DeepSpeed's stage 0 (checked by
    the backend) and ZeRO-2 (its own overflow check) leave every rank's weights as they
    were, report it not applied, and the steps around it train."""
    out = tmp_path / f"nan{stage}.json"
    result = run_ranks(out, tiny, "deepspeed", stage, 2, "--nan-at", "1", tmp=tmp_path)
    assert result["applied"] == [True, False, True, True]  # STEPS steps, the second NaN
    assert result["unchanged_at_nan"] is True
