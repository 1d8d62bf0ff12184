"""One optimizer step on this rank's micro-batches: the policy loss of each,
scaled so the step's gradient is the token-mean over every rank's tokens.

The backend owns backward, gradient reduction, clipping and the optimizer;
this module owns what the loss is and the step's metrics (summed over ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.logprobs import completion_logprobs
from pipeline.messages import TrainBatch
from trainer.collate import MicroBatch, collate
from trainer.loss import STAT_NAMES, policy_loss
from trainer.ranks import Ranks, sum_across


@dataclass
class StepTotals:
    """What the step's loss is divided by, over every rank's share."""

    tokens: int  # loss-mask tokens
    samples: int = 0  # sequences (seq_mean_token_mean, constant)
    divisor: int = 0  # tokens per sequence for loss_aggregation=constant (max_new_tokens)


def constant_divisor(cfg) -> int:
    """Sampled tokens per sequence for ``loss_aggregation=constant``: the generation
    budget, ``sampling.max_new_tokens``; for multi-turn episodes (task.kind=env) every
    turn's, bounded by the episode's token budget."""
    per_turn = int(cfg.sampling.max_new_tokens)
    if cfg.task.kind != "env":
        return per_turn
    episode = cfg.task.episode
    return min(per_turn * int(episode.max_turns), int(episode.max_tokens))


def token_logprobs(model, mb: MicroBatch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """[rows, width] log p(ids[t] | ids[:t]) under the sampling transform; 0 outside
    completions; on the micro-batch's device, differentiable."""
    return completion_logprobs(
        model,
        mb.ids,
        mb.attn,
        mb.comp,
        mb.temperature,
        mb.top_p,
        mb.top_k,
        mb.masks,
        autocast_dtype,
    )


def aggregation_weights(cfg, mb: MicroBatch, totals: StepTotals) -> torch.Tensor:
    """[rows, 1] weight of each token of ``mb`` in the step's loss (trainer.loss_aggregation):
    token_mean 1 / the step's tokens; seq_mean_token_mean 1 / (samples x the row's tokens);
    constant 1 / (samples x sampling.max_new_tokens) (Dr. GRPO). Over every rank."""
    how = cfg.loss_aggregation
    rows = mb.comp.shape[0]
    if how == "token_mean":
        return torch.full((rows, 1), 1.0 / totals.tokens, device=mb.comp.device)
    if how == "seq_mean_token_mean":
        per_row = mb.comp.sum(dim=1, keepdim=True).clamp(min=1).float()
        return 1.0 / (totals.samples * per_row)
    if how == "constant":
        return torch.full((rows, 1), 1.0 / (totals.samples * totals.divisor), device=mb.comp.device)
    raise ValueError(f"trainer.loss_aggregation={how!r} is not supported")


def make_loss_fn(cfg, totals: StepTotals, autocast_dtype: torch.dtype | None, bad: list):
    """loss_fn(model, mb) -> (scaled loss tensor, stats in STAT_NAMES order + bad rows).
    Sample ids of rows whose loss is not finite are appended to ``bad``."""

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
            off_policy=cfg.off_policy,
            kl_estimator=cfg.kl_estimator,
            weights=aggregation_weights(cfg, mb, totals),
        )
        if mb.weight:
            bad.extend(mb.sample_ids[i] for i in parts.bad_rows)
        loss = parts.loss * mb.weight
        stats = parts.stats() + [len(parts.bad_rows)]
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
    totals: StepTotals | int,
    on_micro=lambda: None,
) -> dict:
    """Train on this rank's share; returns metrics summed over all ranks.
    ``on_micro`` runs before each micro-batch (progress for the watchdog).

    A step whose loss or gradient is not finite on any rank is not applied (the
    backend leaves weights and optimizer state as they were): ``applied`` is False and
    ``nonfinite_sample_ids`` names this rank's offending samples (empty where only the
    gradient was not finite)."""
    if isinstance(totals, int):  # token count alone: token_mean needs nothing else
        totals = StepTotals(tokens=totals, samples=sum(len(b.samples) for b in mine))
    micro = []
    for batch, weight in padded(mine, slots, first):
        mb = collate(batch, pad_id, backend.device)
        mb.weight = weight
        micro.append(mb)
    bad: list[str] = []
    inner = make_loss_fn(cfg, totals, backend.autocast_dtype, bad)

    def loss_fn(model, mb):
        on_micro()
        return inner(model, mb)

    grad_norm, stats, applied = backend.step(micro, loss_fn)
    summed = sum_across(ranks, stats or [0.0] * (len(STAT_NAMES) + 1))
    named = dict(zip(STAT_NAMES + ("nonfinite_rows",), summed, strict=True))
    n = totals.tokens
    return {
        "loss": named["loss"],
        "grad_norm": grad_norm,
        "tokens": n,
        "clip_frac": named["clipped"] / n,
        "dual_clip_frac": named["dual_clipped"] / n,
        "ratio_out_frac": named["ratio_out"] / n,
        "ratio_mean": named["ratio_sum"] / n,
        "kl": named["kl_sum"] / n,
        "applied": applied,
        "nonfinite_sample_ids": bad,
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
