"""The run as a whole: its name and seed (``run``), how its pools run together
(``pipeline``: async or sync, CPU pinning), how the launcher supervises them
(``launch``) and where metrics go (``metrics``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pipeline.config.checks import check_choice


@dataclass
class RunConfig:
    name: str = "math"  # streams and keys are named <redis.prefix>:<run.name>:<stream>
    seed: int = 0


PIPELINE_MODES = ("async", "sync")


@dataclass
class CpusConfig:
    """CPU ids each role's processes are pinned to (os.sched_setaffinity); [] = any."""

    actor: list[int] = field(default_factory=list)
    preprocessor: list[int] = field(default_factory=list)
    trainer: list[int] = field(default_factory=list)
    evaluator: list[int] = field(default_factory=list)


@dataclass
class PipelineConfig:
    # async: pools never wait for each other; sync: actors generate one step's worth of
    # groups with the current weights, then wait for the trainer's next version
    mode: str = "async"
    cpus: CpusConfig = field(default_factory=CpusConfig)  # e.g. pipeline.cpus.actor=[0]
    # sync: when the trainer has waited this long for samples counted in flight while
    # nothing moved, they are taken as lost and a step's worth is generated again
    sync_stall_s: float = 60.0


@dataclass
class LaunchConfig:
    restart_policy: str = "on-failure"  # on-failure: restart a crashed pool; never: stop the run
    max_restarts: int = 5  # per pool, over the whole run
    watchdog_s: float = 120.0  # a pool without heartbeat/progress this long is killed (0: off)
    startup_timeout_s: float = 300.0  # ... or without a first heartbeat this long after start
    progress_interval_s: float = 1.0
    final_sync_timeout_s: float = 60.0  # wait for actors to apply the last version
    stop_timeout_s: float = 15.0


@dataclass
class MetricsConfig:
    """Where metrics go besides ``metrics.jsonl`` (always written)."""

    tensorboard: bool = True  # event files in run_dir/tensorboard/<pool> when installed
    wandb_project: str | None = None  # log to Weights & Biases when set and wandb installed
    wandb_entity: str | None = None


def validate_launch(cfg: Any) -> None:
    """The ``launch`` section."""
    check_choice(cfg, "launch.restart_policy", ("on-failure", "never"))


def validate_pipeline(cfg: Any) -> None:
    """``pipeline.mode`` (sync: a step is made of whole groups) and ``pipeline.cpus``."""
    mode = cfg.pipeline.mode
    if mode not in PIPELINE_MODES:
        raise ValueError(f"pipeline.mode={mode!r} is not supported; use one of {PIPELINE_MODES}")
    g, per_step = cfg.task.group_size, cfg.trainer.samples_per_step
    if mode == "sync" and per_step % g:
        raise ValueError(
            f"pipeline.mode=sync needs trainer.samples_per_step ({per_step}) to be a multiple "
            f"of task.group_size ({g}): a step is made of whole groups"
        )
    for role, cpus in cfg.pipeline.cpus.items():
        if any(c < 0 or c >= (os.cpu_count() or 1) for c in cpus):
            raise ValueError(
                f"pipeline.cpus.{role}={list(cpus)}: give CPU ids in 0..{(os.cpu_count() or 1) - 1}"
            )
