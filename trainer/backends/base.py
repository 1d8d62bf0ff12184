"""The interface every trainer backend implements (:class:`Backend`) and the part both
backends share (:class:`OptimizerLR`); the backends are chosen by
:func:`trainer.backends.make_backend`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from trainer.collate import MicroBatch

LossFn = Callable[[torch.nn.Module, MicroBatch], tuple[torch.Tensor, list[float]]]


class Backend(Protocol):
    device: torch.device
    autocast_dtype: torch.dtype | None  # compute dtype when weights are kept in fp32
    vocab_size: int

    def step(
        self, micro: list[MicroBatch], loss_fn: LossFn
    ) -> tuple[float, list[float] | None, bool]:
        """Zero grads, backward every micro-batch, reduce, clip, one optimizer step.
        Returns (grad norm, this rank's summed loss_fn stats, applied). A step whose
        loss or gradient is not finite on any rank is not applied: weights and
        optimizer state stay as they were and ``applied`` is False on every rank."""
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


def all_ranks_finite(ranks, finite: bool) -> bool:
    """True when ``finite`` holds on every rank (one tiny all-reduce with several)."""
    if ranks.world_size == 1:
        return finite
    import torch.distributed as dist

    flag = torch.tensor([0.0 if finite else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ranks.group)
    return bool(flag.item() == 0.0)


def adamw(params, t) -> torch.optim.AdamW:
    """AdamW over ``params`` with ``trainer.lr`` and ``trainer.weight_decay``, fused
    (one kernel over every tensor; torch's default on the CPU is a Python loop over the
    parameters: 0.5 s against 0.1 s a step for SmolLM2-135M on this 2-core machine,
    python -m pipeline.bench trainstep)."""
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, fused=True)


class OptimizerLR:
    """The learning rate of ``self.optimizer``'s parameter groups (both backends)."""

    optimizer: torch.optim.Optimizer

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr
