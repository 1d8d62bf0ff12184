"""The trainer pool (torch backend): micro-batches in, new weights out.

::

    reads   <run>:batches (consumer group "trainer")
    writes  <run>:weights announcements + gloo transfer (publisher thread),
            <run>:trainer_version, checkpoints/, metrics.jsonl, status hash
    blocks  on XREADGROUP until trainer.samples_per_step samples are fresh enough

One optimizer step per ``samples_per_step`` samples; samples whose oldest
token is more than ``trainer.max_lag`` versions old are rejected. The step's
entries are acknowledged after the step; the batches stream is trimmed only
below the last checkpoint's position, which a restart resumes from.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.config import run_secret
from pipeline.logprobs import completion_logprobs, pad_sequences
from pipeline.messages import Sample, TrainBatch, unpack_f32, unpack_i32
from pipeline.models import load_model
from pipeline.runtime import Pool, model_path, start_pool
from pipeline.streams import Consumer, trim_consumed
from pipeline.weight_publisher import WeightPublisher
from trainer import checkpoint
from trainer.loss import policy_loss

log = logging.getLogger("trainer")
GROUP = "trainer"


@dataclass
class StepData:
    entry_ids: list[str] = field(default_factory=list)
    batches: list[TrainBatch] = field(default_factory=list)
    samples: int = 0
    stale: int = 0
    duplicates: int = 0
    retired: int = 0  # samples read, trained or rejected
    stale_ids: list[str] = field(default_factory=list)
    sample_ids: set[str] = field(default_factory=set)


def sample_ids(batch: TrainBatch) -> list[str]:
    """(group id, index) names a sample across every pool and every retry."""
    return [f"{g}/{s.index}" for g, s in zip(batch.group_ids, batch.samples, strict=True)]


def keep_only(batch: TrainBatch, keep: list[int]) -> TrainBatch | None:
    if not keep:
        return None
    if len(keep) < len(batch.samples):
        batch.samples = [batch.samples[i] for i in keep]
        batch.group_ids = [batch.group_ids[i] for i in keep]
        batch.prompt_ids = [batch.prompt_ids[i] for i in keep]
    return batch


def admit(
    data: StepData, batch: TrainBatch, version: int, max_lag: int, seen: dict[str, int]
) -> TrainBatch | None:
    """Drop samples older than ``max_lag`` versions and samples already trained
    (a batch delivered twice after a crash); record both in ``data``."""
    ids, keep = sample_ids(batch), []
    for i, s in enumerate(batch.samples):
        if ids[i] in seen or ids[i] in data.sample_ids:
            data.duplicates += 1
        elif version - int(s.token_versions().min()) > max_lag:
            data.stale += 1
            data.stale_ids.append(ids[i])
        else:
            keep.append(i)
            data.sample_ids.add(ids[i])
    data.retired += len(batch.samples)
    return keep_only(batch, keep)


def collect(pool: Pool, consumer: Consumer, version: int, seen: dict[str, int]) -> StepData | None:
    """Read micro-batches until a step's worth of fresh samples; None when stopping."""
    cfg, data = pool.cfg.trainer, StepData()
    while data.samples < cfg.samples_per_step:
        if pool.stop.is_set():
            return None
        pool.tick()
        for entry_id, batch in consumer.read(count=4):
            data.entry_ids.append(entry_id)
            batch = admit(data, batch, version, cfg.max_lag, seen)
            if batch is not None:
                data.batches.append(batch)
                data.samples += len(batch.samples)
        pool.status.set(state="waiting for data", buffered_samples=data.samples)
    return data


def per_token(samples: list[Sample], comp: torch.Tensor, attr: str) -> torch.Tensor:
    """Scatter a per-sample float32 array field into the completion positions."""
    out = torch.zeros(comp.shape)
    for row, s in enumerate(samples):
        out[row][comp[row]] = torch.from_numpy(unpack_f32(getattr(s, attr)).copy())
    return out


