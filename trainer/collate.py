"""Batch entries to tensors: one TrainBatch becomes one micro-batch, in two layouts: padded
rows (the loss's [rows, width] tensors, and the forward of a batch with MoE routes) and,
without routes, the packed rows the forward runs on (pipeline/packing.py: a row per
distinct prompt, the prompt once and then its completions).

Everything is assembled in numpy (one concatenation per field, no Python loop
over tensor elements) and moved to the trainer's device once. A batch reaches
here only after ``TrainBatch.check`` (pipeline/messages.py) passed in
trainer/batches.py: one whose per-sample arrays disagree is dead-lettered there
instead of crashing the trainer at every restart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.messages import TrainBatch, unpack_f32, unpack_i32
from pipeline.packing import Packed, pack
from pipeline.routing import RouteLayout


@dataclass
class MicroBatch:
    ids: torch.Tensor  # [rows, width] long, right-padded prompt + completion
    attn: torch.Tensor  # [rows, width] long
    # [rows, width] bool: the loss mask, True exactly on sampled tokens (a completion's
    # every token; an episode's observation and boundary ids are False)
    comp: torch.Tensor
    actor_lp: torch.Tensor  # [rows, width] float32, 0 outside completions
    advantages: torch.Tensor  # [rows, width] float32 per token
    ref_lp: torch.Tensor | None
    masks: list | None  # per row None or per-token kept ids (keep_sampling_mask)
    temperature: float
    top_p: float
    top_k: int
    tokens: int  # sampled tokens (the loss covers these)
    sample_ids: list[str]  # "<group>/<index>" per row (trainer/batches.py sample_ids)
    weight: float = 1.0  # 0.0: a padding pass that keeps the ranks in step
    # sampling.keep_routing (TrainBatch.route_layout set): [rows, width, moe layers, k] long
    # expert ids to replay (pipeline/routing.py), valid [rows, width] bool on every position
    # fed forward at sampling (prompt + completion less its last id; never padding), and
    # the policy version of each sampled token ([rows, width] long, -1 elsewhere)
    routes: torch.Tensor | None = None
    routes_valid: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    # the forward's layout without routes (pipeline/packing.py); None: the padded rows
    packed: Packed | None = None


def _scatter(values: list[np.ndarray], comp: np.ndarray) -> np.ndarray:
    """Per-row arrays into the sampled positions (rows in order, left to right)."""
    out = np.zeros(comp.shape, dtype=np.float32)
    out[comp] = np.concatenate(values)
    return out


def collate(batch: TrainBatch, pad_id: int, device: torch.device) -> MicroBatch:
    prompts = [unpack_i32(p) for p in batch.prompt_ids]
    completions = [s.tokens() for s in batch.samples]
    p_len = np.array([len(p) for p in prompts])
    c_len = np.array([len(c) for c in completions])
    total = p_len + c_len
    cols = np.arange(int(total.max()))[None, :]
    attn = cols < total[:, None]
    comp = (cols >= p_len[:, None]) & attn
    episodes = [i for i, s in enumerate(batch.samples) if s.loss_mask]
    if episodes:  # observation and boundary ids are read, never trained on
        sampled = np.ones(comp.shape, dtype=bool)
        for i in episodes:
            sampled[i, p_len[i] : total[i]] = batch.samples[i].sampled()
        comp &= sampled
    ids = np.full(attn.shape, pad_id, dtype=np.int64)
    ids[attn] = np.concatenate(
        [x for p, c in zip(prompts, completions, strict=True) for x in (p, c)]
    )
    scalar = np.array([s.advantage for s in batch.samples], dtype=np.float32)
    adv = np.where(comp, scalar[:, None], 0.0).astype(np.float32)
    dense = [i for i, s in enumerate(batch.samples) if s.token_advantages]
    if dense:
        rows = np.zeros(len(batch.samples), dtype=bool)
        rows[dense] = True
        sel = comp & rows[:, None]
        adv[sel] = np.concatenate([unpack_f32(batch.samples[i].token_advantages) for i in dense])
    actor_lp = _scatter([unpack_f32(s.logprobs) for s in batch.samples], comp)
    ref = None
    if batch.samples[0].ref_logprobs:
        ref = _scatter([unpack_f32(s.ref_logprobs) for s in batch.samples], comp)
    masks = [s.sampling_mask() for s in batch.samples]
    routes = _routes(batch, total, comp) if batch.route_layout else None

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    return MicroBatch(
        ids=put(ids),
        attn=put(attn.astype(np.int64)),
        comp=put(comp),
        actor_lp=put(actor_lp),
        advantages=put(adv),
        ref_lp=put(ref) if ref is not None else None,
        masks=None if all(m is None for m in masks) else masks,
        temperature=batch.temperature,
        top_p=batch.top_p,
        top_k=batch.top_k,
        tokens=int(comp.sum()),
        sample_ids=[f"{g}/{s.index}" for g, s in zip(batch.group_ids, batch.samples, strict=True)],
        routes=put(routes[0]) if routes else None,
        routes_valid=put(routes[1]) if routes else None,
        versions=put(routes[2]) if routes else None,
        # routes are replayed per padded position: a batch with them runs padded
        packed=None if routes else pack(prompts, completions, comp, device),
    )


def _routes(batch: TrainBatch, total: np.ndarray, comp: np.ndarray):
    """(ids [rows, width, layers, k] int64, valid [rows, width] bool, versions [rows,
    width] int64) of a batch with routes: row t of a sample's routes at position t."""
    layout = RouteLayout.from_list(batch.route_layout)
    width = comp.shape[1]
    valid = np.arange(width)[None, :] < (total - 1)[:, None]
    ids = np.zeros((len(total), width, layout.layers, layout.k), dtype=np.int64)
    ids[valid] = np.concatenate([layout.unpack(s.routes) for s in batch.samples])
    versions = np.full(comp.shape, -1, dtype=np.int64)
    versions[comp] = np.concatenate([s.token_versions() for s in batch.samples])
    return ids, valid, versions
