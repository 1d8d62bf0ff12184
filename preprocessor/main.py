"""The preprocessor pool: rollout groups in, packed training micro-batches out.

::

    reads   <run>:rollouts  (consumer group "preprocessor", one consumer per process)
    writes  <run>:batches   (TrainBatch entries), <run>:dead (undecodable entries)
    blocks  on XREADGROUP when no rollouts wait

Per group: advantages relative to the group, drop it when all rewards are
equal (no learning signal), reference log-probs from a frozen copy of the
initial model; then pack the kept samples into token-budget micro-batches.
Rollouts are acknowledged only after their batches are written.
"""

from __future__ import annotations

import logging
import uuid

import numpy as np
import torch

from pipeline.logprobs import completion_logprobs, pad_sequences
from pipeline.messages import SCHEMA_VERSION, RolloutGroup, TrainBatch, encode, pack_f32, unpack_i32
from pipeline.models import load_model
from pipeline.runtime import Pool, model_path, start_pool
from pipeline.streams import Consumer, publish, trim_consumed
from preprocessor.shaping import group_advantages, has_signal, pack

log = logging.getLogger("preprocessor")
GROUP = "preprocessor"


@torch.inference_mode()
def add_reference(ref_model, groups: list[RolloutGroup], budget: int, pad_id: int) -> None:
    """Fill each sample's ref_logprobs, in budget-sized forward passes."""
    items = [(g, s) for g in groups for s in g.samples]
    prompts = [unpack_i32(g.prompt_ids) for g, _ in items]
    comps = [s.tokens() for _, s in items]
    lengths = [len(p) + len(c) for p, c in zip(prompts, comps, strict=True)]
    for idx in pack(lengths, budget):
        ids, attn, comp = pad_sequences([prompts[i] for i in idx], [comps[i] for i in idx], pad_id)
        g0 = items[idx[0]][0]
        lp = completion_logprobs(ref_model, ids, attn, comp, g0.temperature, g0.top_p, g0.top_k)
        for row, i in enumerate(idx):
            items[i][1].ref_logprobs = pack_f32(lp[row][comp[row]].numpy())


def to_batches(groups: list[RolloutGroup], budget: int) -> list[TrainBatch]:
    items = [(g, s) for g in groups for s in g.samples]
    lengths = [len(unpack_i32(g.prompt_ids)) + len(s.tokens()) for g, s in items]
    out = []
    for idx in pack(lengths, budget):
        chosen = [items[i] for i in idx]
        g0 = chosen[0][0]
        out.append(
            TrainBatch(
                schema=SCHEMA_VERSION,
                batch_id=uuid.uuid4().hex[:16],
                group_ids=[g.group_id for g, _ in chosen],
                prompt_ids=[g.prompt_ids for g, _ in chosen],
                samples=[s for _, s in chosen],
                temperature=g0.temperature,
                top_p=g0.top_p,
                top_k=g0.top_k,
            )
        )
    return out


def process(pool: Pool, ref_model, pad_id: int, entries: list[tuple[str, RolloutGroup]]) -> dict:
    cfg = pool.cfg.preprocessor
    kept, dropped = [], 0
    for _id, group in entries:
        rewards = [s.reward for s in group.samples]
        if cfg.drop_no_signal and not has_signal(rewards):
            dropped += 1
            pool.client.incrby(pool.names.key("samples_retired"), len(group.samples))
            continue
        for s, a in zip(group.samples, group_advantages(rewards), strict=True):
            s.advantage = float(a)
        kept.append(group)
    if kept and ref_model is not None:
        add_reference(ref_model, kept, cfg.token_budget, pad_id)
    batches = to_batches(kept, cfg.token_budget) if kept else []
    for b in batches:
        versions = np.concatenate([s.token_versions() for s in b.samples])
        publish(
            pool.client,
            pool.names.batches,
            encode(b),
            schema=SCHEMA_VERSION,
            batch=b.batch_id,
            samples=len(b.samples),
            groups=len(set(b.group_ids)),
            versions=f"{versions.min()}-{versions.max()}",
            tokens=int(versions.size),
        )
    return {"kept": len(kept), "dropped": dropped, "batches": len(batches)}


def main(argv: list[str] | None = None) -> None:
    pool = start_pool("preprocessor", argv)
    cfg = pool.cfg
    ref_model, tokenizer = (None, None)
    if cfg.preprocessor.reference:
        ref_model, tokenizer = load_model(model_path(cfg), cfg.model.dtype)
    pad_id = tokenizer.pad_token_id if tokenizer is not None else 0
    consumer = Consumer(
        pool.client,
        pool.names,
        pool.names.rollouts,
        GROUP,
        pool.name,
        RolloutGroup,
        block_ms=cfg.redis.block_ms,
    )
    totals = {"kept": 0, "dropped": 0, "batches": 0}
    while not pool.stop.is_set():
        entries = consumer.read(cfg.preprocessor.read_count)
        if not entries:
            pool.status.set(state="idle", **totals, dead_lettered=consumer.dead_lettered)
            continue
        counts = process(pool, ref_model, pad_id, entries)
        consumer.ack([entry_id for entry_id, _ in entries])
        trim_consumed(pool.client, pool.names.rollouts)
        for k, v in counts.items():
            totals[k] += v
        pool.record(event="preprocessed", **counts)
        pool.status.set(state="working", **totals, dead_lettered=consumer.dead_lettered)
    pool.status.set(state="stopped", **totals, dead_lettered=consumer.dead_lettered)
    log.info("stopped: %s", totals)