def advantages(samples: list[Sample], comp: torch.Tensor) -> torch.Tensor:
    """Per-token advantages: ``token_advantages`` where the preprocessor set them
    (step rewards, teacher), else the sample's scalar ``advantage`` on every token."""
    out = torch.tensor([s.advantage for s in samples])[:, None].expand(comp.shape).clone()
    for row, s in enumerate(samples):
        if s.token_advantages:
            out[row][comp[row]] = torch.from_numpy(unpack_f32(s.token_advantages).copy())
    return out


def train_step(model, optimizer, data: StepData, cfg, pad_id: int) -> dict:
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total_tokens = sum(len(s.tokens()) for b in data.batches for s in b.samples)
    agg = {"loss": 0.0, "clipped": 0, "ratio_sum": 0.0, "kl_sum": 0.0}
    for b in data.batches:
        prompts = [unpack_i32(p) for p in b.prompt_ids]
        ids, attn, comp = pad_sequences(prompts, [s.tokens() for s in b.samples], pad_id)
        masks = [s.sampling_mask() for s in b.samples]  # None unless keep_sampling_mask
        new_lp = completion_logprobs(
            model, ids, attn, comp, b.temperature, b.top_p, b.top_k, masks=masks
        )
        adv = advantages(b.samples, comp)
        ref = per_token(b.samples, comp, "ref_logprobs") if b.samples[0].ref_logprobs else None
        parts = policy_loss(
            new_lp,
            per_token(b.samples, comp, "logprobs"),
            adv,
            comp,
            cfg.clip_low,
            cfg.clip_high,
            cfg.is_cap,
            ref,
            cfg.kl_coef,
        )
        (parts.loss / total_tokens).backward()
        agg["loss"] += float(parts.loss.detach()) / total_tokens
        agg["clipped"] += parts.clipped
        agg["ratio_sum"] += parts.ratio_sum
        agg["kl_sum"] += parts.kl_sum
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    model.eval()
    samples = [s for b in data.batches for s in b.samples]
    return {
        "loss": agg["loss"],
        "grad_norm": float(grad_norm),
        "tokens": total_tokens,
        "clip_frac": agg["clipped"] / total_tokens,
        "ratio_mean": agg["ratio_sum"] / total_tokens,
        "kl": agg["kl_sum"] / total_tokens,
        "samples": len(samples),
        "reward_mean": float(np.mean([s.reward for s in samples])),
        "spanning": sum(len(np.unique(s.token_versions())) > 1 for s in samples),
        "oldest_version": int(min(s.token_versions().min() for s in samples)),
        "groups": sorted({g for b in data.batches for g in b.group_ids}),
        "sample_ids": [sid for b in data.batches for sid in sample_ids(b)],
    }


