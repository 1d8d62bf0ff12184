"""The vllm engine on a GPU with vLLM 0.24.0 (``-m gpu``; skipped without CUDA or vLLM):
generation through the engine interface, swaps under 64 streaming requests that all
finish at full length, and greedy log-probs under versions A, B, A (A reproduced
bit for bit, B different). Written to the recipe; not yet run on a GPU."""

from __future__ import annotations

import importlib.util
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
    pytest.skip("needs a CUDA GPU and vLLM 0.24.0", allow_module_level=True)

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from actor.engines.vllm.client import VLLMEngine  # noqa: E402
from tests.vllm_builders import GPU_CFG, install  # noqa: E402


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**GPU_CFG)).to(torch.bfloat16)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**GPU_CFG)).to(torch.bfloat16).save_pretrained(folder)
    settings = SimpleNamespace(
        in_flight=64,
        gpu_memory_utilization=0.3,
        max_num_seqs=128,
        tensor_parallel_size=1,
        enforce_eager=False,
        enable_prefix_caching=True,
        max_model_len=1024,
        lock_timeout_s=10.0,
        rpc_timeout_s=120.0,
    )
    e = VLLMEngine(
        str(folder), None, temperature=1.0, top_p=1.0, top_k=0, settings=settings, seed=0
    )
    yield e
    e.close()


def test_generation_through_the_engine_interface(engine):
    outs = engine.generate([[1, 2, 3, 4, 5]] * 4 + [[7, 8, 9]] * 4, 16)
    assert len(outs) == 8
    for o in outs:
        assert len(o.tokens) == len(o.logprobs) == len(o.versions) == 16
        assert all(lp <= 0 for lp in o.logprobs) and set(o.versions) == {engine.version}


def test_swaps_under_64_streaming_requests_finish_every_request(engine):
    base = engine.version
    result = {}
    prompts = [[(i * 31 + j) % 4000 + 1 for j in range(32)] for i in range(64)]
    t = threading.Thread(target=lambda: result.setdefault("o", engine.generate(prompts, 512)))
    t.start()
    for k in (1, 2, 3):
        time.sleep(0.3)
        install(engine, base + k, weights(k))
    t.join()
    outs = result["o"]
    assert [len(o.tokens) for o in outs] == [512] * 64  # no stop ids: every one at full length
    assert any(o.versions[0] < o.versions[-1] for o in outs), "no request spanned a swap"
    assert engine.version == base + 3


def test_greedy_logprobs_under_a_b_a(engine):
    engine.sampling["temperature"] = 0.0  # greedy (vLLM's temperature 0)
    try:
        got = {}
        base = engine.version
        for k, (tag, seed) in enumerate((("A", 10), ("B", 11), ("A2", 10)), start=1):
            install(engine, base + k, weights(seed))
            out = engine.generate([list(range(100, 164))], 16)[0]
            got[tag] = (out.tokens, out.logprobs)
        assert got["A"] == got["A2"]  # bit for bit: floats compared exactly
        assert got["A"] != got["B"]
    finally:
        engine.sampling["temperature"] = 1.0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for TP=2")
def test_tensor_parallel_2_swaps_every_shard_between_the_same_steps(tmp_path):
    """TP=2: versions A, B, A under greedy decoding; A is reproduced bit for bit (every
    rank holds its shard of A again), B differs, and requests streaming through the
    swaps finish at full length (no step mixed versions across ranks: it would
    corrupt the output, not fail loudly, so A-B-A exactness is the check)."""
    folder = tmp_path / "tiny-llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**GPU_CFG)).to(torch.bfloat16).save_pretrained(folder)
    settings = SimpleNamespace(
        in_flight=64,
        gpu_memory_utilization=0.3,
        max_num_seqs=128,
        tensor_parallel_size=2,
        enforce_eager=False,
        enable_prefix_caching=True,
        max_model_len=1024,
        lock_timeout_s=10.0,
        rpc_timeout_s=120.0,
    )
    e = VLLMEngine(str(folder), None, temperature=0.0, top_p=1.0, top_k=0, settings=settings)
    try:
        assert e.info["tp_size"] == 2
        got = {}
        for k, (tag, seed) in enumerate((("A", 10), ("B", 11), ("A2", 10)), start=1):
            install(e, k, weights(seed))
            out = e.generate([list(range(100, 164))], 16)[0]
            got[tag] = (out.tokens, out.logprobs)
        assert got["A"] == got["A2"] and got["A"] != got["B"]
        result = {}
        prompts = [[(i * 31 + j) % 4000 + 1 for j in range(32)] for i in range(64)]
        t = threading.Thread(target=lambda: result.setdefault("o", e.generate(prompts, 256)))
        t.start()
        for k in (4, 5):
            time.sleep(0.3)
            install(e, k, weights(k))
        t.join()
        assert [len(o.tokens) for o in result["o"]] == [256] * 64
    finally:
        e.close()
