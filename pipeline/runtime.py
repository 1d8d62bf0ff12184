"""What every pool process shares at start-up: arguments, config, logging,
Redis, stop signals, metrics. ``python -m <pool> --config RUN_DIR/config.yaml
--name <pool>-<i> [key=value ...]``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

import redis
import torch

from pipeline.config import load_config, redis_url
from pipeline.streams import Names, connect
from pipeline.telemetry import MetricsFile, PoolStatus


@dataclass
class Pool:
    cfg: Any
    name: str
    role: str
    client: redis.Redis
    names: Names
    stop: threading.Event
    status: PoolStatus
    metrics: MetricsFile

    def record(self, **values) -> None:
        self.metrics.write(pool=self.name, role=self.role, **values)


def start_pool(role: str, argv: list[str] | None = None) -> Pool:
    parser = argparse.ArgumentParser(prog=f"python -m {role}")
    parser.add_argument("--config", required=True, help="the run's config.yaml")
    parser.add_argument("--name", default=role, help="this process's name (stream consumer)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s",
    )
    threads = {
        "actor": cfg.engine.torch_threads,
        "preprocessor": cfg.preprocessor.torch_threads,
        "trainer": cfg.trainer.torch_threads,
    }[role]
    torch.set_num_threads(threads)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    client = connect(redis_url(cfg))
    names = Names(cfg.redis.prefix, cfg.run.name)
    run_dir = cfg.run_dir or "."
    pool = Pool(
        cfg=cfg,
        name=args.name,
        role=role,
        client=client,
        names=names,
        stop=stop,
        status=PoolStatus(client, names, args.name, role),
        metrics=MetricsFile(os.path.join(run_dir, "metrics.jsonl")),
    )
    logging.getLogger(role).info("%s started (pid %d)", args.name, os.getpid())
    return pool


def trainer_version(pool: Pool) -> int:
    value = pool.client.get(pool.names.key("trainer_version"))
    return int(value) if value is not None else 0


def model_path(cfg: Any) -> str:
    """The local model folder: the launcher's materialized path, or materialize now."""
    if cfg.model.path:
        return cfg.model.path
    from pipeline.models import materialize_model

    return materialize_model(cfg.model.name)
