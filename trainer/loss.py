"""The policy loss of one micro-batch, per token, and the settings that choose it.

::

    reads   the trainer's log-probs (differentiable), the actor's recorded log-probs,
            per-token advantages, the loss mask, reference log-probs (when scored)
    writes  the loss (summed with per-token aggregation weights) and its counters

The family (``trainer.*``; the default first, README "The objective"):

    off_policy=behaviour_clip  PPO clip of r = pi/mu against the sampling policy mu,
                               dual clip: for A < 0 the surrogate is bounded by is_cap * A
                               (past it the gradient is 0), Ye et al. 2020 / verl
    off_policy=truncated_is    decoupled PPO with the proximal policy = the current one
                               (one optimizer step per batch): -min(r, is_cap) A log pi,
                               the weight detached (Hilton et al. 2022; TRL token_truncate)
    kl_estimator=k3            k3 = e^d - d - 1, d = ref - pi (Schulman 2020); its gradient
                               is that of KL(ref || pi) (Tang & Munos 2025)
    kl_estimator=k3_ratio      r * k3 with r = pi/mu not detached: an unbiased gradient of
                               KL(pi || ref) from samples of mu (Tang & Munos 2025, TRL)

Nothing non-finite leaves here for finite inputs: the log-ratio is clamped to
+-LOG_RATIO_CLAMP before the exponential, d to the same range and k3 to at most
KL_CLAMP (verl's bounds); a trainer log-prob of -inf (a token outside the top-p/top-k
support the trainer recomputes) gives the clamped values and a zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.config.trainer import KL_ESTIMATORS, OFF_POLICY

LOG_RATIO_CLAMP = 20.0
KL_CLAMP = 10.0
STAT_NAMES = ("loss", "clipped", "dual_clipped", "ratio_out", "ratio_sum", "kl_sum")


@dataclass
class LossParts:
    loss: torch.Tensor  # sum over tokens of per-token loss x aggregation weight
    tokens: int
    clipped: int  # tokens whose PPO clip removed the gradient (A > 0 above, A < 0 below)
    dual_clipped: int  # A < 0 tokens past is_cap (dual clip binding; truncated_is: capped)
    ratio_out: int  # tokens whose ratio lies outside [1 - clip_low, 1 + clip_high]
    ratio_sum: float
    kl_sum: float  # k3 summed over tokens when reference log-probs are present
    bad_rows: list[int]  # rows whose loss is not finite (the step is not applied)

    def stats(self) -> list[float]:
        """The counters in STAT_NAMES order (loss as the weighted sum)."""
        return [
            float(self.loss.detach()),
            self.clipped,
            self.dual_clipped,
            self.ratio_out,
            self.ratio_sum,
            self.kl_sum,
        ]


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
    off_policy: str = "behaviour_clip",
    kl_estimator: str = "k3",
    weights: torch.Tensor | None = None,
) -> LossParts:
    """All tensors are [batch, tokens]; ``advantages`` per token; ``mask`` bool (the
    tokens the loss covers); ``weights`` the aggregation weight of each token (None: 1,
    a plain sum). The k3 term is computed whenever ``ref_lp`` is given (the ``kl``
    metric) and added to the loss only when ``kl_coef > 0``."""
    # a log-prob of -inf (outside the recomputed support) counts as very unlikely, with no
    # gradient through it: the clamp passes none below its bound
    new_lp = new_lp.clamp(min=-1e4)
    log_ratio = (new_lp - actor_lp).masked_fill(~mask, 0.0)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    neg = advantages < 0
    if off_policy == "behaviour_clip":
        clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
        surr = torch.minimum(ratio * advantages, clipped_ratio * advantages)
        surr = torch.where(neg, torch.maximum(surr, is_cap * advantages), surr)
        clipped = ((ratio > 1 + clip_high) & (advantages > 0)) | ((ratio < 1 - clip_low) & neg)
        dual = neg & (ratio > is_cap)
    elif off_policy == "truncated_is":
        weight = ratio.detach().clamp(max=is_cap)
        surr = weight * torch.exp(new_lp - new_lp.detach()).masked_fill(~mask, 1.0) * advantages
        clipped = torch.zeros_like(mask)
        dual = ratio.detach() > is_cap  # the weight was capped (either sign)
    else:
        raise ValueError(f"trainer.off_policy={off_policy!r}: one of {OFF_POLICY}")
    per_token = -surr
    kl_sum = 0.0
    if ref_lp is not None:
        d = (ref_lp - new_lp).masked_fill(~mask, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = (torch.exp(d) - d - 1).clamp(max=KL_CLAMP)  # k3, >= 0
        kl_sum = float(kl.detach()[mask].sum())
        if kl_coef > 0:
            if kl_estimator == "k3_ratio":
                kl = ratio * kl
            elif kl_estimator != "k3":
                raise ValueError(f"trainer.kl_estimator={kl_estimator!r}: one of {KL_ESTIMATORS}")
            per_token = per_token + kl_coef * kl
    if weights is not None:
        per_token = per_token * weights
    per_token = per_token.masked_fill(~mask, 0.0)
    finite = torch.isfinite(per_token.detach()).all(dim=-1)
    return LossParts(
        loss=per_token[mask].sum(),
        tokens=int(mask.sum()),
        clipped=int((clipped & mask).sum()),
        dual_clipped=int((dual & mask).sum()),
        ratio_out=int((((ratio < 1 - clip_low) | (ratio > 1 + clip_high)) & mask).sum()),
        ratio_sum=float(ratio.detach()[mask].sum()),
        kl_sum=kl_sum,
        bad_rows=[int(i) for i in torch.nonzero(~finite).flatten()],
    )


def k3_sum(new_lp: torch.Tensor, actor_lp: torch.Tensor, mask: torch.Tensor) -> float:
    """Summed k3 estimate of KL(actor || trainer) from the actor's samples over ``mask``:
    k3 = e^d - d - 1, d = new - actor, clamped as the loss is (no gradient)."""
    d = (new_lp.detach().clamp(min=-1e4) - actor_lp).masked_fill(~mask, 0.0)
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return float((torch.exp(d) - d - 1).clamp(max=KL_CLAMP)[mask].sum())
