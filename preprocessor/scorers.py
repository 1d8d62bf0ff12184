"""The scorers ``preprocessor.scorers`` names, and how they are built.

::

    reference  reads the rollout's tokens; writes Sample.ref_logprobs from a frozen copy
               of the initial policy (at the rollout's temperature, never truncated);
               with MoE routes (sampling.keep_routing) it routes on its own unless
               preprocessor.reference.replay_routes replays the actor's routes
    prm        reads the completion text; writes ScoredGroup.dense["prm"], per-token
               process advantages from step rewards (preprocessor/prm.py)
    teacher    reads the rollout's tokens and the actor's log-probs; writes
               ScoredGroup.dense["teacher"] = teacher_lp - student_lp per token (the
               negative log-ratio: its expectation is minus the reverse KL)

Each process of the preprocessor pool builds its own scorers; the rollouts
stream's consumer group shares the groups among the processes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from pipeline.config import SCORERS, pool_dtype, validate_scorers
from pipeline.messages import unpack_f32
from pipeline.models import load_model, materialize_model
from pipeline.runtime import model_path
from preprocessor.prm import ArithmeticPRM, ModelPRM
from preprocessor.scoring import ScoredGroup, Scorer, group_logprobs, replayed_logprobs

log = logging.getLogger("preprocessor")

__all__ = ["ReferenceScorer", "TeacherScorer", "build_scorers", "Scorer", "ScoredGroup"]


def pad_id_of(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


class ReferenceScorer:
    """Log-probs of the frozen initial policy, for the trainer's KL term (and its ``kl``
    metric). Taken at the rollout's temperature without top-k/top-p, as the teacher's:
    the reference's own truncation would give -inf to tokens outside its support, and an
    infinite KL."""

    name, dense, weight = "reference", False, 0.0

    def __init__(self, model, pad_id: int, budget: int, replay_routes: bool = False):
        self.model, self.pad_id, self.budget = model, pad_id, budget
        # MoE: route each token as the actor did (its recorded routes) instead of on the
        # reference's own router; off by default, since the policy's routes bias the KL
        self.replay_routes = replay_routes

    def score(self, items: list[ScoredGroup]) -> dict[str, float]:
        groups = [it.group for it in items]
        routed = [g for g in groups if self.replay_routes and g.route_layout]
        plain = [g for g in groups if not (self.replay_routes and g.route_layout)]
        own = group_logprobs(self.model, plain, self.budget, self.pad_id, truncate=False)
        scored = list(zip(plain, own, strict=True))
        if routed:
            replayed = replayed_logprobs(self.model, routed, self.budget, self.pad_id)
            scored += zip(routed, replayed, strict=True)
        for g, lps in scored:
            for sample, lp in zip(g.samples, lps, strict=True):
                sample.ref_logprobs = lp.astype("<f4").tobytes()
        counts = {"reference_scored_groups": len(items)}
        if routed:
            counts["reference_replayed_groups"] = len(routed)
        return counts


class TeacherScorer:
    """On-policy distillation: per-token reward teacher_lp - student_lp on the sampled tokens.

    The student's log-prob is the one the actor recorded (the distribution it sampled
    from); the teacher's is taken at the rollout's temperature without top-k/top-p, so
    both sides see the same transformation and the teacher never assigns -inf.
    """

    name, dense = "teacher", True

    def __init__(self, model, pad_id: int, budget: int, weight: float):
        self.model, self.pad_id, self.budget, self.weight = model, pad_id, budget, weight

    def rewards(self, items: list[ScoredGroup]) -> list[list[np.ndarray]]:
        groups = [it.group for it in items]
        teacher = group_logprobs(self.model, groups, self.budget, self.pad_id, truncate=False)
        return [
            [t - unpack_f32(s.logprobs) for s, t in zip(g.samples, lps, strict=True)]
            for g, lps in zip(groups, teacher, strict=True)
        ]

    def score(self, items: list[ScoredGroup]) -> dict[str, float]:
        """Counters: groups, tokens, and the summed log-ratio student - teacher
        (divided by the tokens: a Monte Carlo estimate of the reverse KL per token)."""
        tokens, kl_sum = 0, 0.0
        for it, rewards in zip(items, self.rewards(items), strict=True):
            it.dense[self.name] = [r.astype(np.float32) for r in rewards]
            tokens += sum(len(r) for r in rewards)
            kl_sum -= float(sum(r.sum() for r in rewards))
        return {
            "teacher_scored_groups": len(items),
            "teacher_tokens": tokens,
            "teacher_kl_sum": round(kl_sum, 4),
        }


# ---------------------------------------------------------------- building


def _same_vocabulary(student_tok, teacher_tok) -> bool:
    return len(student_tok) == len(teacher_tok) and student_tok.get_vocab() == (
        teacher_tok.get_vocab()
    )


def _placement(cfg: Any) -> tuple[str, str]:
    """(dtype, device) of the preprocessor's models."""
    return pool_dtype(cfg, "preprocessor"), cfg.preprocessor.device


