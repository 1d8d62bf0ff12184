"""Pure functions of the preprocessor: group-relative advantages, their mix with the
dense (per-token) parts of the scorers, the no-signal filter, and packing."""

from __future__ import annotations

import numpy as np


def group_advantages(rewards: list[float], eps: float = 1e-6, std: str = "group") -> np.ndarray:
    """GRPO advantages within one group: (r - mean) / (std + eps) with ``std="group"``
    (trainer.advantage_std, the default); r - mean with ``std="none"`` (Dr. GRPO, Liu et
    al. 2025, arXiv 2503.20783: no bias towards groups of small reward spread)."""
    r = np.asarray(rewards, dtype=np.float64)
    centred = r - r.mean()
    return centred / (r.std() + eps) if std == "group" else centred


def has_signal(rewards: list[float], tol: float = 1e-9) -> bool:
    """A group whose rewards are all equal teaches nothing (all advantages are 0)."""
    return bool(np.ptp(np.asarray(rewards, dtype=np.float64)) > tol)


def mix_advantages(
    outcome: np.ndarray,
    lengths: list[int],
    dense: dict[str, list[np.ndarray]],
    weights: dict[str, float],
) -> list[np.ndarray]:
    """Per-token advantages of a group: (1 - sum of weights) * outcome + weighted dense parts.

    ``outcome`` holds one (group-relative) advantage per sample, ``lengths`` their
    token counts; ``dense[name]`` one per-token array per sample, weighted by
    ``weights[name]``. Weight 0 leaves the outcome advantage alone; weight 1
    replaces it.
    """
    total = sum(weights[name] for name in dense)
    assert total <= 1 + 1e-9, "dense weights leave the outcome a non-negative share"
    out = []
    for i, (a, n) in enumerate(zip(outcome, lengths, strict=True)):
        mixed = np.full(n, (1.0 - total) * float(a), dtype=np.float64)
        for name, arrays in dense.items():
            assert len(arrays[i]) == n, "every dense array covers the sample's tokens"
            mixed += weights[name] * arrays[i]
        out.append(mixed.astype(np.float32))
    return out


def set_advantages(
    samples: list,
    dense: dict[str, list[np.ndarray]],
    weights: dict[str, float],
    tol: float = 1e-9,
    std: str = "group",
) -> bool:
    """Write each sample's ``advantage`` (and ``token_advantages`` when there are dense
    parts); return whether the group carries a learning signal.

    Without dense parts this is plain GRPO: one advantage per sample, and a group whose
    rewards are all equal has no signal. An episode whose tool infrastructure failed
    (``infra_failure``) is left out of the group's mean and std and gets advantage 0:
    a dead sandbox is not a wrong answer. With them, ``advantage`` keeps the outcome
    advantage, ``token_advantages`` the mix, and the group has signal when some token's
    mixed advantage is not 0 (step or teacher rewards can teach where outcomes tie).
    """
    counted = np.array([not s.infra_failure for s in samples])
    rewards = [s.reward for s, c in zip(samples, counted, strict=True) if c]
    outcome = np.zeros(len(samples))
    if rewards:
        outcome[counted] = group_advantages(rewards, std=std)
    for s, a in zip(samples, outcome, strict=True):
        s.advantage = float(a)
    if not dense:
        return bool(rewards) and has_signal(rewards, tol)
    lengths = [s.n_sampled() for s in samples]
    mixed = mix_advantages(outcome, lengths, dense, weights)
    for s, m in zip(samples, mixed, strict=True):
        s.token_advantages = m.astype("<f4").tobytes()
    return any(m.size and float(np.abs(m).max()) > tol for m in mixed)


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


def pack_whole_groups(lengths: list[list[int]], token_budget: int) -> list[list[tuple[int, int]]]:
    """Micro-batches of (group, sample) index pairs that keep each group whole.

    ``lengths[g]`` holds group g's sample lengths. Groups are taken by their longest
    sample (little padding) and a micro-batch holds whole groups while its padded size
    (rows x longest) fits ``token_budget``. A group that alone exceeds the budget is split
    by :func:`pack` into consecutive micro-batches of its own. So a batch entry never
    mixes part of a group with another group: the trainer, which reads entries until a
    step's worth of samples, takes a group whole into one step, and staleness cannot
    drop a group's long samples while its short ones train (their advantages were
    centred over the whole group).
    """
    order = sorted(range(len(lengths)), key=lambda g: max(lengths[g]))
    batches: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    width = 0
    for g in order:
        rows, longest = len(lengths[g]), max(lengths[g])
        if rows * longest > token_budget:  # too big whole: its own micro-batches
            batches.extend([[(g, i) for i in part] for part in pack(lengths[g], token_budget)])
            continue
        new_width = max(width, longest)
        if current and new_width * (len(current) + rows) > token_budget:
            batches.append(current)
            current, new_width = [], longest
        current.extend((g, i) for i in range(rows))
        width = new_width
    if current:
        batches.append(current)
    return batches
