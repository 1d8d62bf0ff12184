"""The vllm engine on a CUDA GPU with vLLM 0.24.0 (``-m gpu``): the GPU proof's tests
(deploy/vllm/gpu_proof.sh runs them on the GPU host; on an H200, 2026-11-28: 9 passed,
TP=2 skipped; bench/results/vllm-gpu-2026-11-28.md).

- generation through the engine interface;
- greedy log-probs under versions A, B, A with CUDA graphs on and off (A reproduced
  bit for bit, B different: the captured graphs read the swapped weights);
- 16 streams sampled across 3 swaps, each token's log-prob recomputed by teacher
  forcing under its stamped version (per step: a sequence keeps the KV cache of its
  earlier steps): the check of the lock's span that cannot fail on the CPU, where
  the forward and the logits run on one thread with nothing queued;
- 64 streaming requests through swaps, all at full length; the swap's copy enqueued
  on the stream the steps run on;
- pause mode (``weights.update_mode=pause``);
- forced preemption (a KV cache of a few blocks, small prefill chunks) with swaps:
  one recorded step per token (model runner V2 re-sends a preempted request as new);
- LoRA: adapter versions A, B, A.

Collected and set up on the CPU too: the settings come from the project's VLLMConfig
(tests/vllm_builders.py gpu_settings) before the skip (need_gpu), so a settings field
these tests lack fails CI, not the GPU host. ``NONSTOP_GPU_RESULTS`` (a file): each
test appends its numbers there, one JSON line.
"""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.vllm_builders import (
    GPU_CFG,
    GPU_DEVICE,
    adapter_announcement,
    gpu_settings,
    install,
    need_gpu,
)

