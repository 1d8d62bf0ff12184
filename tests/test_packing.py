"""The packed layout (pipeline/packing.py: no padding, each distinct prompt once) trains
exactly as the padded rows did: the same log-probs, the same loss and the same gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.config import Config
from pipeline.logprobs import completion_logprobs
from pipeline.messages import (
    SCHEMA_VERSION,
    Sample,
    TrainBatch,
    decode,
    encode,
    pack_f32,
    pack_i32,
    rle_encode,
)
from pipeline.models import load_model, materialize_model
from pipeline.packing import packs
from trainer import step as step_module
from trainer.backends.torch_backend import TorchBackend
from trainer.collate import collate
from trainer.ranks import Ranks
from trainer.step import token_logprobs, train_step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return materialize_model("tiny", str(tmp_path_factory.mktemp("m")))


def _batch(seed: int = 0, top_k: int = 0) -> TrainBatch:
    """Two groups of three sharing a prompt, a third prompt alone (lengths 7, 3, 5);
    completions of 1 to 9 ids; the last sample an episode whose middle ids are an
    observation (read, never scored); with ``top_k`` a recorded sampling mask per token."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 100, n) for n in (7, 3, 5)]
    rows = [0, 0, 0, 1, 1, 1, 2]
    samples = []
    for i in range(len(rows)):
        n = int(rng.integers(1, 10)) if i < len(rows) - 1 else 9
        ids = rng.integers(3, 100, n)
        loss_mask = b""
        if i == len(rows) - 1:  # sampled, 3 observation ids, sampled
            loss_mask = np.array([1, 1, 1, 0, 0, 0, 1, 1, 1], dtype=np.uint8).tobytes()
        sampled = n if not loss_mask else 6
        kept = {}
        if top_k:  # the sampled id and top_k - 1 others, per sampled token
            kept_ids = [np.unique(np.r_[t, rng.integers(3, 100, top_k - 1)]) for t in ids]
            if loss_mask:
                kept_ids = [k for k, m in zip(kept_ids, loss_mask, strict=True) if m]
            kept = dict(
                mask_ids=pack_i32(np.concatenate(kept_ids)),
                mask_counts=pack_i32([len(k) for k in kept_ids]),
            )
        samples.append(
            Sample(
                index=i,
                completion_ids=pack_i32(ids),
                logprobs=pack_f32(-rng.uniform(1, 5, sampled)),
                versions=rle_encode([0] * sampled),
                reward=float(i % 2),
                finished=True,
                advantage=float(rng.normal()),
                loss_mask=loss_mask,
                **kept,
            )
        )
    batch = TrainBatch(
        schema=SCHEMA_VERSION,
        batch_id="b",
        group_ids=[f"g{g}" for g in rows],
        prompt_ids=[pack_i32(prompts[g]) for g in rows],
        samples=samples,
        temperature=0.8,
        top_k=top_k,
    )
    return decode(encode(batch), TrainBatch)  # as the trainer reads it


def _model(path: str, attention: str):
    model, _ = load_model(path)
    model.set_attn_implementation(attention)
    return model


@pytest.mark.parametrize("top_k", [0, 12], ids=["recomputed", "recorded-mask"])
@pytest.mark.parametrize("attention", ["sdpa", "sdpa-math", "eager"])
def test_packed_logprobs_and_gradients_equal_the_padded_ones(tiny, attention, top_k):
    """sdpa: the kernel torch picks on this device, and its reference (math) kernel."""
    model = _model(tiny, attention.removesuffix("-math"))
    mb = collate(_batch(top_k=top_k), 0, torch.device("cpu"))
    pk = mb.packed
    assert packs(model) and pk is not None
    # a row per distinct prompt: the prompt once, then its completions
    c_len = mb.attn.sum(1) - torch.tensor([7] * 3 + [3] * 3 + [5])
    lengths = [7 + int(c_len[:3].sum()), 3 + int(c_len[3:6].sum()), 5 + int(c_len[6])]
    assert tuple(pk.ids.shape) == (3, max(lengths)) and pk.ids.numel() < mb.ids.numel()
    assert len(pk.predict) == mb.tokens == int(mb.comp.sum())
    weights = torch.randn(mb.comp.shape, generator=torch.Generator().manual_seed(0))

    def run(packed: bool):
        model.zero_grad()
        if packed:
            lp = token_logprobs(model, mb, None)
        else:
            lp = completion_logprobs(
                model, mb.ids, mb.attn, mb.comp, mb.temperature, mb.top_p, mb.top_k, mb.masks
            )
        (lp * weights).sum().backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters()]

    everything = [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    kernel = [SDPBackend.MATH] if attention == "sdpa-math" else everything
    with sdpa_kernel(kernel):
        lp_packed, grads_packed = run(True)
        lp_padded, grads_padded = run(False)
    assert torch.isfinite(lp_padded[mb.comp]).all() and (lp_padded[~mb.comp] == 0).all()
    torch.testing.assert_close(lp_packed, lp_padded, rtol=0, atol=1e-5)
    # float32 sums in another order (other shapes): seen up to 2.1e-6 apart (rel 3e-4) on a
    # gradient entry; a real mix-up (completions seeing each other, shifted positions)
    # moves them by orders of magnitude more
    for a, b in zip(grads_packed, grads_padded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_a_packed_step_trains_as_the_padded_step(tiny, monkeypatch):
    """One optimizer step of the torch backend on the same batches: the same loss, grad
    norm and counters, and the same weights after it."""
    cfg = OmegaConf.structured(Config)
    cfg.trainer.lr = 1e-3
    one = Ranks(0, 1, 0, None)
    batches = [_batch(seed) for seed in (1, 2)]
    tokens = sum(s.n_sampled() for b in batches for s in b.samples)

    def one_step(packed: bool):
        monkeypatch.setattr(step_module, "packs", lambda model: packed)
        torch.manual_seed(0)
        backend = TorchBackend(cfg, one, tiny, None)
        metrics = train_step(backend, one, batches, 2, batches[0], cfg.trainer, 0, tokens)
        return metrics, dict(backend.model.named_parameters())

    packed, after_packed = one_step(True)
    padded, after_padded = one_step(False)
    assert packed["applied"] and padded["applied"] and packed["tokens"] == padded["tokens"]
    for k in ("loss", "grad_norm", "ratio_mean", "kl", "clip_frac"):
        assert packed[k] == pytest.approx(padded[k], rel=1e-4, abs=1e-6), k
    for name, p in after_packed.items():
        torch.testing.assert_close(p, after_padded[name], rtol=1e-4, atol=1e-6)


def test_a_batch_with_an_empty_prompt_runs_padded(tiny):
    batch = _batch()
    batch.prompt_ids[0] = pack_i32([])
    assert collate(batch, 0, torch.device("cpu")).packed is None
