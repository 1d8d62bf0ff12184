"""The policy loss: PPO-style clipping against the actor's recorded log-probs,
dual-clip truncation of the importance weight, optional k3 KL to the reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossParts:
    loss: torch.Tensor  # summed over tokens; the caller divides by the step's token count
    tokens: int
    clipped: int
    ratio_sum: float
    kl_sum: float


def policy_loss(
    new_lp: torch.Tensor,
    actor_lp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    is_cap: float,
    ref_lp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossParts:
    """All tensors are [batch, tokens]; ``advantages`` is per token; ``mask`` bool.

    ratio r = pi/mu with mu the policy the actor sampled from (possibly several
    versions in one sequence). Surrogate: min(r A, clip(r, 1-lo, 1+hi) A); for
    A < 0 it is bounded below by is_cap * A, so a stale token with a huge ratio
    cannot dominate the step.
    """
    log_ratio = (new_lp - actor_lp).masked_fill(~mask, 0.0)
    ratio = torch.exp(log_ratio)
    surr = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)
    surr = torch.where(advantages < 0, torch.maximum(surr, is_cap * advantages), surr)
    per_token = -surr
    kl_sum = 0.0
    if ref_lp is not None and kl_coef > 0:
        d = (ref_lp - new_lp).masked_fill(~mask, 0.0)
        kl = torch.exp(d) - d - 1  # k3 estimator of KL(pi || ref), >= 0
        per_token = per_token + kl_coef * kl
        kl_sum = float(kl.detach()[mask].sum())
    clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)) & mask
    return LossParts(
        loss=per_token[mask].sum(),
        tokens=int(mask.sum()),
        clipped=int(clipped.sum()),
        ratio_sum=float(ratio.detach()[mask].sum()),
        kl_sum=kl_sum,
    )
