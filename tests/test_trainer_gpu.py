"""The trainer on a CUDA device (``pytest -m gpu`` / ``make test-gpu``); skipped,
with the reason, where there is no CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipeline.config import Config
from pipeline.models import materialize_model
from tests.trainer_ranks import synthetic_batches
from trainer.collate import collate
from trainer.ranks import Ranks
from trainer.step import train_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return materialize_model("tiny", str(tmp_path_factory.mktemp("m")))


def _cfg(backend: str, dtype: str, stage: int = 0):
    cfg = OmegaConf.structured(Config)
    t = cfg.trainer
    t.backend, t.zero_stage, t.device, t.dtype, t.lr = backend, stage, "cuda:0", dtype, 1e-3
    return cfg


def _steps(backend, cfg, n: int = 3) -> list[float]:
    one, losses = Ranks(0, 1, 0, None), []
    for step in range(n):
        bs = synthetic_batches(step)
        tokens = sum(len(s.tokens()) for b in bs for s in b.samples)
        m = train_step(backend, one, bs, len(bs), bs[0], cfg.trainer, 0, tokens)
        losses.append(m["loss"])
    return losses


def test_collation_lands_on_the_device(tiny):
    mb = collate(synthetic_batches(0)[0], 0, torch.device("cuda:0"))
    for t in (mb.ids, mb.attn, mb.comp, mb.actor_lp, mb.advantages):
        assert t.device.type == "cuda"


def test_torch_backend_bf16_keeps_fp32_master_weights_on_cuda(tiny):
    from trainer.backends.torch_backend import TorchBackend

    cfg = _cfg("torch", "bfloat16")
    backend = TorchBackend(cfg, Ranks(0, 1, 0, None), tiny, None)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    losses = _steps(backend, cfg)
    assert np.isfinite(losses).all() and len(set(losses)) == len(losses)
    for n, p in backend.model.named_parameters():
        assert p.dtype == torch.float32 and p.device.type == "cuda", n
    assert any(not torch.equal(before[n], p) for n, p in backend.model.named_parameters())
    published = backend.full_parameters()
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cuda" for t in published.values())


def test_deepspeed_zero2_bf16_on_one_gpu_tracks_the_torch_backend(tiny, monkeypatch):
    pytest.importorskip("deepspeed")
    from trainer.backends.deepspeed_backend import DeepSpeedBackend
    from trainer.backends.torch_backend import TorchBackend
    from trainer.ranks import init_ranks

    monkeypatch.setenv("WORLD_SIZE", "1")
    ranks = init_ranks(1, "cuda:0", 120.0, need_dist=True)
    ds = DeepSpeedBackend(_cfg("deepspeed", "bfloat16", 2), ranks, tiny, None)
    ds_losses = _steps(ds, _cfg("deepspeed", "bfloat16", 2))
    ref = TorchBackend(_cfg("torch", "bfloat16"), Ranks(0, 1, 0, None), tiny, None)
    ref_losses = _steps(ref, _cfg("torch", "bfloat16"))
    # bf16 compute on both sides, summed in other orders: agree to bf16 precision
    assert ds_losses == pytest.approx(ref_losses, rel=3e-2, abs=1e-3)
    assert ds.engine.bfloat16_enabled()
