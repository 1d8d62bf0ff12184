"""``trainer``: the trainer pool - its backend, ranks, optimisation, the off-policy
guards (clipping, importance cap, lag), checkpoints and the weight publishing cadence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.config.checks import check_choice, check_pool_device, check_positive


@dataclass
class TrainerConfig:
    backend: str = "torch"  # torch | deepspeed
    max_steps: int = 20
    samples_per_step: int = 16
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_cap: float = 2.0  # truncation of the importance weight actor -> trainer
    kl_coef: float = 0.0
    max_lag: int = 4  # reject samples whose oldest token is older than this
    publish_every: int = 1
    checkpoint_every: int = 10
    resume: bool = True
    bucket_mb: float = 64.0
    transfer_timeout_s: float = 60.0
    transfer_host: str = "127.0.0.1"  # address actors reach the trainer's transfer store on
    keep_checkpoints: int = 2
    torch_threads: int = 1
    world_size: int = 1  # ranks (processes) of the trainer; rank 0 reads, publishes, reports
    zero_stage: int = 0  # backend=deepspeed: ZeRO stage 0-3
    device: str = "cpu"  # cpu, cuda (cuda:<local rank> per rank), cuda:N (one rank)
    # float32 | bfloat16 (fp32 master weights and optimizer, bf16 compute); empty: model.dtype
    dtype: str = ""
    collective_timeout_s: float = 300.0  # deadline of every collective between the ranks


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
    if t.max_lag < 0:
        raise ValueError(f"trainer.max_lag={t.max_lag} must be >= 0")
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
