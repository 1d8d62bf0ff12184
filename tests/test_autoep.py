"""Expert parallelism: DeepSpeed AutoEP (``trainer.expert_parallel``) on CPU ranks over gloo.

DeepSpeed 0.19.8's AutoEP runs on the CPU: its all-to-all is ``all_to_all_single``
(gloo has it), the token permutation has a torch path for host tensors, and the
experts run through ``torch._grouped_mm`` (the Triton grouped GEMM is chosen only on
CUDA). The one thing in the way is transformers 5's output-capture registry
(trainer/backends/deepspeed_backend.py ``autoep_transformers_registry``).

Reference: the torch backend on one rank, same synthetic batches (tests/trainer_ranks.py),
tiny-moe (8 experts, 4 per rank). Measured on the 2-core CPU over 4 steps: the first
loss identical, later losses within 1.3e-7 relative, grad norms 4.5e-7, weights
(gathered back from both ranks under HF names) within 4.4e-5 (the embedding; the
rest under 7e-7) against AdamW moving each by about 4e-3: the tolerances of
tests/test_deepspeed.py hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from pipeline.config import Config
from pipeline.config.trainer import validate_trainer
from pipeline.models import materialize_model
from pipeline.redisd.server import free_port
from tests.deepspeed_builders import ROOT, STEPS, assert_weights_match, run_ranks

deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is installed by `make setup`")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return materialize_model("tiny-moe", str(tmp_path_factory.mktemp("m")))


def trainer_cfg(**kw):
    cfg = OmegaConf.structured(Config)
    for k, v in kw.items():
        cfg.trainer[k] = v
    return cfg


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(expert_parallel=2, world_size=2), "ZeRO-3 only"),
        (dict(backend="deepspeed", zero_stage=2, expert_parallel=2, world_size=2), "ZeRO-3"),
        (dict(backend="deepspeed", zero_stage=3, expert_parallel=2, world_size=3), "divide"),
        (dict(expert_parallel=0), ">= 1"),
    ],
)
def test_expert_parallel_settings_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        validate_trainer(trainer_cfg(**kw))
    validate_trainer(
        trainer_cfg(backend="deepspeed", zero_stage=3, expert_parallel=2, world_size=4)
    )


def test_keep_routing_is_refused_with_expert_parallel_until_the_step_replays_there():
    cfg = trainer_cfg(backend="deepspeed", zero_stage=3, expert_parallel=2, world_size=2)
    cfg.sampling.keep_routing = True
    with pytest.raises(ValueError, match="keep_routing=true with trainer.expert_parallel=2"):
        validate_trainer(cfg)


def test_autoep_refuses_models_it_cannot_map(tiny_moe):
    from transformers import AutoConfig

    from trainer.backends.deepspeed_backend import autoep_config

    t = trainer_cfg(backend="deepspeed", zero_stage=3, expert_parallel=2, world_size=2).trainer
    moe = AutoConfig.from_pretrained(tiny_moe)
    assert autoep_config(t, moe) == {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}
    t.expert_parallel = 3
    with pytest.raises(ValueError, match="divide the model's 8 experts"):
        autoep_config(t, moe)
    t.expert_parallel = 2
    moe.model_type = "llama"
    with pytest.raises(ValueError, match="'llama'"):
        autoep_config(t, moe)
    t.expert_parallel = 1
    assert autoep_config(t, moe) is None


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_forced_route_is_the_router_at_given_ids(score_func):
    """At the router's own choice the forced route is its output exactly; at other ids
    the weights come from the live gate there, and the gate gets their gradient."""
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter

    from pipeline import routing

    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(
        dim=16,
        num_experts=8,
        num_expert_groups=None,
        num_limited_groups=None,
        top_k=2,
        score_func=score_func,
        route_norm=True,
        route_scale=1.5,
        gate_bias=False,
    )
    x = torch.randn(5, 16)
    top, ids, counts = router(x)
    forced = routing.autoep_forced_route(router, x, ids)
    for a, b in zip(forced, (top, ids, counts), strict=True):
        assert torch.equal(a, b)
    other = (ids + 3) % 8
    top2, ids2, counts2 = routing.autoep_forced_route(router, x, other)
    assert torch.equal(ids2, other) and int(counts2.sum()) == 10
    assert not torch.allclose(top2, top)
    (top2 * torch.randn_like(top2)).sum().backward()
    assert router.gate.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="outside 0..7"):
        routing.autoep_forced_route(router, x, other + 8)
    with pytest.raises(ValueError, match="picks 2 experts"):
        routing.autoep_forced_route(router, x, other[:, :1])


@pytest.mark.slow
def test_autoep_training_matches_the_torch_backend(tiny_moe, tmp_path):
    """2 ranks, ZeRO-3, AutoEP size 2: losses, grad norms and the weights (gathered under
    HF names) of 4 steps against the torch backend on one rank."""
    ref_weights, ep_weights = tmp_path / "torch.safetensors", tmp_path / "ep.safetensors"
    ref = run_ranks(
        tmp_path / "t.json", tiny_moe, "torch", 0, 1, "--weights", str(ref_weights), tmp=tmp_path
    )
    ep = run_ranks(
        tmp_path / "ep.json",
        tiny_moe,
        "deepspeed",
        3,
        2,
        "--expert-parallel",
        "2",
        "--weights",
        str(ep_weights),
        tmp=tmp_path,
    )
    assert len(ep["loss"]) == len(ref["loss"]) == STEPS
    assert ep["loss"][0] == pytest.approx(ref["loss"][0], rel=1e-7, abs=1e-9)
    assert ep["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert ep["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert_weights_match(str(ep_weights), str(ref_weights), tiny_moe)


@pytest.mark.slow
def test_keep_routing_through_the_autoep_router(tiny_moe, tmp_path):
    """The experts each AutoEP router picked, forced back, give the same logits bit for
    bit on both ranks; every id moved to the next expert changes them."""
    out, port = tmp_path / "kr.json", str(free_port("127.0.0.1"))
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
            HF_HUB_OFFLINE="1",
        )
        cmd = [sys.executable, "-W", "ignore::FutureWarning", "-m", "tests.autoep_ranks"]
        log = open(tmp_path / f"kr-rank{rank}.log", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen([*cmd, str(out), tiny_moe], cwd=ROOT, env=env, stdout=log, stderr=log)
        )
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [(tmp_path / f"kr-rank{r}.log").read_text() for r in range(2)]
    assert not any(codes), f"exit codes {codes}\n" + "\n".join(t[-2500:] for t in logs)
    result = json.loads(out.read_text())
    assert result["routers"] == 2
    assert result["picked_shapes"] == [[10, 2], [10, 2]]  # rank 0: 2 x 5 tokens, top-2
    assert result["same"] == 0.0
    assert result["moved"] > 1e-3
