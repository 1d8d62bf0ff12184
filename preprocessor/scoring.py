"""What every scorer shares: the group it annotates, its interface, batched forwards.

::

    reads   rollout groups (prompt ids, sampled ids, the actor's log-probs, masks)
    writes  per-sample fields (ref_logprobs) or per-token advantage parts
            (ScoredGroup.dense[name]) that preprocessor/main.py mixes into advantages

A scorer is *dense* when it adds a per-token advantage part (prm, teacher):
those run on every group read, before the no-signal filter, since their
signal can keep a group whose outcome rewards are all equal. The others
(reference) run only on the groups kept. Forward passes are batched: the
groups read at once are packed into ``token_budget``-sized passes, per sampling
setting, and each group's prompt is computed once for all its completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from transformers import DynamicCache

from pipeline.logprobs import masked_logprobs
from pipeline.messages import RolloutGroup, unpack_i32


@dataclass
class ScoredGroup:
    """A rollout group on its way through the scorers."""

    group: RolloutGroup
    # scorer name -> one per-token advantage part per sample (dense scorers only)
    dense: dict[str, list[np.ndarray]] = field(default_factory=dict)

    @property
    def lengths(self) -> list[int]:
        """Per sample, its sampled tokens (an episode's observation ids carry no value)."""
        return [s.n_sampled() for s in self.group.samples]


class Scorer(Protocol):
    name: str
    dense: bool  # adds ScoredGroup.dense[name], mixed into the advantages with ``weight``
    weight: float

    def score(self, items: list[ScoredGroup]) -> dict[str, float]:
        """Annotate ``items`` in place; return counters (summed into the status hash)."""
        ...


def pack_groups(shapes: list[tuple[int, list[int]]], budget: int) -> list[list[int]]:
    """Split groups, given as (prompt length, completion lengths), into forward passes.

    A pass computes each prompt once and each completion after it, padded, so it costs
    ``groups * longest prompt + samples * longest completion`` tokens; that stays within
    ``budget`` (a group larger than the budget gets a pass of its own).
    """
    order = sorted(range(len(shapes)), key=lambda i: (shapes[i][0], max(shapes[i][1])))
    parts: list[list[int]] = []
    current: list[int] = []
    for i in order:
        trial = current + [i]
        lp = max(shapes[j][0] for j in trial)
        lc = max(max(shapes[j][1]) for j in trial)
        m = sum(len(shapes[j][1]) for j in trial)
        if current and len(trial) * lp + m * lc > budget:
            parts.append(current)
            trial = [i]
        current = trial
    if current:
        parts.append(current)
    return parts


def _left_padded(seqs: list[np.ndarray], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, width - len(x) :] = torch.from_numpy(x.astype(np.int64))
        attn[i, width - len(x) :] = 1
    return ids, attn


@torch.inference_mode()
def shared_prompt_forward(
    model, prompts: list, completions: list[list], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of several groups' completions, each prompt computed once for its group.

    The prompts go through the model left-padded, their KV cache is repeated for every
    completion of the group, and the completions follow right-padded, as the engine
    decodes them. Returns, per completion in order, ``logits`` [n, longest + 1, vocab]
    where position j predicts completion token j (the last: what would follow), its
    right-padded ids and the bool mask of real tokens, both [n, longest].
    """
    p_ids, p_attn = _left_padded([np.asarray(p) for p in prompts], pad_id)
    cache = DynamicCache()
    first = model(
        input_ids=p_ids,
        attention_mask=p_attn,
        position_ids=(p_attn.cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
    ).logits[:, -1, :]
    rows = torch.tensor([g for g, comps in enumerate(completions) for _ in comps])
    flat = [np.asarray(c) for comps in completions for c in comps]
    cache.batch_select_indices(rows)
    width = max(len(c) for c in flat)
    c_ids = torch.full((len(flat), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(flat), width), dtype=torch.bool)
    for i, c in enumerate(flat):
        c_ids[i, : len(c)] = torch.from_numpy(c.astype(np.int64))
        valid[i, : len(c)] = True
    logits = model(
        input_ids=c_ids,
        attention_mask=torch.cat([p_attn[rows], valid.long()], dim=1),
        position_ids=p_attn[rows].sum(-1, keepdim=True) + torch.arange(width),
        past_key_values=cache,
        use_cache=True,
    ).logits
    return torch.cat([first[rows][:, None, :], logits], dim=1), c_ids, valid


def shared_prompt_logprobs(
    model,
    prompts: list[np.ndarray],
    completions: list[list[np.ndarray]],
    sampling: tuple[float, float, int],
    masks: list | None,
    pad_id: int,
    sampled: list[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Each completion's log-probs of its sampled tokens (see
    :func:`shared_prompt_forward`) under the sampling transformation; ``masks``: one
    entry per completion, in order, or None; ``sampled``: per completion the bool loss
    mask (an episode: observation ids are read, not scored; None: every id sampled)."""
    temperature, top_p, top_k = sampling
    pred, c_ids, valid = shared_prompt_forward(model, prompts, completions, pad_id)
    scored = valid
    if sampled is not None:
        scored = torch.zeros_like(valid)
        for i, m in enumerate(sampled):
            scored[i, : len(m)] = torch.from_numpy(np.asarray(m, dtype=bool))
    logp = masked_logprobs(pred[:, :-1], temperature, top_p, top_k, masks, scored)
    token_lp = logp.gather(-1, c_ids[..., None]).squeeze(-1)
    return [token_lp[i][scored[i]].numpy().astype(np.float32) for i in range(len(scored))]


def group_logprobs(
    model, groups: list[RolloutGroup], budget: int, pad_id: int, truncate: bool = True
) -> list[list[np.ndarray]]:
    """Per group, each sample's log-probs of its sampled tokens under ``model``, batched
    (an episode's observation ids are in the forward pass but get no value).

    ``truncate``: the rollout's own sampling distribution (temperature, top-k/top-p or
    the recorded sampling mask); otherwise the temperature alone (a teacher's view).
    Groups are batched per sampling setting into ``budget``-sized forward passes.
    """
    out: list[list[np.ndarray] | None] = [None] * len(groups)
    by_setting: dict[tuple, list[int]] = {}
    for i, g in enumerate(groups):
        key = (g.temperature, g.top_p, g.top_k) if truncate else (g.temperature, 1.0, 0)
        by_setting.setdefault(key, []).append(i)
    for sampling, indices in by_setting.items():
        prompts = [unpack_i32(groups[i].prompt_ids) for i in indices]
        comps = [[s.tokens() for s in groups[i].samples] for i in indices]
        shapes = [(len(p), [len(c) for c in cs]) for p, cs in zip(prompts, comps, strict=True)]
        for part in pack_groups(shapes, budget):
            masks = None
            if truncate:
                masks = [s.sampling_mask() for j in part for s in groups[indices[j]].samples]
            sampled = [s.sampled() for j in part for s in groups[indices[j]].samples]
            lps = shared_prompt_logprobs(
                model,
                [prompts[j] for j in part],
                [comps[j] for j in part],
                sampling,
                masks,
                pad_id,
                sampled,
            )
            k = 0
            for j in part:
                n = len(comps[j])
                out[indices[j]] = lps[k : k + n]
                k += n
    return out  # type: ignore[return-value]


def replayed_logprobs(
    model, groups: list[RolloutGroup], budget: int, pad_id: int
) -> list[list[np.ndarray]]:
    """As :func:`group_logprobs` with ``truncate=False``, but every forward routes each
    token to the experts the actor recorded (sampling.keep_routing; pipeline/routing.py
    replay) instead of the model's own choice. One right-padded forward per
    ``budget``-sized slice of a group (no shared prompt pass: the prompt's rows are
    replayed with every sample's)."""
    from pipeline.logprobs import completion_logprobs
    from pipeline.routing import RouteLayout, joined_routes, replay

    out = []
    for g in groups:
        prompt = unpack_i32(g.prompt_ids)
        layout = RouteLayout.from_list(g.route_layout)
        routes = joined_routes(g)
        width = len(prompt) + max(len(s.tokens()) for s in g.samples)
        per_pass = max(1, budget // width)
        lps: list[np.ndarray] = []
        for start in range(0, len(g.samples), per_pass):
            part = range(start, min(start + per_pass, len(g.samples)))
            n = len(part)
            ids = torch.full((n, width), pad_id, dtype=torch.long)
            attn = torch.zeros((n, width), dtype=torch.long)
            comp = torch.zeros((n, width), dtype=torch.bool)
            ids_routes = torch.zeros((n, width, layout.layers, layout.k), dtype=torch.long)
            valid = torch.zeros((n, width), dtype=torch.bool)
            for row, i in enumerate(part):
                s = g.samples[i]
                seq = np.concatenate([prompt, s.tokens()])
                ids[row, : len(seq)] = torch.from_numpy(seq.astype(np.int64))
                attn[row, : len(seq)] = 1
                comp[row, len(prompt) : len(seq)] = torch.from_numpy(s.sampled())
                ids_routes[row, : len(seq) - 1] = torch.from_numpy(
                    layout.unpack(routes[i]).astype(np.int64)
                )
                valid[row, : len(seq) - 1] = True
            with torch.no_grad(), replay(model, ids_routes, valid):
                lp = completion_logprobs(model, ids, attn, comp, g.temperature)
            lps += [lp[row][comp[row]].numpy().astype(np.float32) for row in range(n)]
        out.append(lps)
    return out
