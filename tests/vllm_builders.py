"""Builders shared by the vLLM tests (the worker extension, the engine client, LoRA, TP
ranks, and the GPU tests): a tiny HF Llama and its state, what vLLM's Llama holds for it
(the fused layout, a TP rank's shard), a fake vLLM model and SchedulerOutput, weight and
adapter announcements with small buckets, and the engine settings of the fake-engine
tests. Imported by the test modules and by tests/tp_rank.py; no test lives here."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

import msgspec
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline import lora
from pipeline.messages import SCHEMA_VERSION, WeightAnnouncement
from pipeline.transfer import TensorSource
from pipeline.transfer.buckets import bucket_layout, bucket_sums, flatten
from tests import vllm_real

if TYPE_CHECKING:
    from actor.engines.vllm.client import VLLMEngine

# ---- a tiny HF Llama and what vLLM's Llama holds for it

VOCAB, PAD_TO = 100, 64


def hf_model(seed: int, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg)


def vllm_layout(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM's Llama holds for these HF weights (TP=1): fused qkv / gate_up,
    vocabulary padded to a multiple of 64 rows (padding rows zero)."""
    out = {}
    for name, t in hf.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            k, v = name.replace(".q_proj.", ".k_proj."), name.replace(".q_proj.", ".v_proj.")
            out[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat([t, hf[k], hf[v]])
        elif ".gate_proj." in name:
            out[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat(
                [t, hf[name.replace(".gate_proj.", ".up_proj.")]]
            )
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = -(-t.shape[0] // PAD_TO) * PAD_TO
            padded = torch.zeros(rows, t.shape[1])
            padded[: t.shape[0]] = t
            out[name] = padded
        else:
            out[name] = t.clone()
    return out


class FakeVllmModel(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.names = list(tensors)
        self.flat = torch.nn.ParameterList(
            [torch.nn.Parameter(t.clone(), requires_grad=False) for t in tensors.values()]
        )

    def named_parameters(self, *args, **kwargs):
        return iter(zip(self.names, self.flat, strict=True))


def hf_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")


def shard(hf: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """What vLLM's Llama holds on TP rank ``rank`` of ``size`` for these HF weights:
    q/k/v and gate/up split by output rows then fused, o/down split by input columns,
    the vocabulary padded to 64 rows then split in equal blocks, norms replicated."""
    out = {}
    for name, t in vllm_layout(hf).items():
        if ".qkv_proj." in name:
            parts = [hf[name.replace(".qkv_proj.", f".{p}_proj.")] for p in "qkv"]
            out[name] = torch.cat([p.chunk(size)[rank] for p in parts])
        elif ".gate_up_proj." in name:
            parts = [hf[name.replace(".gate_up_proj.", f".{p}_proj.")] for p in ("gate", "up")]
            out[name] = torch.cat([p.chunk(size)[rank] for p in parts])
        elif name.endswith(ROW_PARALLEL):
            out[name] = t.chunk(size, dim=1)[rank].contiguous()
        elif t.dim() == 2:  # embed_tokens / lm_head, padded by vllm_layout
            out[name] = t.chunk(size)[rank].contiguous()
        else:
            out[name] = t.clone()
    return out


def sched(new=(), cached=(), scheduled=None, finished=(), prefill=None, preempted=(), resumed=()):
    """A minimal SchedulerOutput (vLLM 0.24's fields): new=[(id, prompt_len, computed)],
    cached=[(id, computed)]; ``prefill`` {id: n}: model runner V2's
    ``prefill_token_ids`` (prompt + sampled tokens of a request re-sent after
    preemption); ``preempted``: ``preempted_req_ids``; ``resumed``: V1's
    ``resumed_req_ids`` among the cached ones."""
    prefill = prefill or {}
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=r,
                prompt_token_ids=[0] * n,
                num_computed_tokens=c,
                prefill_token_ids=[0] * prefill[r] if r in prefill else None,
            )
            for r, n, c in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            num_computed_tokens=[c for _, c in cached],
            resumed_req_ids=set(resumed),
        ),
        num_scheduled_tokens=dict(scheduled or {}),
        total_num_scheduled_tokens=sum((scheduled or {}).values()),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


# ---- weight and adapter announcements, new versions on an engine


def announcement(version: int, hf: dict[str, torch.Tensor], bucket_bytes: int = 4096):
    """tests/vllm_real.py's announcement with small buckets (many of them per model)."""
    return vllm_real.announcement(version, hf, bucket_bytes)


def adapter_announcement(version: int, tensors: dict[str, torch.Tensor]):
    ann, flat = announcement(version, tensors, bucket_bytes=1024)  # several buckets
    return msgspec.structs.replace(ann, kind=lora.KIND_LORA), flat


def new_version(engine, version: int, seed: int):
    ann, flat = announcement(version, hf_state(hf_model(seed)))
    engine.stage(ann, TensorSource(flat), time.monotonic() + 20)
    engine.swap(version)


def prompts(n: int, length: int = 10, shared: bool = False):
    return [[(i * 0 if shared else i) + j for j in range(length)] for i in range(n)]


# ---- the engine settings of the fake-engine tests (tests/vllm_fake.py)


def settings(**kw):
    """``actor.vllm`` for the fake-engine tests: the project's VLLMConfig (every field,
    so a field the engine reads and a test forgot fails here, not on a GPU host)."""
    from pipeline.config import VLLMConfig

    base = dict(
        in_flight=8,
        gpu_memory_utilization=0.5,
        max_num_seqs=64,
        enforce_eager=True,
        max_model_len=512,
        lock_timeout_s=2.0,
        rpc_timeout_s=20.0,
    )
    return VLLMConfig(**{**base, **kw})


# ---- the GPU tests (vLLM 0.24.0): a Llama shape vLLM's GPU attention takes, and a
# version installed through the engine

GPU_CFG = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def gpu_settings(**kw):
    """``actor.vllm`` for the GPU tests (tests/test_vllm_gpu*.py, deploy/vllm/gpu_proof.sh):
    the project's VLLMConfig with every field, checked by the config's own
    ``validate_vllm``, so the set-up that failed on the GPU host (a field missing from
    hand-built settings) fails on the CPU in CI (tests/test_vllm_engine.py starts the
    fake engine with them)."""
    from omegaconf import OmegaConf

    from pipeline.config import Config, VLLMConfig
    from pipeline.config.actor import validate_vllm

    # vLLM forks its engine core unless told otherwise; on the GPU host something in the
    # pytest process (a plugin of the image's) had initialized CUDA, and every engine
    # core died with "Cannot re-initialize CUDA in forked subprocess" (2026-11-28)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

    base = dict(
        in_flight=64,
        gpu_memory_utilization=0.3,
        max_num_seqs=128,
        enforce_eager=False,
        max_model_len=1024,
        rpc_timeout_s=120.0,
    )
    if GPU_DRY_RUN and not torch.cuda.is_available():
        kw["enforce_eager"] = True  # no torch.compile on the CPU dry run: quicker
    out = VLLMConfig(**{**base, **kw})
    cfg = OmegaConf.structured(Config)
    cfg.actor.engine, cfg.actor.vllm = "vllm", OmegaConf.structured(out)
    validate_vllm(cfg)
    return out


def need_gpu() -> None:
    """Skip, saying why, where the GPU tests cannot run: after their settings are built
    (gpu_settings), so CI on the CPU runs the set-up as far as it goes."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM 0.24.0 (CUDA) installed")
    if not torch.cuda.is_available() and not GPU_DRY_RUN:
        pytest.skip("needs a CUDA GPU (run on the GPU host: deploy/vllm/gpu_proof.sh)")


# NONSTOP_GPU_DRY_RUN=1: the gpu tests' code run on the CPU build of vLLM (eager, float
# tensors on the CPU), to find a mistake in them before a GPU host is lent
GPU_DRY_RUN = os.environ.get("NONSTOP_GPU_DRY_RUN") == "1"
GPU_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def install(engine: VLLMEngine, version: int, tensors: dict[str, torch.Tensor]) -> None:
    layout = bucket_layout(list(tensors.items()), 16 << 20)
    flat = flatten(tensors, layout)
    ann = WeightAnnouncement(
        schema=SCHEMA_VERSION,
        version=version,
        dtype="bfloat16",
        buckets=layout,
        **bucket_sums(flat),
        targets=["gpu-test"],
        created=time.time(),
    )
    engine.stage(ann, TensorSource(flat), time.monotonic() + 120)
    engine.swap(version)


VLLM = (  # a small, quick engine: no torch.compile, few sequences, a short context
    "actor.engine=vllm",
    "actor.vllm.enforce_eager=true",
    "actor.vllm.max_model_len=512",
    "actor.vllm.in_flight=8",
    "actor.vllm.max_num_seqs=8",
)


ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
