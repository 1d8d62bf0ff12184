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
class NiceConfig:
    """Each role's scheduling niceness (os.nice, inherited by what the pool starts: vLLM's
    engine-core process too), 0-19: under contention for the cores the pool with the
    lower value runs first. The math job (+exp=math): the evaluator at 19, running on
    what the other pools leave idle (README, *Cores on one machine*)."""

    actor: int = 0
    preprocessor: int = 0
    trainer: int = 0
    evaluator: int = 0


@dataclass
class PipelineConfig:
    # async: pools never wait for each other; sync: actors generate one step's worth of
    # groups with the current weights, then wait for the trainer's next version
    mode: str = "async"
    cpus: CpusConfig = field(default_factory=CpusConfig)  # e.g. pipeline.cpus.actor=[0]
    nice: NiceConfig = field(default_factory=NiceConfig)  # e.g. pipeline.nice.actor=5
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
    # the pools' malloc: auto (tcmalloc where libtcmalloc_minimal is installed, LD_PRELOAD;
    # vLLM's CPU build asks for it), tcmalloc (required), system (glibc's)
    malloc: str = "auto"


@dataclass
class MetricsHTTPConfig:
    """``metrics.http``: each pool's ``/metrics`` (Prometheus) and ``/health`` endpoint
    (pipeline/prom.py), served on ``host:port`` (port 0: a free port, written to the pool's
    status hash as ``metrics_url`` and to its log)."""

    enabled: bool = False  # metrics.prometheus=true turns it on
    host: str = "127.0.0.1"  # nothing listens past its configured interface
    port: int = 0  # 0: any free port; a fixed port suits one pool per host (systemd)
    # /health answers 503 once the main loop has not ticked this long (0: launch.watchdog_s)
    health_deadline_s: float = 0.0
    every_s: float = 1.0  # how often the pool refreshes what /metrics and /health answer


@dataclass
class MetricsConfig:
    """Where metrics go besides ``metrics.jsonl`` (always written)."""

    http: MetricsHTTPConfig = field(default_factory=MetricsHTTPConfig)
    # the launcher starts Debian's prometheus scraping every pool (pipeline/run/prometheus.py)
    prometheus: bool = False
    prometheus_scrape_s: float = 5.0  # its scrape interval
    tensorboard: bool = True  # event files in run_dir/tensorboard/<pool> when installed
    wandb_project: str | None = None  # log to Weights & Biases when set and wandb installed
    wandb_entity: str | None = None


def validate_metrics(cfg: Any) -> None:
    """``metrics.http`` and ``metrics.prometheus``: numbers in range (the host and a
    fixed port are checked by binding them: pipeline/prom.py)."""
    http = cfg.metrics.http
    if not 0 <= int(http.port) <= 65535:
        raise ValueError(f"metrics.http.port={http.port}: give a TCP port, or 0 for any free one")
    if not str(http.host):
        raise ValueError("metrics.http.host is empty: give the interface's address (127.0.0.1)")
    for key in ("every_s", "health_deadline_s"):
        if float(getattr(http, key)) < 0 or (key == "every_s" and float(http.every_s) == 0):
            raise ValueError(f"metrics.http.{key}={getattr(http, key)}: give a positive number")
    if float(cfg.metrics.prometheus_scrape_s) <= 0:
        raise ValueError(
            f"metrics.prometheus_scrape_s={cfg.metrics.prometheus_scrape_s}: give seconds > 0"
        )


def validate_launch(cfg: Any) -> None:
    """The ``launch`` section."""
    check_choice(cfg, "launch.restart_policy", ("on-failure", "never"))
    check_choice(cfg, "launch.malloc", MALLOCS)
    if cfg.launch.malloc == "tcmalloc" and tcmalloc() is None:
        raise ValueError(
            "launch.malloc=tcmalloc, but libtcmalloc_minimal is not installed here: "
            "apt-get install libtcmalloc-minimal4 (make setup does), or launch.malloc=auto"
        )


MALLOCS = ("auto", "tcmalloc", "system")


def tcmalloc() -> str | None:
    """The installed tcmalloc library's name (for LD_PRELOAD), or None."""
    import ctypes.util

    return ctypes.util.find_library("tcmalloc_minimal")


def validate_pipeline(cfg: Any) -> None:
    """``pipeline.mode`` (sync: a step is made of whole groups), ``pipeline.nice`` and
    ``pipeline.cpus``."""
    mode = cfg.pipeline.mode
    if mode not in PIPELINE_MODES:
        raise ValueError(f"pipeline.mode={mode!r} is not supported; use one of {PIPELINE_MODES}")
    g, per_step = cfg.task.group_size, cfg.trainer.samples_per_step
    if mode == "sync" and per_step % g:
        raise ValueError(
            f"pipeline.mode=sync needs trainer.samples_per_step ({per_step}) to be a multiple "
            f"of task.group_size ({g}): a step is made of whole groups"
        )
    for role, nice in cfg.pipeline.nice.items():
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ValueError(
                f"pipeline.nice.{role}={nice!r}: give a niceness in 0..19 (a higher value "
                "yields the cores to the other pools; below 0 needs root)"
            )
    for role, cpus in cfg.pipeline.cpus.items():
        if any(c < 0 or c >= (os.cpu_count() or 1) for c in cpus):
            raise ValueError(
                f"pipeline.cpus.{role}={list(cpus)}: give CPU ids in 0..{(os.cpu_count() or 1) - 1}"
            )
