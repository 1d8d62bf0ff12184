"""What every scorer shares: the group it annotates, its interface, batched forwards.

::

    reads   rollout groups (prompt ids, sampled ids, the actor's log-probs, masks)
    writes  per-sample fields (ref_logprobs) or per-token advantage parts
            (ScoredGroup.dense[name]) that preprocessor/main.py mixes into advantages

A scorer is *dense* when it adds a per-token advantage part (prm, teacher):
those run on every group read, before the no-signal filter, since their
signal can keep a group whose outcome rewards are all equal. The others
(reference) run only on the groups kept. Forward passes are batched: the
samples of all groups read at once are packed into ``token_budget``-sized
micro-batches, per sampling setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pipeline.logprobs import completion_logprobs, pad_sequences
from pipeline.messages import RolloutGroup, Sample, unpack_i32
from preprocessor.shaping import pack


@dataclass
class ScoredGroup:
    """A rollout group on its way through the scorers."""

    group: RolloutGroup
    # scorer name -> one per-token advantage part per sample (dense scorers only)
    dense: dict[str, list[np.ndarray]] = field(default_factory=dict)

    @property
    def lengths(self) -> list[int]:
        return [len(s.tokens()) for s in self.group.samples]


class Scorer(Protocol):
    name: str
    dense: bool  # adds ScoredGroup.dense[name], mixed into the advantages with ``weight``
    weight: float

    def score(self, items: list[ScoredGroup]) -> dict[str, float]:
        """Annotate ``items`` in place; return counters (summed into the status hash)."""
        ...


def packed_logprobs(
    model,
    items: list[tuple[RolloutGroup, Sample]],
    budget: int,
    pad_id: int,
    truncate: bool = True,
) -> list[np.ndarray]:
    """Each sample's completion log-probs under ``model``, in budget-sized forward passes.

    ``truncate``: the rollout's own sampling distribution (temperature, top-k/top-p or
    the recorded sampling mask); otherwise the temperature alone (a teacher's view).
    """
    out: list[np.ndarray | None] = [None] * len(items)
    by_setting: dict[tuple, list[int]] = {}
    for i, (g, _) in enumerate(items):
        key = (g.temperature, g.top_p, g.top_k) if truncate else (g.temperature, 1.0, 0)
        by_setting.setdefault(key, []).append(i)
    for (temperature, top_p, top_k), indices in by_setting.items():
        prompts = [unpack_i32(items[i][0].prompt_ids) for i in indices]
        comps = [items[i][1].tokens() for i in indices]
        lengths = [len(p) + len(c) for p, c in zip(prompts, comps, strict=True)]
        for part in pack(lengths, budget):
            ids, attn, comp = pad_sequences(
                [prompts[j] for j in part], [comps[j] for j in part], pad_id
            )
            masks = None
            if truncate:
                masks = [items[indices[j]][1].sampling_mask() for j in part]
            with torch.inference_mode():
                lp = completion_logprobs(
                    model, ids, attn, comp, temperature, top_p, top_k, masks=masks
                )
            for row, j in enumerate(part):
                out[indices[j]] = lp[row][comp[row]].numpy().astype(np.float32)
    return out  # type: ignore[return-value]


def samples_of(items: list[ScoredGroup]) -> list[tuple[RolloutGroup, Sample]]:
    return [(it.group, s) for it in items for s in it.group.samples]


def split_per_group(items: list[ScoredGroup], flat: list) -> list[list]:
    """A flat per-sample list (in ``samples_of`` order) cut back into groups."""
    out, k = [], 0
    for it in items:
        n = len(it.group.samples)
        out.append(flat[k : k + n])
        k += n
    return out
