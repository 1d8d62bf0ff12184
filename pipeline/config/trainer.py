"""``trainer``: the trainer pool - its backend, ranks, optimisation, the off-policy
guards (clipping, importance cap, lag), checkpoints and the weight publishing cadence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.config.checks import check_choice, check_pool_device, check_positive

ADVANTAGE_STD = ("group", "none")
LOSS_AGGREGATION = ("token_mean", "seq_mean_token_mean", "constant")
OFF_POLICY = ("behaviour_clip", "truncated_is")
KL_ESTIMATORS = ("k3", "k3_ratio")


@dataclass
class TrainerConfig:
    backend: str = "torch"  # torch | deepspeed
    max_steps: int = 20
    samples_per_step: int = 16
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_low: float = 0.2  # PPO clip below 1 (0 <= clip_low < 1)
    clip_high: float = 0.28  # PPO clip above 1 (>= 0)
    # dual clip: for A < 0 the surrogate is bounded by is_cap * A, so past ratio is_cap the
    # token's gradient is 0 (> 1 + clip_high); with off_policy=truncated_is, the cap C
    # of the detached importance weight min(pi/mu, C)
    is_cap: float = 2.0
    kl_coef: float = 0.0  # weight of the KL term (needs reference log-probs; 0: metric only)
    # the objective's family (README "The objective"); the defaults are GRPO/DAPO's
    advantage_std: str = "group"  # group: (r - mean) / std | none: r - mean (Dr. GRPO)
    loss_aggregation: str = "token_mean"  # token_mean | seq_mean_token_mean | constant
    off_policy: str = "behaviour_clip"  # behaviour_clip | truncated_is
    kl_estimator: str = "k3"  # k3 | k3_ratio
    max_lag: int = 4  # reject samples whose oldest token is older than this
    publish_every: int = 1
    checkpoint_every: int = 10
    resume: bool = True
    bucket_mb: float = 64.0
    transfer_timeout_s: float = 60.0
    transfer_host: str = "127.0.0.1"  # address actors reach the trainer's transfer store on
    keep_checkpoints: int = 2
    # torch threads: a number, or auto: the CPUs it may use less what the other pools on
    # its host keep busy now, set before every micro-batch (trainer/cores.py)
    torch_threads: int | str = 1
    world_size: int = 1  # ranks (processes) of the trainer; rank 0 reads, publishes, reports
    zero_stage: int = 0  # backend=deepspeed: ZeRO stage 0-3
    # backend=deepspeed, zero_stage=3, a MoE model: expert-parallel size of DeepSpeed AutoEP
    # (each rank holds experts/N of every MoE layer's experts); 1: off. trainer/README.md
    expert_parallel: int = 1
    device: str = "cpu"  # cpu, cuda (cuda:<local rank> per rank), cuda:N (one rank)
    # float32 | bfloat16 (fp32 master weights and optimizer, bf16 compute); empty: model.dtype
    dtype: str = ""
    collective_timeout_s: float = 300.0  # deadline of every collective between the ranks
    # sampling.keep_routing: every this many versions one no-grad forward per micro-batch
    # with live routing (no replay) gives the `kl_actor_free` metric beside
    # `kl_actor_replayed`; 0: never
    route_probe_every: int = 10


def validate_trainer(cfg: Any) -> None:
    """The ``trainer`` section: backend, sizes, lag, device and ranks."""
    check_choice(cfg, "trainer.backend", ("torch", "deepspeed"))
    check_choice(cfg, "trainer.zero_stage", (0, 1, 2, 3))
    check_positive(
        cfg,
        "trainer.max_steps",
        "trainer.samples_per_step",
        "trainer.publish_every",
        "trainer.checkpoint_every",
        "trainer.bucket_mb",
    )
    t = cfg.trainer
    validate_objective(cfg)
    threads = t.torch_threads
    if threads != "auto" and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ValueError(
            f"trainer.torch_threads={threads!r} must be a whole number >= 1 or auto (the CPUs "
            "it may use less what the other pools on its host keep busy: trainer/cores.py)"
        )
    if t.max_lag < 0:
        raise ValueError(f"trainer.max_lag={t.max_lag} must be >= 0")
    if isinstance(t.route_probe_every, bool) or not isinstance(t.route_probe_every, int):
        raise ValueError(
            f"trainer.route_probe_every={t.route_probe_every!r} must be a whole number of steps"
        )
    if t.route_probe_every < 0:
        raise ValueError(
            f"trainer.route_probe_every={t.route_probe_every} must be >= 0 (0: no probe "
            "forward without replayed routes)"
        )
    check_pool_device(cfg, "trainer")
    if t.world_size < 1:
        raise ValueError(f"trainer.world_size={t.world_size} must be >= 1")
    if t.world_size > 1 and t.device.startswith("cuda:"):
        raise ValueError(
            f"trainer.device={t.device} names one GPU but trainer.world_size="
            f"{t.world_size}; use trainer.device=cuda (each rank takes cuda:<local rank>)"
        )
    if t.backend == "torch" and t.zero_stage:
        raise ValueError(
            "trainer.zero_stage is a DeepSpeed setting; use trainer.backend=deepspeed with it"
        )
    validate_expert_parallel(t)
    sampling = cfg.get("sampling") if hasattr(cfg, "get") else None
    if t.expert_parallel > 1 and sampling is not None and sampling.get("keep_routing"):
        raise ValueError(
            f"sampling.keep_routing=true with trainer.expert_parallel={t.expert_parallel}: "
            "the training step replays routes through transformers' routers, which AutoEP "
            "replaces (its own router takes forced routes, pipeline/routing.py "
            "force_autoep_routes, but the step does not call it yet); use "
            "trainer.expert_parallel=1 with keep_routing, or keep_routing=false"
        )


def validate_expert_parallel(t: Any) -> None:
    """``trainer.expert_parallel``: DeepSpeed AutoEP needs ZeRO-3 and whole groups of ranks
    (the model's side - a supported MoE, experts divisible - is checked when it loads)."""
    ep = t.expert_parallel
    if ep < 1:
        raise ValueError(f"trainer.expert_parallel={ep} must be >= 1 (1: off)")
    if ep == 1:
        return
    if t.backend != "deepspeed" or t.zero_stage != 3:
        raise ValueError(
            f"trainer.expert_parallel={ep} is DeepSpeed AutoEP, which this trainer runs under "
            f"ZeRO-3 only (trainer.backend={t.backend}, trainer.zero_stage={t.zero_stage}): set "
            "trainer.backend=deepspeed trainer.zero_stage=3, or trainer.expert_parallel=1"
        )
    if t.world_size % ep:
        raise ValueError(
            f"trainer.expert_parallel={ep} must divide trainer.world_size={t.world_size} "
            "(each group of that many ranks shares out the experts)"
        )


def validate_objective(cfg: Any) -> None:
    """The loss settings: a clip range that means something, a cap above it, the family."""
    check_choice(cfg, "trainer.advantage_std", ADVANTAGE_STD)
    check_choice(cfg, "trainer.loss_aggregation", LOSS_AGGREGATION)
    check_choice(cfg, "trainer.off_policy", OFF_POLICY)
    check_choice(cfg, "trainer.kl_estimator", KL_ESTIMATORS)
    t = cfg.trainer
    if not 0 <= t.clip_low < 1:
        raise ValueError(
            f"trainer.clip_low={t.clip_low} must be in [0, 1): the ratio is clipped below "
            "at 1 - clip_low (0.2 is usual)"
        )
    if t.clip_high < 0:
        raise ValueError(
            f"trainer.clip_high={t.clip_high} must be >= 0: the ratio is clipped above at "
            "1 + clip_high (0.28 is usual)"
        )
    if not t.is_cap > 1 + t.clip_high:
        raise ValueError(
            f"trainer.is_cap={t.is_cap} must be > 1 + trainer.clip_high = {1 + t.clip_high:g}: "
            "it is the dual clip (past it a negative-advantage token's gradient is 0) and "
            "the truncated-IS cap; a cap at or below the clip zeroes or shrinks on-policy "
            "gradients. There is no 'off': use a large value (e.g. 1e9) to disable it"
        )
    if t.kl_coef < 0:
        raise ValueError(f"trainer.kl_coef={t.kl_coef} must be >= 0")