class Trainer:
    def __init__(self, pool: Pool):
        self.pool, cfg = pool, pool.cfg
        self.ckpt_root = os.path.join(cfg.run_dir or ".", "checkpoints")
        resume_from = checkpoint.latest(self.ckpt_root) if cfg.trainer.resume else None
        self.model, self.tokenizer = load_model(resume_from or model_path(cfg), cfg.model.dtype)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay
        )
        self.state = {
            "version": 0,
            "samples_trained": 0,
            "stale_samples_dropped": 0,
            "sequences_spanning_versions": 0,
            "duplicates_dropped": 0,
            "entry_id": "0-0",
            "recent_samples": {},  # sample id -> version that trained it (dedupe window)
        }
        self.consumer = Consumer(
            pool.client,
            pool.names,
            pool.names.batches,
            GROUP,
            pool.name,
            TrainBatch,
            block_ms=cfg.redis.block_ms,
            recover_pending=False,  # resume re-reads from the checkpoint's position instead
            dead_maxlen=cfg.redis.dead_letter_maxlen,
        )
        if resume_from:
            self.state = checkpoint.load_state(resume_from, self.optimizer)
            pool.client.xgroup_setid(pool.names.batches, GROUP, self.state["entry_id"])
            self.state.setdefault("recent_samples", {})
            self.state.setdefault("duplicates_dropped", 0)
            log.info("resumed from %s at version %d", resume_from, self.state["version"])
            pool.record(event="resume", version=self.state["version"])
        self.checkpoint_id = self.state["entry_id"]
        pool.client.set(pool.names.key("trainer_version"), self.state["version"])
        self.publisher = WeightPublisher(
            pool.client,
            pool.names,
            cfg.trainer.transfer_host,
            cfg.trainer.bucket_mb,
            cfg.trainer.transfer_timeout_s,
            run_secret(),
        )
        if resume_from:
            self.publisher.submit(self.state["version"], self.model)

    def step(self, data: StepData) -> dict:
        cfg = self.pool.cfg.trainer
        t0 = time.monotonic()
        metrics = train_step(self.model, self.optimizer, data, cfg, self.tokenizer.pad_token_id)
        s = self.state
        s["version"] += 1
        s["samples_trained"] += metrics["samples"]
        s["stale_samples_dropped"] += data.stale
        s["duplicates_dropped"] += data.duplicates
        horizon = s["version"] - cfg.max_lag - 2  # older duplicates would be rejected as stale
        recent = {k: v for k, v in s["recent_samples"].items() if v >= horizon}
        s["recent_samples"] = recent | dict.fromkeys(data.sample_ids, s["version"])
        s["sequences_spanning_versions"] += metrics["spanning"]
        s["entry_id"] = data.entry_ids[-1]
        self.pool.client.set(self.pool.names.key("trainer_version"), s["version"])
        self.consumer.ack(data.entry_ids)
        self.pool.client.incrby(self.pool.names.key("samples_retired"), data.retired)
        if s["version"] % cfg.publish_every == 0 or s["version"] == cfg.max_steps:
            self.publisher.submit(s["version"], self.model)
        if s["version"] % cfg.checkpoint_every == 0 or s["version"] == cfg.max_steps:
            checkpoint.save(
                self.ckpt_root, self.model, self.tokenizer, self.optimizer, s, cfg.keep_checkpoints
            )
            self.checkpoint_id = s["entry_id"]
        ms, seq = self.checkpoint_id.split("-")
        trim_consumed(self.pool.client, self.pool.names.batches, keep_from=f"{ms}-{int(seq) + 1}")
        metrics.update(
            step_s=time.monotonic() - t0,
            stale=data.stale,
            version=s["version"],
            duplicates=data.duplicates,
            stale_ids=data.stale_ids,
        )
        return metrics

    def report(self, metrics: dict) -> None:
        s = self.state
        self.pool.record(event="step", step=s["version"], **metrics)
        self.pool.status.set(
            state="training",
            step=s["version"],
            version=s["version"],
            samples_trained=s["samples_trained"],
            stale_samples_dropped=s["stale_samples_dropped"],
            duplicates_dropped=s["duplicates_dropped"],
            sequences_spanning_versions=s["sequences_spanning_versions"],
            weight_updates_published=self.publisher.published,
            reward_mean=metrics["reward_mean"],
            loss=metrics["loss"],
        )
        log.info(
            "step %d loss %.4f reward %.3f samples %d stale %d spanning %d (%.1fs)",
            s["version"],
            metrics["loss"],
            metrics["reward_mean"],
            metrics["samples"],
            metrics["stale"],
            metrics["spanning"],
            metrics["step_s"],
        )


def main(argv: list[str] | None = None) -> None:
    pool = start_pool("trainer", argv)
    trainer = Trainer(pool)
    max_steps = pool.cfg.trainer.max_steps
    while trainer.state["version"] < max_steps and not pool.stop.is_set():
        data = collect(
            pool, trainer.consumer, trainer.state["version"], trainer.state["recent_samples"]
        )
        if data is None:
            break
        trainer.report(trainer.step(data))
    trainer.publisher.close(timeout_s=pool.cfg.trainer.transfer_timeout_s)
    pool.status.set(
        state="finished" if trainer.state["version"] >= max_steps else "stopped",
        weight_updates_published=trainer.publisher.published,
    )
    log.info("trainer done at version %d", trainer.state["version"])
