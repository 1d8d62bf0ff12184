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
from pipeline.packing import packed_logprobs, packs
from pipeline.routing import Replayer
from trainer.collate import MicroBatch, collate
from trainer.loss import STAT_NAMES, k3_sum, policy_loss
from trainer.ranks import Ranks, sum_across

# sampling.keep_routing: counters each micro-batch adds after STAT_NAMES and nonfinite_rows
# (zero without routes), summed over ranks into the route_* and kl_actor_* metrics
ROUTE_STAT_NAMES = (
    "route_pairs_differ",  # valid (token, MoE layer) pairs whose live top-k set differs
    "route_pairs",
    "route_tokens_differ",  # valid tokens with any such layer
    "route_tokens",
    "kl_replayed_sum",  # k3(actor || trainer) over current-version tokens, routes replayed
    "kl_current_tokens",
    "kl_free_sum",  # the same without replay (probe steps only)
    "kl_free_tokens",
)


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
    completions; on the micro-batch's device, differentiable. Computed on the packed
    layout (pipeline/packing.py) where the batch has one and the model's attention takes
    its mask, else on the padded rows."""
    if mb.packed is not None and packs(model):
        return packed_logprobs(
            model,
            mb.packed,
            tuple(mb.comp.shape),
            mb.temperature,
            mb.top_p,
            mb.top_k,
            mb.masks,
            autocast_dtype,
        )
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


def make_loss_fn(
    cfg,
    totals: StepTotals,
    autocast_dtype: torch.dtype | None,
    bad: list,
    replayer: Replayer | None = None,
    version: int | None = None,
    probe: bool = False,
):
    """loss_fn(model, mb) -> (scaled loss tensor, stats in STAT_NAMES order + bad rows +
    ROUTE_STAT_NAMES). Sample ids of rows whose loss is not finite are appended to ``bad``.

    A micro-batch with routes (sampling.keep_routing) runs its loss forward with them
    replayed through ``replayer`` (pipeline/routing.py; the caller closes it after the
    backward, which may recompute the forward); ``probe``: first a no-grad forward with
    live routing, for ``kl_actor_free``. The trainer-vs-actor KL counts the tokens
    sampled at ``version`` only (None: every sampled token), so it measures the engines'
    mismatch, not the policy's change."""
    replayer = replayer or Replayer()

    def loss_fn(model, mb: MicroBatch):
        free_lp = None
        if mb.routes is not None:
            replayer.attach(model)
            if probe:
                replayer.free()
                with torch.no_grad():
                    free_lp = token_logprobs(model, mb, autocast_dtype)
            replayer.use(mb.routes, mb.routes_valid)
        else:  # a batch without routes after one with them routes live
            replayer.free()
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
        stats = (
            parts.stats()
            + [len(parts.bad_rows)]
            + _route_stats(mb, replayer, new_lp, free_lp, version)
        )
        return loss, [v * mb.weight for v in stats]

    return loss_fn


def _route_stats(mb: MicroBatch, replayer: Replayer, new_lp, free_lp, version) -> list[float]:
    """ROUTE_STAT_NAMES of one micro-batch (zeros without routes)."""
    if mb.routes is None:
        return [0.0] * len(ROUTE_STAT_NAMES)
    r = replayer.stats()
    current = mb.comp if version is None else mb.comp & (mb.versions == version)
    n = int(current.sum())
    kl_free = k3_sum(free_lp, mb.actor_lp, current) if free_lp is not None else 0.0
    return [
        r.pairs_differ,
        r.pairs,
        r.tokens_differ,
        r.tokens,
        k3_sum(new_lp.detach(), mb.actor_lp, current),
        n,
        kl_free,
        n if free_lp is not None else 0,
    ]


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
    version: int | None = None,
) -> dict:
    """Train on this rank's share; returns metrics summed over all ranks.
    ``on_micro`` runs before each micro-batch (progress for the watchdog).

    Batches with routes (sampling.keep_routing) train with them replayed and add
    ``route_mismatch`` (share of valid (token, MoE layer) pairs whose live top-k differs
    from the recorded one), ``route_mismatch_tokens`` (share of tokens with any such
    layer), ``kl_actor_replayed`` (k3 KL(actor || trainer) per token sampled at
    ``version``, the weights this step starts from) and, every
    ``trainer.route_probe_every`` versions, ``kl_actor_free`` (the same from a no-grad
    forward with live routing).

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
    every = int(getattr(cfg, "route_probe_every", 0))
    probe = bool(every) and version is not None and version % every == 0
    replayer = Replayer()
    inner = make_loss_fn(cfg, totals, backend.autocast_dtype, bad, replayer, version, probe)

    def loss_fn(model, mb):
        on_micro()
        return inner(model, mb)

    names = STAT_NAMES + ("nonfinite_rows",) + ROUTE_STAT_NAMES
    try:
        grad_norm, stats, applied = backend.step(micro, loss_fn)
    finally:
        replayer.close()
    summed = sum_across(ranks, stats or [0.0] * len(names))
    named = dict(zip(names, summed, strict=True))
    n = totals.tokens
    return _route_metrics(named) | {
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


def _route_metrics(named: dict) -> dict:
    """The Keep Routing metrics of a step whose batches carry routes (else none)."""
    if not named["route_tokens"]:
        return {}
    out = {
        "route_mismatch": named["route_pairs_differ"] / max(named["route_pairs"], 1),
        "route_mismatch_tokens": named["route_tokens_differ"] / named["route_tokens"],
    }
    if named["kl_current_tokens"]:
        out["kl_actor_replayed"] = named["kl_replayed_sum"] / named["kl_current_tokens"]
    if named["kl_free_tokens"]:
        out["kl_actor_free"] = named["kl_free_sum"] / named["kl_free_tokens"]
    return out


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
