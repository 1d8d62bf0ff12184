"""The trainer pool: micro-batches in, new weights out, on ``trainer.world_size`` ranks.

::

    reads   <run>:batches (consumer group "trainer"; rank 0 only)
    writes  <run>:weights announcements + gloo transfer (rank 0's publisher thread),
            <run>:trainer_version, <run>:samples_retired, checkpoints/ (every rank),
            metrics.jsonl and the status hash (rank 0; other ranks a heartbeat)
    blocks  rank 0 on XREADGROUP until trainer.samples_per_step samples are fresh
            enough; the other ranks on rank 0's next plan (trainer/ranks.py),
            each collective bounded by trainer.collective_timeout_s

One optimizer step per ``samples_per_step`` samples (trainer/batches.py
admits them; trainer/step.py computes the loss; trainer/backends/ steps).
The step's entries are acknowledged after the step, and its ``step`` record is
written before the checkpoint that covers it; the batches stream is trimmed
only below the last checkpoint's position, which a restart of the whole rank
group resumes from, with the dedupe window saved alongside.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid

import torch

from pipeline import checkpoint as layout  # where checkpoints are (trainer.checkpoint saves)
from pipeline import lora
from pipeline.config import run_secret
from pipeline.messages import TrainBatch, decode, encode
from pipeline.routing import is_moe, layout_of
from pipeline.runtime import Pool, model_path, start_pool
from pipeline.stopping import final
from pipeline.streams import DATA, REJECTED_HELD, Lua, add_once, durable
from pipeline.streams.shards import open_consumer
from pipeline.telemetry import read_statuses
from trainer import checkpoint
from trainer.backends import describe, describe_line, make_backend
from trainer.batches import (
    StepData,
    collect,
    rejected_held,
    sample_ids,
    stale_by_length,
)
from trainer.cores import AUTO, CoreShare
from trainer.ranks import Plan, Ranks, close, init_ranks, my_share, share_plan
from trainer.step import StepTotals, constant_divisor, sample_metrics, train_step
from trainer.weight_publisher import WeightPublisher

log = logging.getLogger("trainer")
GROUP = "trainer"
# the status-hash field that holds the trainer's own share of samples_retired
RETIRED_FIELD = "samples_retired_by_trainer"
COUNTERS = ("samples_trained", "stale_samples_dropped", "duplicates_dropped", "nonfinite_steps")

# Take back the retirements past the checkpoint's count; run again, it takes back nothing.
# KEYS: samples_retired, the trainer's status hash; ARGV: RETIRED_FIELD, the checkpoint's count
_UNDO_RETIRED = Lua("""
local live = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('INCRBY', KEYS[1], tonumber(ARGV[2]) - live)  -- never "-0": INCRBY refuses it
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return live - tonumber(ARGV[2])
""")


def resolve_device(device: str, local_rank: int) -> str:
    if device == "cuda":
        device = f"cuda:{local_rank}"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"trainer.device={device} but CUDA is not available; use cpu")
        torch.cuda.set_device(torch.device(device))
    return device


def check_keep_routing(cfg, path: str) -> None:
    """Refuse sampling.keep_routing for a dense model (one line, before loading it)."""
    if not cfg.sampling.keep_routing:
        return
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path)
    if not is_moe(hf):
        raise ValueError(
            f"sampling.keep_routing=true but {cfg.model.name} ({hf.model_type}) is a dense "
            "model with no experts to route: set sampling.keep_routing=false or train a "
            "mixture-of-experts model"
        )


class Trainer:
    def __init__(self, pool: Pool):
        self.pool, cfg = pool, pool.cfg
        self.waited_s = 0.0  # main(): how long the trainer waited for the next step's data
        # trainer.torch_threads=auto: threads follow the other pools on this host (cores.py)
        self.cores = None
        if pool.cfg.trainer.torch_threads == AUTO:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # ranks on this host share it
            self.cores = CoreShare(
                pool.cfg,
                lambda: read_statuses(pool.client, pool.names),
                lambda **fields: pool.status.set(**fields),
                pool.name,
                ranks=local,
            )
        t = cfg.trainer
        self.ranks: Ranks = init_ranks(
            t.world_size, t.device, t.collective_timeout_s, need_dist=t.backend == "deepspeed"
        )
        t.device = resolve_device(t.device, self.ranks.local_rank)
        self.ckpt_root = os.path.join(cfg.run_dir or ".", "checkpoints")
        resume_from = layout.latest(self.ckpt_root) if t.resume else None
        check_keep_routing(cfg, model_path(cfg))
        self.backend = make_backend(cfg, self.ranks, model_path(cfg), resume_from)
        self.pad_id = self.backend.tokenizer.pad_token_id
        module = self.backend.engine.module if hasattr(self.backend, "engine") else None
        module = module if module is not None else self.backend.model
        # batches with routes of another model are dead-lettered, never replayed
        self.route_layout = layout_of(module).as_list() if is_moe(module) else []
        self.state = {
            "version": 0,
            "samples_trained": 0,
            "stale_samples_dropped": 0,
            "sequences_spanning_versions": 0,
            "duplicates_dropped": 0,
            "nonfinite_steps": 0,
            "samples_retired": 0,
            "entry_id": "0-0",
            "recent_samples": {},  # sample id -> version that trained it (dedupe window)
        }
        if resume_from:
            self.state |= layout.load_state(resume_from)
        self.consumer = self.publisher = None
        if self.ranks.is_main:
            self._start_main(resume_from)
        if resume_from:
            log.info("resumed from %s at version %d", resume_from, self.state["version"])
            self.publish()

    def _start_main(self, resume_from: str | None) -> None:
        pool, cfg = self.pool, self.pool.cfg
        self.consumer = open_consumer(  # every shard's batches with redis.shards > 1
            pool.shards,
            pool.names,
            pool.names.batches,
            GROUP,
            pool.name,
            TrainBatch,
            block_ms=cfg.redis.block_ms,
            recover_pending=False,  # resume re-reads from the checkpoint's position instead
            dead_maxlen=cfg.redis.dead_letter_maxlen,
        )
        self.dead_seen = 0  # the consumer's dead letters already in the status hash
        self.token = uuid.uuid4().hex  # this process's steps, in the retire script's guard
        if cfg.trainer.resume:
            # re-read from the checkpoint's position (the stream's start without one): the
            # steps after it are undone, and entries a killed trainer held come again
            self.consumer.set_position(self.state["entry_id"])
        if resume_from or pool.client.exists(pool.names.trainer_version):
            # a trainer ran before: its steps after this version are undone
            pool.record(event="resume", version=self.state["version"])
        self._undo_retired(self.state["samples_retired"])
        pool.status.set(**{REJECTED_HELD: 0})  # a killed trainer's rejects come again, unretired
        durable.set_value(pool.client, pool.names.trainer_version, self.state["version"])
        self.checkpoint_id = self.state["entry_id"]
        pool.status.set(**describe(cfg))  # backend, ZeRO stage, ranks, dtype: summary.json
        self.publisher = WeightPublisher(
            pool.client,
            pool.names,
            cfg.trainer.transfer_host,
            cfg.trainer.bucket_mb,
            cfg.trainer.transfer_timeout_s,
            run_secret(),
            status=pool.status,  # the publisher keeps its own counters there (HINCRBY)
            transport=cfg.weights.transport,
            nccl_backend=cfg.weights.nccl_backend,
            kind=lora.KIND_LORA if lora.settings(cfg.model.lora) else lora.KIND_FULL,
        )

    def _undo_retired(self, kept: int) -> None:
        """Take back the retirements of the steps after the checkpoint: their samples come again.

        `samples_retired` is shared: the preprocessors add no-signal drops and dead letters to it.
        The trainer's own share lives in its status hash (RETIRED_FIELD, kept with HINCRBY beside
        each INCRBY), so only the difference between that share and the checkpoint's is taken back;
        the preprocessors' part stays.
        """
        client, names = self.pool.client, self.pool.names
        keys = [names.samples_retired, names.status(self.pool.name)]
        what = "taking back the retirements of undone steps"
        undone = int(_UNDO_RETIRED(client, keys, [RETIRED_FIELD, kept], what))
        if undone:
            log.info("%d retired samples of undone steps come again", undone)

    def publish(self) -> None:
        """Every rank calls this (ZeRO-3 gathers); rank 0 hands the set to the publisher."""
        params = self.backend.full_parameters()
        if self.ranks.is_main:
            self.publisher.submit(self.state["version"], params)

    def next_plan(self) -> Plan:
        """Rank 0 reads the next step's batches; every rank gets the same plan."""
        if not self.ranks.is_main:
            plan = share_plan(self.ranks, None)
            self.pool.tick()
            while not plan.stop and not plan.batches:
                plan = share_plan(self.ranks, None)
                self.pool.tick()
            return plan
        version = self.state["version"]
        idle = lambda: share_plan(self.ranks, Plan(version=version))  # noqa: E731
        self.data = collect(
            self.pool,
            self.consumer,
            version,
            self.state["recent_samples"],
            self.backend.vocab_size,
            idle=idle if self.ranks.world_size > 1 else lambda: None,
            route_layout=self.route_layout,
        )
        if self.data is None:
            return share_plan(self.ranks, Plan(version=version, stop=True))
        batches = self.data.batches
        tokens = sum(s.n_sampled() for b in batches for s in b.samples)
        samples = sum(len(b.samples) for b in batches)
        plan = Plan(
            version=version, batches=[encode(b) for b in batches], tokens=tokens, samples=samples
        )
        return share_plan(self.ranks, plan)

    def step(self, plan: Plan) -> dict:
        """Train on the plan, publish and checkpoint when due; records the step (report)."""
        cfg = self.pool.cfg.trainer
        t0 = time.monotonic()
        mine, slots = my_share(self.ranks, plan)
        first = mine[0] if mine else decode(plan.batches[0], TrainBatch)
        totals = StepTotals(plan.tokens, plan.samples, constant_divisor(self.pool.cfg))
        metrics = train_step(
            self.backend,
            self.ranks,
            mine,
            slots,
            first,
            cfg,
            self.pad_id,
            totals,
            on_micro=self.before_micro,
            version=plan.version,  # the weights this step starts from (kl_actor_* metrics)
        )
        if self.cores is not None:
            self.cores.release()  # idle actors on this host may start new groups again
        if not metrics.pop("applied"):
            return self.skip(plan, metrics)
        metrics.pop("nonfinite_sample_ids")
        s = self.state
        s["version"] = plan.version + 1
        if self.ranks.is_main:
            self._account(metrics)
        if s["version"] % cfg.publish_every == 0 or s["version"] == cfg.max_steps:
            self.publish()
            self.pool.tick()
        metrics["step_s"] = time.monotonic() - t0
        # the wait for this step's data before it (reading, staleness, waiting for groups):
        # the trainer's idle time, summed in summary.json's trainer_wait
        metrics["wait_s"] = self.waited_s
        if self.cores is not None:
            metrics["torch_threads"] = self.cores.take_mean()
        # the step's record before the checkpoint that covers it: a trainer killed after
        # the save resumes past these entries and never re-reads them, so a record written
        # later could be lost with it (and the step's samples with it, in the accounting)
        self.report(metrics)
        if s["version"] % cfg.checkpoint_every == 0 or s["version"] == cfg.max_steps:
            t1 = time.monotonic()
            checkpoint.save(self.ckpt_root, self.backend, s, cfg.keep_checkpoints, self.ranks)
            self.checkpoint_id = s["entry_id"]
            if self.ranks.is_main:
                self.pool.record(
                    event="checkpoint", step=s["version"], checkpoint_s=time.monotonic() - t1
                )
        if self.ranks.is_main:
            self.consumer.trim(keep_after=self.checkpoint_id)
        return metrics

    def before_micro(self) -> None:
        """Before each micro-batch: a long step is progress, not a hang; with
        ``trainer.torch_threads=auto`` the threads the host has free now."""
        self.pool.tick()
        if self.cores is not None:
            self.cores.apply()

    def skip(self, plan: Plan, metrics: dict) -> dict:
        """A step whose loss or gradient was not finite: not applied (the backend left the
        weights and optimizer as they were), no version, no publish, no checkpoint. Rank 0
        dead-letters the step's trained entries with the reason, records a
        ``nonfinite_step`` (the offending sample ids where the loss named them) and counts
        it in ``nonfinite_steps``; the stale samples it held are dropped as usual."""
        s = self.state
        s["nonfinite_steps"] = s.get("nonfinite_steps", 0) + 1
        if not self.ranks.is_main:
            return metrics
        data, offending = self.data, metrics["nonfinite_sample_ids"]
        ids = [sid for b in data.batches for sid in sample_ids(b)]
        reason = (
            f"non-finite step at version {plan.version}: loss {metrics['loss']:.4g}, grad norm "
            f"{metrics['grad_norm']:.4g}; offending samples "
            f"{', '.join(offending[:10]) or 'not named (the gradient alone)'}; the step was "
            "not applied and no version published"
        )
        log.error("%s (%d samples dead-lettered)", reason, len(ids))
        for entry_id, batch in zip(data.batch_entries, data.batches, strict=True):
            self.consumer.dead_letter(entry_id, {DATA: encode(batch)}, reason)
        self.pool.record(
            event="nonfinite_step",
            version=plan.version,
            loss=metrics["loss"],
            grad_norm=metrics["grad_norm"],
            offending_ids=offending,
            dead_ids=ids,
            stale_ids=data.stale_ids,
        )
        self._account_intake(trained=0)
        self.pool.status.set(nonfinite_steps=s["nonfinite_steps"])
        return metrics

    def _account(self, metrics: dict) -> None:
        """Rank 0: counters, dedupe window, ack, samples_retired."""
        s, data = self.state, self.data
        metrics.update(sample_metrics(data.batches))
        metrics["sample_ids"] = [sid for b in data.batches for sid in sample_ids(b)]
        self._account_intake(trained=metrics["samples"])
        s["sequences_spanning_versions"] += metrics["spanning"]
        metrics.update(
            stale=data.stale,
            version=s["version"],
            duplicates=data.duplicates,
            dead_lettered=data.dead,
            stale_ids=data.stale_ids,
            stale_by_length=stale_by_length(data.stale_lengths, self.pool.cfg),
        )

    def _account_intake(self, trained: int) -> None:
        """Rank 0, after a step (applied or not): counters, dedupe window (samples of a
        step not applied too: dead-lettered, a re-read must not train them), ack,
        samples_retired."""
        cfg, s, data = self.pool.cfg.trainer, self.state, self.data
        s["samples_trained"] += trained
        s["stale_samples_dropped"] += data.stale
        s["duplicates_dropped"] += data.duplicates
        s["samples_retired"] += data.retired
        horizon = s["version"] - cfg.max_lag - 2  # older duplicates would be rejected as stale
        recent = {k: v for k, v in s["recent_samples"].items() if v >= horizon}
        s["recent_samples"] = recent | dict.fromkeys(data.sample_ids, s["version"])
        s["entry_id"] = self.consumer.position(s["entry_id"], data.entry_ids)
        durable.set_value(self.pool.client, self.pool.names.trainer_version, s["version"])
        self.consumer.ack(data.entry_ids)
        dead = self.consumer.dead_lettered - self.dead_seen  # entries, like a preprocessor's
        add_once(  # once even when re-sent after a lost reply
            self.pool.client,
            self.pool.names.samples_retired,
            self.pool.names.status(self.pool.name),
            "last_retired_step",
            f"{self.token}:{s['version']}:{s['nonfinite_steps']}",  # a skipped step: no version
            data.retired,
            # rejected_held back to 0 with the retirement that now counts those samples
            # (batches.py: the actors' back-pressure subtracts it from the in-flight count)
            {
                RETIRED_FIELD: data.retired,
                "dead_lettered": dead,
                REJECTED_HELD: -rejected_held(data),
            },
        )
        self.dead_seen = self.consumer.dead_lettered

    def report(self, metrics: dict) -> None:
        if not self.ranks.is_main:
            self.pool.status.set(state="training", version=self.state["version"])
            return
        s = self.state
        self.pool.record(event="step", step=s["version"], **metrics)
        fields = {k: s[k] for k in COUNTERS + ("sequences_spanning_versions",)}
        self.pool.status.set(
            state="training",
            step=s["version"],
            version=s["version"],
            reward_mean=metrics["reward_mean"],
            loss=metrics["loss"],
            **fields,
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

    def finish(self) -> None:
        cfg = self.pool.cfg.trainer
        done = self.state["version"] >= cfg.max_steps
        state = "finished" if done else "stopped"
        if self.ranks.is_main:
            # told to stop: the actors are stopping too, so the last version is not waited
            # for past the stop's final-writes budget (pipeline/stopping.py)
            timeout = (
                cfg.transfer_timeout_s
                if done
                else min(cfg.transfer_timeout_s, self.pool.stop.left())
            )
            self.publisher.close(timeout_s=timeout)
        # stopping with redis gone: one short try; the batches of the unfinished step were
        # not acknowledged and are read again from the checkpoint's position
        final(
            self.pool.stop,
            f"the trainer's {state} status",
            lambda: self.pool.status.set(state=state),
        )
        close(self.ranks)
        log.info("trainer rank %d done at version %d", self.ranks.rank, self.state["version"])


def rank_argv(argv: list[str] | None) -> list[str]:
    """Rank r > 0 is named ``trainer-r`` (rank 0 ``trainer``; pipeline/launch.py
    ``trainer_names`` names them the same, and the status hashes, logs and consumer names
    carry it), also under torchrun where every rank gets the same command line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", 0))
    if rank > 0:
        if "--name" not in argv:
            argv += ["--name", f"trainer-{rank}"]
        elif argv[argv.index("--name") + 1] == "trainer":
            argv[argv.index("--name") + 1] = f"trainer-{rank}"
    return argv


def main(argv: list[str] | None = None) -> None:
    pool = start_pool("trainer", rank_argv(argv), describe=describe_line)  # names the backend
    trainer = Trainer(pool)
    max_steps = pool.cfg.trainer.max_steps
    while trainer.state["version"] < max_steps:
        t0 = time.monotonic()
        plan = trainer.next_plan()
        if plan.stop:
            break
        trainer.waited_s = time.monotonic() - t0  # waiting for this step's data
        trainer.step(plan)  # records the step (report) before its checkpoint
    trainer.finish()


__all__ = ["StepData", "Trainer", "main"]