def _reference(cfg: Any, ctx: dict) -> Scorer:
    # the base model folder: with model.lora that is exactly the model the adapter is
    # applied to, without the adapter (this process never holds one: one copy of the base)
    model, tokenizer = load_model(ctx["policy_path"], *_placement(cfg))
    pre = cfg.preprocessor
    return ReferenceScorer(
        model, pad_id_of(tokenizer), pre.token_budget, pre.reference.replay_routes
    )


def _prm(cfg: Any, ctx: dict) -> Scorer:
    pre = cfg.preprocessor
    if pre.prm.kind == "arithmetic":
        return ArithmeticPRM(ctx["tokenizer"](), pre.prm.delimiter, pre.prm.weight)
    model, tokenizer = load_model(materialize_model(pre.prm.model), *_placement(cfg))
    return ModelPRM(ctx["tokenizer"](), model, tokenizer, pre.prm, pre.token_budget)


def _teacher(cfg: Any, ctx: dict) -> Scorer:
    pre = cfg.preprocessor
    model, teacher_tok = load_model(materialize_model(pre.teacher.model), *_placement(cfg))
    student_tok = ctx["tokenizer"]()
    if not _same_vocabulary(student_tok, teacher_tok):
        raise ValueError(
            f"preprocessor.teacher.model={pre.teacher.model!r} has another vocabulary than "
            f"the student {cfg.model.name!r}; the teacher scores the student's token ids, "
            "so pick a teacher with the same tokenizer"
        )
    return TeacherScorer(model, pad_id_of(student_tok), pre.token_budget, pre.teacher.weight)


def effective_scorers(cfg: Any) -> list[str]:
    """The scorers a preprocessor runs: ``preprocessor.scorers``, plus ``reference``
    first when ``trainer.kl_coef > 0`` needs it (the KL term uses its log-probs)."""
    names = list(cfg.preprocessor.scorers)
    if cfg.trainer.kl_coef > 0 and "reference" not in names:
        names.insert(0, "reference")
    return names


BUILDERS: dict[str, Callable[[Any, dict], Scorer]] = {
    "reference": _reference,
    "prm": _prm,
    "teacher": _teacher,
}
assert tuple(BUILDERS) == SCORERS, "every allowed scorer name has a builder"


def build_scorers(cfg: Any, policy_path: str | None = None) -> list[Scorer]:
    """The scorers of ``cfg.preprocessor.scorers``, in the order listed, with
    ``reference`` first when ``trainer.kl_coef > 0`` needs it and it is not listed.

    Raises ValueError naming ``preprocessor.scorers`` (and the allowed names) for an
    unknown scorer, or the offending key for a scorer's bad settings.
    """
    validate_scorers(cfg.preprocessor)
    from transformers import AutoTokenizer

    path = policy_path or model_path(cfg)
    cache: dict[str, Any] = {}

    def tokenizer():
        if "tok" not in cache:
            cache["tok"] = AutoTokenizer.from_pretrained(path)
        return cache["tok"]

    ctx = {"policy_path": path, "tokenizer": tokenizer}
    names = effective_scorers(cfg)
    if names != list(cfg.preprocessor.scorers):
        log.info(
            "trainer.kl_coef=%g needs reference log-probs: scorers %s", cfg.trainer.kl_coef, names
        )
    return [BUILDERS[name](cfg, ctx) for name in names]
