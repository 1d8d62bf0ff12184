"""``weights``: how new weights travel from the trainer to the actors
(pipeline/transfer/) and how the vllm engine swaps them in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.config.checks import check_choice


@dataclass
class WeightsConfig:
    """How new weights travel from the trainer to the actors (pipeline/transfer/)."""

    # gloo: CPU, TCP pair groups, any hosts; nccl: one broadcast group over NCCL (a GPU
    # per rank); cuda_ipc: the actor maps the trainer's GPU buffers (same host)
    transport: str = "gloo"
    nccl_backend: str = "nccl"  # gloo: the nccl transport's code on the CPU (tests)
    # actor.engine=vllm: lock (swap between two forward passes under the per-forward
    # lock) | pause (vLLM's pause_generation(mode="keep") + swap + resume: the baseline)
    update_mode: str = "lock"


def validate_weights(cfg: Any) -> None:
    """The ``weights`` section."""
    check_choice(cfg, "weights.transport", ("gloo", "nccl", "cuda_ipc"))
    check_choice(cfg, "weights.nccl_backend", ("nccl", "gloo"))
    check_choice(cfg, "weights.update_mode", ("lock", "pause"))
