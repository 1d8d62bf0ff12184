"""Pure functions of the preprocessor: group-relative advantages and packing."""

from __future__ import annotations

import numpy as np


def group_advantages(rewards: list[float], eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages: (r - mean) / (std + eps) within one group."""
    r = np.asarray(rewards, dtype=np.float64)
    return (r - r.mean()) / (r.std() + eps)


def has_signal(rewards: list[float], tol: float = 1e-9) -> bool:
    """A group whose rewards are all equal teaches nothing (all advantages are 0)."""
    return bool(np.ptp(np.asarray(rewards, dtype=np.float64)) > tol)


def pack(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Split sample indices into micro-batches whose padded size fits the budget.

    Samples are sorted by length so each micro-batch pads little; the padded
    size of a micro-batch is ``len(batch) * max length``. A single sample
    longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = max(lengths[i], max((lengths[j] for j in current), default=0))
        if current and width * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
