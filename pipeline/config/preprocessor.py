"""``preprocessor``: the preprocessor pool and the scorers it runs on every rollout
group (preprocessor/scorers.py): ``reference`` (``preprocessor.reference``), ``prm``
(``preprocessor.prm``) and ``teacher`` (``preprocessor.teacher``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.config.checks import check_pool_device, check_positive

SCORERS = ("reference", "prm", "teacher")  # names allowed in preprocessor.scorers
PRM_KINDS = ("arithmetic", "model")


@dataclass
class PRMConfig:
    """Step-level process rewards (scorer ``prm``)."""

    kind: str = "arithmetic"  # arithmetic: check each equation a step states; model: an HF LM
    weight: float = 0.5  # token advantage = (1 - weight) * outcome + weight * step advantage
    delimiter: str = "line"  # step boundary: "line" (line breaks) or a literal string
    model: str = ""  # kind=model: a local folder, "tiny", or a hub id
    step_tag: str = "\n"  # kind=model: appended after each step; the PRM is read at its end
    good_token: str = "+"  # kind=model: step score p(good) / (p(good) + p(bad)) at the tag
    bad_token: str = "-"


@dataclass
class ReferenceConfig:
    """The frozen initial policy's log-probs (scorer ``reference``)."""

    # MoE with sampling.keep_routing: route the reference's forward to the experts the
    # actor recorded. Off by default: the reference then routes on its own router, as the
    # initial policy would; replaying the current policy's routes biases the KL toward it
    replay_routes: bool = False


@dataclass
class TeacherConfig:
    """On-policy distillation (scorer ``teacher``): reward_t = teacher_lp_t - student_lp_t."""

    model: str = ""  # a local folder, "tiny-teacher", or a hub id; the student's tokenizer
    weight: float = 1.0  # token advantage = (1 - weight) * outcome + weight * teacher reward


@dataclass
class PreprocessorConfig:
    num_workers: int = 1
    # scorers run on every rollout group: reference (log-probs of the frozen initial
    # model, for the KL term and the trainer's `kl` metric), prm (step rewards), teacher
    # (distillation rewards). Default none: reference is added (preprocessor/scorers.py)
    # only when trainer.kl_coef > 0; list it to get the `kl` metric with kl_coef=0
    scorers: list[str] = field(default_factory=list)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    prm: PRMConfig = field(default_factory=PRMConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    drop_no_signal: bool = True
    token_budget: int = 2048  # padded tokens per micro-batch
    read_count: int = 4
    torch_threads: int = 1
    device: str = "cpu"  # cpu, cuda, cuda:N (reference, PRM and teacher models)
    dtype: str = ""  # float32 | bfloat16; empty: model.dtype


def validate_preprocessor(cfg: Any) -> None:
    """The ``preprocessor`` section: workers, budget, device, scorers."""
    check_positive(cfg, "preprocessor.num_workers", "preprocessor.token_budget")
    validate_scorers(cfg.preprocessor)
    check_pool_device(cfg, "preprocessor")
    replay = cfg.preprocessor.reference.replay_routes
    if not isinstance(replay, bool):
        raise ValueError(f"preprocessor.reference.replay_routes={replay!r} must be true or false")
    if replay and not cfg.sampling.keep_routing:
        raise ValueError(
            "preprocessor.reference.replay_routes=true replays the routes the actors record "
            "with sampling.keep_routing=true, which is off: turn it on or set "
            "preprocessor.reference.replay_routes=false"
        )


def validate_scorers(pre: Any) -> None:
    """preprocessor.scorers and the settings of the scorers it names."""
    names = list(pre.scorers)
    for name in names:
        if name not in SCORERS:
            raise ValueError(
                f"preprocessor.scorers names an unknown scorer {name!r}; "
                f"allowed: {', '.join(SCORERS)} (e.g. preprocessor.scorers=[reference,prm])"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"preprocessor.scorers={names} lists a scorer twice; name each once")
    if "prm" in names:
        if pre.prm.kind not in PRM_KINDS:
            raise ValueError(f"preprocessor.prm.kind={pre.prm.kind!r}; use one of {PRM_KINDS}")
        if pre.prm.kind == "model" and not pre.prm.model:
            raise ValueError("preprocessor.prm.kind=model needs preprocessor.prm.model=FOLDER|ID")
        if not pre.prm.delimiter:
            raise ValueError('preprocessor.prm.delimiter is empty; use "line" or a string')
    if "teacher" in names and not pre.teacher.model:
        raise ValueError(
            "preprocessor.scorers has teacher but preprocessor.teacher.model is empty; "
            "set it to a model folder, a hub id or tiny-teacher"
        )
    dense = {"prm": pre.prm.weight, "teacher": pre.teacher.weight}
    for name, w in dense.items():
        if not 0 <= w <= 1:
            raise ValueError(f"preprocessor.{name}.weight={w} must lie in [0, 1]")
    total = sum(w for name, w in dense.items() if name in names)
    if total > 1 + 1e-9:
        raise ValueError(
            f"preprocessor.prm.weight + preprocessor.teacher.weight = {total:g} > 1; "
            "the outcome advantage gets 1 minus their sum, so lower them"
        )
