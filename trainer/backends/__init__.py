"""Trainer backends behind one small interface (:class:`Backend`).

``torch``: plain AdamW, gradients summed over ranks with an all-reduce.
``deepspeed``: a DeepSpeed engine, ZeRO stage ``trainer.zero_stage`` (0-3).
Both train a LoRA adapter alone when ``model.lora`` asks for one (pipeline/lora.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from trainer.collate import MicroBatch
from trainer.ranks import Ranks

LossFn = Callable[[torch.nn.Module, MicroBatch], tuple[torch.Tensor, list[float]]]
BACKENDS = ("torch", "deepspeed")


class Backend(Protocol):
    device: torch.device
    autocast_dtype: torch.dtype | None  # compute dtype when weights are kept in fp32
    vocab_size: int

    def step(self, micro: list[MicroBatch], loss_fn: LossFn) -> tuple[float, list[float]]:
        """Zero grads, backward every micro-batch, reduce, clip, one optimizer step.
        Returns (grad norm, this rank's summed loss_fn stats)."""
        ...

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        """Every parameter under its HF name, in the publish dtype (with ``model.lora``:
        the adapter alone, under peft's names). Collective under ZeRO-3 (every rank
        calls it); rank 0 gets the dict, the others None."""
        ...

    def save(self, path: str) -> None:
        """Write model, optimizer state into ``path`` (collective; a shared folder)."""
        ...

    @property
    def lr(self) -> float: ...

    def set_lr(self, lr: float) -> None: ...


class OptimizerLR:
    """The learning rate of ``self.optimizer``'s parameter groups (both backends)."""

    optimizer: torch.optim.Optimizer

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr


def make_backend(cfg, ranks: Ranks, model_path: str, resume_from: str | None) -> Backend:
    """The configured backend, with weights and optimizer restored from ``resume_from``."""
    kind = cfg.trainer.backend
    if kind == "torch":
        from trainer.backends.torch_backend import TorchBackend

        return TorchBackend(cfg, ranks, model_path, resume_from)
    if kind == "deepspeed":
        from trainer.backends.deepspeed_backend import DeepSpeedBackend

        return DeepSpeedBackend(cfg, ranks, model_path, resume_from)
    raise ValueError(f"trainer.backend={kind!r} is not supported; use one of {BACKENDS}")
