"""One optimizer step on this rank's micro-batches: the policy loss of each,
scaled so the step's gradient is the token-mean over every rank's tokens.

The backend owns backward, gradient reduction, clipping and the optimizer;
this module owns what the loss is and the step's metrics (summed over ranks).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.logprobs import masked_logprobs
from pipeline.messages import TrainBatch
from trainer.collate import MicroBatch, collate
from trainer.loss import policy_loss
from trainer.ranks import Ranks, sum_across


def token_logprobs(model, mb: MicroBatch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """[rows, width] log p(ids[t] | ids[:t]) under the sampling transform; 0 outside
    completions; on the micro-batch's device, differentiable."""
    device_type = mb.ids.device.type
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits = model(input_ids=mb.ids, attention_mask=mb.attn).logits[:, :-1, :]
    logp = masked_logprobs(logits, mb.temperature, mb.top_p, mb.top_k, mb.masks, mb.comp[:, 1:])
    token_lp = logp.gather(-1, mb.ids[:, 1:, None]).squeeze(-1)
    return F.pad(token_lp, (1, 0)).masked_fill(~mb.comp, 0.0)


def make_loss_fn(cfg, total_tokens: int, autocast_dtype: torch.dtype | None):
    """loss_fn(model, mb) -> (scaled loss tensor, [loss, clipped, ratio_sum, kl_sum])."""

    def loss_fn(model, mb: MicroBatch):
        new_lp = token_logprobs(model, mb, autocast_dtype)
        parts = policy_loss(
            new_lp,
            mb.actor_lp,
            mb.advantages,
            mb.comp,
            cfg.clip_low,
            cfg.clip_high,
            cfg.is_cap,
            mb.ref_lp,
            cfg.kl_coef,
        )
        loss = parts.loss * (mb.weight / total_tokens)
        stats = [float(loss.detach()), parts.clipped, parts.ratio_sum, parts.kl_sum]
        return loss, [v * mb.weight for v in stats]

    return loss_fn


def padded(mine: list[TrainBatch], slots: int, all_first: TrainBatch) -> list[tuple]:
    """(batch, weight) pairs: this rank's batches, then weight-0 passes up to ``slots``,
    so every rank runs as many forward/backward passes (ZeRO-3 gathers in forward)."""
    filler = mine[0] if mine else all_first
    return [(b, 1.0) for b in mine] + [(filler, 0.0)] * (slots - len(mine))


def train_step(
    backend,
    ranks: Ranks,
    mine,
    slots: int,
    first,
    cfg,
    pad_id: int,
    total_tokens: int,
    on_micro=lambda: None,
) -> dict:
    """Train on this rank's share; returns metrics summed over all ranks.
    ``on_micro`` runs before each micro-batch (progress for the watchdog)."""
    micro = []
    for batch, weight in padded(mine, slots, first):
        mb = collate(batch, pad_id, backend.device)
        mb.weight = weight
        micro.append(mb)
    inner = make_loss_fn(cfg, total_tokens, backend.autocast_dtype)

    def loss_fn(model, mb):
        on_micro()
        return inner(model, mb)

    grad_norm, stats = backend.step(micro, loss_fn)
    loss, clipped, ratio_sum, kl_sum = sum_across(ranks, stats)
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "tokens": total_tokens,
        "clip_frac": clipped / total_tokens,
        "ratio_mean": ratio_sum / total_tokens,
        "kl": kl_sum / total_tokens,
    }


def sample_metrics(batches: list[TrainBatch]) -> dict:
    """Metrics about the step's samples (rank 0 holds every batch)."""
    samples = [s for b in batches for s in b.samples]
    versions = [s.token_versions() for s in samples]
    return {
        "samples": len(samples),
        "reward_mean": float(np.mean([s.reward for s in samples])),
        "spanning": sum(int(v.min() != v.max()) for v in versions),
        "oldest_version": int(min(v.min() for v in versions)),
        "groups": sorted({g for b in batches for g in b.group_ids}),
    }