pytestmark = pytest.mark.gpu
WINDOW = 3  # tokens each side of a swap recomputed under the other version too
SHARP = 0.1  # initializer_range of the teacher-forced versions: logits spread by ~1.6 nats
LORA = SimpleNamespace(rank=8, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"])


def record(name: str, **data) -> None:
    """Print the test's numbers; append them to $NONSTOP_GPU_RESULTS (JSON lines)."""
    line = json.dumps({"test": name, **data}, default=str)
    print(f"\n{line}")
    path = os.environ.get("NONSTOP_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def llama(seed: int, init: float = 0.02) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**GPU_CFG, initializer_range=init)).to(torch.bfloat16)


def weights(seed: int, init: float = 0.02) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llama(seed, init).named_parameters()}


def start(folder, temperature: float = 1.0, engine_args: dict | None = None, **kw):
    """The engine on the tiny Llama in ``folder``: settings first (checked here too),
    then the skip where there is no GPU."""
    from actor.engines.vllm.client import VLLMEngine

    settings = gpu_settings(**kw)
    need_gpu()
    t0 = time.monotonic()
    e = VLLMEngine(str(folder), None, temperature=temperature, top_p=1.0, top_k=0,
                   settings=settings, seed=0, engine_args=engine_args)  # fmt: skip
    e.start_s = time.monotonic() - t0
    e.sampling["ignore_eos"] = True  # the random model's EOS (id 2) would end some early
    return e


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    llama(0).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def engine(model_dir):
    """CUDA graphs and torch.compile on (the default)."""
    e = start(model_dir, gpu_memory_utilization=0.25)
    yield e
    e.close()


@pytest.fixture(scope="module")
def eager(model_dir):
    """CUDA graphs off, and a KV cache of 96 blocks of 16 tokens with 256-token prefill
    chunks: 16 requests of 32 + 400 tokens need 432 blocks, so the scheduler
    preempts, and a preempted request is recomputed in chunks."""
    args = {"num_gpu_blocks_override": 96, "max_num_batched_tokens": 256}
    e = start(model_dir, engine_args=args, enforce_eager=True, gpu_memory_utilization=0.2)
    yield e
    e.close()


def test_generation_through_the_engine_interface(engine):
    outs = engine.generate([[1, 2, 3, 4, 5]] * 4 + [[7, 8, 9]] * 4, 16)
    assert len(outs) == 8
    for o in outs:
        assert len(o.tokens) == len(o.logprobs) == len(o.versions) == 16
        assert all(lp <= 0 for lp in o.logprobs) and set(o.versions) == {engine.version}
    record("start", graphs_s=engine.start_s, info=engine.info)


@pytest.mark.parametrize("which", ["engine", "eager"])
def test_greedy_logprobs_under_a_b_a(which, request):
    """CUDA graphs on (``engine``) and off (``eager``): A again is A bit for bit."""
    e = request.getfixturevalue(which)
    e.sampling["temperature"] = 0.0  # greedy (vLLM's temperature 0)
    try:
        got, base = {}, e.version
        for k, (tag, seed) in enumerate((("A", 10), ("B", 11), ("A2", 10)), start=1):
            install(e, base + k, weights(seed))
            out = e.generate([list(range(100, 164))], 16)[0]
            got[tag] = (out.tokens, out.logprobs, out.versions)
            assert out.versions == [base + k] * 16
        da_b = [abs(x - y) for x, y in zip(got["A"][1], got["B"][1], strict=True)]
        record(f"a_b_a_{which}", same=got["A"][:2] == got["A2"][:2],
               b_differs=got["A"][:2] != got["B"][:2], max_abs_dlogprob_a_b=max(da_b))  # fmt: skip
        assert got["A"][:2] == got["A2"][:2]  # bit for bit: floats compared exactly
        assert got["A"][:2] != got["B"][:2]
    finally:
        e.sampling["temperature"] = 1.0


def teacher_forced(models: dict, prompts, outs):
    """Per request, each token's log-prob recomputed (float32 over the bf16 weights) as
    vLLM computed it if every step used one whole version, the stamped one: incremental
    decoding with a shared KV cache, the weights chosen per step by the token's stamp.
    At each token within WINDOW steps of a swap, also its log-prob under the version on
    the swap's other side. Returns (own, other): per request, a list and a dict."""
    import copy

    from transformers import DynamicCache

    groups: dict[tuple, list[int]] = {}
    for r, (p, c) in enumerate(zip(prompts, outs, strict=True)):
        groups.setdefault((len(p), tuple(c.versions)), []).append(r)
    own = [[] for _ in outs]
    other = [{} for _ in outs]
    with torch.no_grad():
        for (_, stamps), rows in groups.items():
            cache = DynamicCache()
            feed = torch.tensor([prompts[r] for r in rows], device=GPU_DEVICE)
            for i, v in enumerate(stamps):
                window = range(max(0, i - WINDOW), min(len(stamps), i + WINDOW + 1))
                near = {stamps[j] for j in window} - {v}
                for u in near:  # the step under the other version, on a copy of the cache
                    alt = models[u](feed, past_key_values=copy.deepcopy(cache), use_cache=True)
                    lp = torch.log_softmax(alt.logits[:, -1].float(), -1)
                    for k, r in enumerate(rows):
                        other[r][i] = float(lp[k, outs[r].tokens[i]])
                out = models[v](feed, past_key_values=cache, use_cache=True)
                lp = torch.log_softmax(out.logits[:, -1].float(), -1)
                for k, r in enumerate(rows):
                    own[r].append(float(lp[k, outs[r].tokens[i]]))
                feed = torch.tensor([[outs[r].tokens[i]] for r in rows], device=GPU_DEVICE)
    return own, other


def test_each_token_comes_from_the_version_it_is_stamped_with(engine):
    """16 streams sampled (temperature 1) across 3 swaps under the lock; every token's
    log-prob, recomputed under its stamped version, matches vLLM's to bf16 precision,
    and at every swap the tokens on both sides are nearer their own version than the
    other: no step mixed versions, no stamp is a step off (the lock spans the forward
    and the logits; the copy is ordered on the engine's stream)."""
    base = engine.version
    seeds = {base + k: 20 + k for k in (1, 2, 3, 4)}
    tensors = {v: weights(s, SHARP) for v, s in seeds.items()}
    install(engine, base + 1, tensors[base + 1])
    prompts = [[(i * 37 + j * 11) % 4000 + 1 for j in range(24)] for i in range(16)]
    n = 700
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("o", engine.generate(prompts, n)))
    t.start()
    swap_s = []
    for v in (base + 2, base + 3, base + 4):
        time.sleep(0.15)
        t0 = time.monotonic()
        install(engine, v, tensors[v])
        swap_s.append(time.monotonic() - t0)
    t.join()
    outs = result["o"]
    models = {}
    for v, tens in tensors.items():
        m = llama(0, SHARP)
        m.load_state_dict(tens)
        models[v] = m.to(GPU_DEVICE).float().eval()
    own, other = teacher_forced(models, prompts, outs)
    diffs = [abs(a - b) for c, o in zip(outs, own, strict=True)
             for a, b in zip(c.logprobs, o, strict=True)]  # fmt: skip
    bounds = []  # per request and swap: (own, other) worst |vLLM - recomputed| beside it
    for c, o, alt in zip(outs, own, other, strict=True):
        for b in range(1, len(c.versions)):
            if c.versions[b] != c.versions[b - 1]:
                near = range(max(0, b - WINDOW), min(len(c.versions), b + WINDOW))
                mine = max(abs(c.logprobs[j] - o[j]) for j in near)
                theirs = max(abs(c.logprobs[j] - alt[j]) for j in near if j in alt)
                bounds.append((mine, theirs))
    spans = sorted({len(set(c.versions)) for c in outs})
    median = sorted(diffs)[len(diffs) // 2]
    record("teacher_forced", tokens=len(diffs), worst=max(diffs), median=median,
           p99=sorted(diffs)[int(0.99 * len(diffs))],
           versions_per_request=spans, swaps_seen=len(bounds),
           bound_own_max=max((m for m, _ in bounds), default=None),
           bound_other_min=min((t for _, t in bounds), default=None),
           install_s=swap_s, exact=all(c.versions_exact for c in outs))  # fmt: skip
    assert all(len(c.tokens) == n and c.versions_exact for c in outs)
    assert all(c.versions == sorted(c.versions) for c in outs), "a stamp went back"
    assert max(spans) >= 3, f"the swaps did not land mid-stream: {spans}"
    p99 = sorted(diffs)[int(0.99 * len(diffs))]  # bf16 both sides: a few tokens differ more
    assert median < 0.1 and p99 < 1.0, (median, p99, max(diffs))
    assert bounds and all(mine < theirs for mine, theirs in bounds), "a step off its stamp"


def test_swaps_under_64_streaming_requests_finish_every_request(engine):
    base = engine.version
    result = {}
    prompts = [[(i * 31 + j) % 4000 + 1 for j in range(32)] for i in range(64)]
    t = threading.Thread(target=lambda: result.setdefault("o", engine.generate(prompts, 512)))
    t.start()
    polls = []
    for k in (1, 2, 3):
        time.sleep(0.3)
        install(engine, base + k, weights(k))
        polls.append(engine.rpc("nonstop_poll", [], False))
    t.join()
    outs = result["o"]
    holds = [round(s.ms, 3) for s in engine.stats.recent_swaps if s.mode == "staged"]
    record("streams_64", lock_hold_ms=holds[-3:], install_stream=engine.info["install_stream"],
           spanned=sum(o.versions[0] < o.versions[-1] for o in outs))  # fmt: skip
    assert [len(o.tokens) for o in outs] == [512] * 64  # no stop ids: every one at full length
    assert any(o.versions[0] < o.versions[-1] for o in outs), "no request spanned a swap"
    assert engine.version == base + 3


def test_swap_copy_goes_on_the_stream_the_steps_run_on(engine):
    """The worker reads the engine's current stream at every execute_model entry and
    enqueues the copy there (vLLM 0.32+ moves the engine thread to a stream of its own
    with CUDA graphs; 0.24 runs it on whatever stream that thread has)."""
    install(engine, engine.version + 1, weights(5))
    engine.generate([[1, 2, 3]], 4)  # steps after the swap
    streams = engine.rpc("nonstop_engine_stream")
    record("streams", **streams)
    if GPU_DEVICE == "cpu":
        pytest.skip("no CUDA streams on the CPU dry run")
    assert streams["last_swap"] == streams["last_step"] is not None


def test_pause_mode(engine):
    """weights.update_mode=pause: vLLM's pause_generation(keep), the swap, resume."""
    base = engine.version
    engine.update_mode = "pause"
    try:
        result = {}
        prompts = [[(i * 17 + j) % 4000 + 1 for j in range(32)] for i in range(64)]
        t = threading.Thread(target=lambda: result.setdefault("o", engine.generate(prompts, 384)))
        t.start()
        took = []
        for k in (1, 2):
            time.sleep(0.3)
            t0 = time.monotonic()
            install(engine, base + k, weights(30 + k))
            took.append(time.monotonic() - t0)
        t.join()
    finally:
        engine.update_mode = "lock"
    outs = result["o"]
    pauses = [round(s.ms, 2) for s in engine.stats.recent_swaps if s.mode == "pause"]
    record("pause_mode", pause_ms=pauses[-2:], install_s=took,
           spanned=sum(o.versions[0] < o.versions[-1] for o in outs))  # fmt: skip
    assert [len(o.tokens) for o in outs] == [384] * 64
    assert engine.version == base + 2 and all(o.versions_exact for o in outs)


def test_forced_preemption_keeps_one_step_per_token(eager):
    """A KV cache too small for the requests: the scheduler preempts and recomputes
    (model runner V2 re-sends the request as new, prefill_token_ids = prompt + sampled
    tokens, recomputed in chunks); swaps meanwhile. Every request finishes at full
    length with one recorded step per token, stamps never going back."""
    base = eager.version
    before = eager.rpc("nonstop_poll", [], False)["preemption"]
    result = {}
    prompts = [[(i * 13 + j) % 4000 + 1 for j in range(32)] for i in range(16)]
    t = threading.Thread(target=lambda: result.setdefault("o", eager.generate(prompts, 400)))
    t.start()
    for k in (1, 2):
        time.sleep(0.5)
        install(eager, base + k, weights(40 + k))
    t.join()
    outs = result["o"]
    after = eager.rpc("nonstop_poll", [], False)["preemption"]
    record("preemption", before=before, after=after, exact=sum(o.versions_exact for o in outs),
           requests=len(outs), versions=sorted({v for o in outs for v in o.versions}),
           inexact_stamps=eager.stats.inexact_stamps)  # fmt: skip
    assert [len(o.tokens) for o in outs] == [400] * 16
    assert after["preempted"] > before["preempted"], "nothing was preempted: no test"
    assert all(o.versions_exact for o in outs)
    assert all(o.versions == sorted(o.versions) for o in outs)


def test_lora_adapter_versions_a_b_a(model_dir, tmp_path):
    """model.lora on the GPU: version 0 is the trainer's initial adapter (the base
    model's outputs), a trained one changes greedy output, back to A reproduces it."""
    from actor.engines.vllm.client import VLLMEngine
    from pipeline import lora

    settings = gpu_settings(enforce_eager=True, gpu_memory_utilization=0.2)
    need_gpu()
    e = VLLMEngine(str(model_dir), None, temperature=0.0, top_p=1.0, top_k=0,
                   settings=settings, lora=LORA, lora_seed=0)  # fmt: skip
    try:
        base = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        a = {n: t.clone() for n, t in lora.adapter_tensors(lora.apply_lora(base, LORA, 0)).items()}
        g = torch.Generator().manual_seed(5)
        b = {n: t + 0.5 * torch.randn(t.shape, generator=g) for n, t in a.items()}
        prompt = [list(range(10, 42))]
        ref = e.generate(prompt, 24)[0]
        got = {}
        for v, tensors in ((1, b), (2, a)):
            ann, flat = adapter_announcement(v, tensors)
            from pipeline.transfer import TensorSource

            e.stage(ann, TensorSource(flat), time.monotonic() + 60)
            e.swap(v)
            got[v] = e.generate(prompt, 24)[0]
            assert got[v].versions == [v] * 24
        holds = [round(s.ms, 3) for s in e.stats.recent_swaps if s.mode == "staged"]
        record("lora", info=e.info, lock_hold_ms=holds,
               b_differs=got[1].logprobs != ref.logprobs,
               a_again=(got[2].tokens, got[2].logprobs) == (ref.tokens, ref.logprobs))  # fmt: skip
        assert got[1].logprobs != ref.logprobs
        assert (got[2].tokens, got[2].logprobs) == (ref.tokens, ref.logprobs)
    finally:
        e.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for TP=2")
def test_tensor_parallel_2_swaps_every_shard_between_the_same_steps(model_dir):
    """TP=2: versions A, B, A under greedy decoding; A is reproduced bit for bit (every
    rank holds its shard of A again), B differs, and requests streaming through the
    swaps finish at full length (no step mixed versions across ranks: it would
    corrupt the output, not fail loudly, so A-B-A exactness is the check)."""
    e = start(model_dir, temperature=0.0, tensor_parallel_size=2)
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
