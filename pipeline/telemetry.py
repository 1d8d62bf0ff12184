"""Metrics and liveness shared by every pool.

``metrics.jsonl`` lines in the run directory, a status hash per pool in Redis
(heartbeat, policy version, counters) that the launcher and operators read,
and a rolling window mean. The same metric records also go to TensorBoard event
files (``run_dir/tensorboard/<pool>``) when ``tensorboard`` is installed, and to
Weights & Biases when ``metrics.wandb_project`` is set and ``wandb`` is installed;
neither is ever required. The ``metrics`` settings are read from the run
directory's ``config.yaml`` (beside ``metrics.jsonl``) unless passed in.
"""

from __future__ import annotations

import bisect
import importlib.util
import json
import logging
import os
import socket
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis

from pipeline.streams import Names

log = logging.getLogger(__name__)


class Window:
    """Mean of the last ``size`` values."""

    def __init__(self, size: int = 50):
        self.values: deque[float] = deque(maxlen=size)

    def add(self, *values: float) -> None:
        self.values.extend(values)

    @property
    def mean(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None


class MetricsFile:
    """Append-only JSON lines, one record per event (thread-safe); each record is also
    handed to the optional sinks (TensorBoard, W&B). A record is one ``write(2)`` on an
    O_APPEND descriptor: every pool appends to the same file, and a process killed
    mid-record cannot leave half a line for the next process's line to run into."""

    def __init__(self, path: str, settings: Any = None):
        run_dir = os.path.dirname(path) or "."
        os.makedirs(run_dir, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self.sinks = open_sinks(run_dir, settings)

    def write(self, **record) -> None:
        record.setdefault("time", time.time())
        line = (json.dumps(record) + "\n").encode()
        with self._lock:
            written = os.write(self.fd, line)
            if written != len(line):  # a full disk; never seen for a regular file otherwise
                raise OSError(f"metrics.jsonl: wrote {written} of {len(line)} bytes")
            for sink in list(self.sinks):
                try:
                    sink.write(record)
                except Exception as e:  # a metrics sink never stops a pool
                    log.warning("metrics sink %s failed, dropping it: %s", type(sink).__name__, e)
                    self.sinks.remove(sink)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        os.close(self.fd)


def scalars(record: dict) -> dict[str, float]:
    """A record's numeric fields as ``<event>/<field>`` (lists, text and flags left out)."""
    event = record.get("event", "metric")
    return {
        f"{event}/{k}": float(v)
        for k, v in record.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("time", "step")
    }


class TensorBoardSink:
    """One event-file folder per pool: ``<root>/<pool>``; x axis: the trainer step for
    step records, else the pool's count of that event."""

    def __init__(self, root: str):
        self.root, self.writers, self.counts = root, {}, {}

    def write(self, record: dict) -> None:
        pool = str(record.get("pool", "run"))
        if pool not in self.writers:
            from torch.utils.tensorboard import SummaryWriter

            self.writers[pool] = SummaryWriter(os.path.join(self.root, pool), flush_secs=5)
        key = (pool, record.get("event"))
        step = record.get("step")
        step = step if isinstance(step, int) else self.counts.get(key, 0) + 1
        self.counts[key] = step
        for tag, value in scalars(record).items():
            self.writers[pool].add_scalar(tag, value, step, walltime=record["time"])

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


class WandbSink:
    """One W&B run per pool, grouped by the run directory's name."""

    def __init__(self, project: str, entity: str | None, run_dir: str):
        self.project, self.entity, self.run_dir, self.run = project, entity, run_dir, None

    def write(self, record: dict) -> None:
        if self.run is None:
            import wandb

            self.run = wandb.init(
                project=self.project,
                entity=self.entity,
                group=os.path.basename(os.path.abspath(self.run_dir)),
                name=str(record.get("pool", "run")),
                dir=self.run_dir,
            )
        self.run.log(scalars(record))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def _settings_beside(run_dir: str) -> Any:
    """The ``metrics`` section of the run directory's config.yaml, or None."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return None
    from omegaconf import OmegaConf

    return OmegaConf.select(OmegaConf.load(path), "metrics")


def open_sinks(run_dir: str, settings: Any = None) -> list:
    """The optional sinks that are installed and configured (see the module doc)."""
    settings = settings if settings is not None else _settings_beside(run_dir)
    get = lambda key, default: getattr(settings, key, default) if settings else default  # noqa: E731
    sinks: list = []
    if get("tensorboard", True) and importlib.util.find_spec("tensorboard") is not None:
        sinks.append(TensorBoardSink(os.path.join(run_dir, "tensorboard")))
    project = get("wandb_project", None)
    if project and importlib.util.find_spec("wandb") is not None:
        sinks.append(WandbSink(project, get("wandb_entity", None), run_dir))
    elif project:
        log.warning("metrics.wandb_project=%s but wandb is not installed; no W&B logging", project)
    return sinks


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def surviving_steps(records: list[dict]) -> list[dict]:
    """Trainer step records, without the steps a trainer restart undid: a
    ``resume`` at version v discards earlier records of steps after v."""
    steps: list[dict] = []
    for r in records:
        if r.get("event") == "resume":
            steps = [s for s in steps if s["step"] <= r["version"]]
        elif r.get("event") == "step":
            steps.append(r)
    return steps


class PoolStatus:
    """A pool's status hash ``<prefix>:<run>:status:<name>``: heartbeat and counters."""

    def __init__(self, client: redis.Redis, names: Names, name: str, role: str):
        self.client, self.key = client, names.status(name)
        self.client.hset(
            self.key,
            mapping={
                "role": role,
                "pid": os.getpid(),
                "host": socket.gethostname(),  # pools on one host share its CPUs
                "started": time.time(),
                "heartbeat": time.time(),
            },
        )

    def set(self, **fields) -> None:
        fields["heartbeat"] = time.time()
        self.client.hset(self.key, mapping={k: str(v) for k, v in fields.items()})

    def incr(self, field: str, by: int = 1) -> None:
        """Add to a counter kept in Redis (HINCRBY), so it survives a restart of the pool."""
        self.client.hincrby(self.key, field, by)

    def incr_float(self, field: str, by: float) -> None:
        self.client.hincrbyfloat(self.key, field, by)


def read_statuses(client: redis.Redis, names: Names) -> dict[str, dict[str, str]]:
    out = {}
    for key in client.scan_iter(match=names.status("*"), count=100):
        key = key.decode()
        fields = client.hgetall(key)
        out[key.rsplit(":", 1)[1]] = {k.decode(): v.decode() for k, v in fields.items()}
    return out


GAP_WINDOW = 32  # the usual gap: the median of this many gaps between passes before


@dataclass
class Gap:
    """Around one new version: the gap between the forward passes before and after it,
    and how much longer it was than the usual gap (never below 0), in ms; ``ms`` None:
    no pass before it to measure from."""

    ms: float | None
    usual_ms: float = 0.0
    added_ms: float = 0.0


def added_gap(passes: list[tuple[float, float]], t: float, breaks: list[float]) -> Gap | None:
    """The gap around a version that took effect at ``t`` (perf_counter) among sorted
    (start, end) forward passes; None when no pass has started after ``t`` yet;
    ``Gap(None)`` when none ran before it or generation paused of its own in the gap
    (a time in ``breaks``)."""
    starts = [start for start, _ in passes]
    i = bisect.bisect_right(starts, t)  # passes[i]: the first to start after t
    if i == len(passes):
        return None
    if i == 0 or any(passes[i - 1][1] <= b <= passes[i][0] for b in breaks):
        return Gap(None)
    before = passes[max(0, i - GAP_WINDOW - 1) : i]
    usual = [b[0] - a[1] for a, b in zip(before, before[1:], strict=False)]
    usual_ms = 1000 * statistics.median(usual) if usual else 0.0
    ms = 1000 * (passes[i][0] - passes[i - 1][1])
    return Gap(ms, usual_ms, max(0.0, ms - usual_ms))
