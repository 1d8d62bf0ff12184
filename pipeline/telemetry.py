"""Metrics and liveness shared by every pool.

``metrics.jsonl`` lines in the run directory, a status hash per pool in Redis
(heartbeat, policy version, counters) that the launcher and operators read,
and a rolling window mean.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque

import redis

from pipeline.streams import Names


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
    """Append-only JSON lines, one record per event, flushed each write."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.f = open(path, "a", buffering=1)  # noqa: SIM115

    def write(self, **record) -> None:
        record.setdefault("time", time.time())
        self.f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.f.close()


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class PoolStatus:
    """A pool's status hash ``<prefix>:<run>:status:<name>``: heartbeat and counters."""

    def __init__(self, client: redis.Redis, names: Names, name: str, role: str):
        self.client, self.key = client, names.status(name)
        self.client.hset(
            self.key,
            mapping={
                "role": role,
                "pid": os.getpid(),
                "started": time.time(),
                "heartbeat": time.time(),
            },
        )

    def set(self, **fields) -> None:
        fields["heartbeat"] = time.time()
        self.client.hset(self.key, mapping={k: str(v) for k, v in fields.items()})

    def incr(self, field: str, by: int = 1) -> None:
        self.client.hincrby(self.key, field, by)


def read_statuses(client: redis.Redis, names: Names) -> dict[str, dict[str, str]]:
    out = {}
    for key in client.scan_iter(match=names.status("*"), count=100):
        key = key.decode()
        fields = client.hgetall(key)
        out[key.rsplit(":", 1)[1]] = {k.decode(): v.decode() for k, v in fields.items()}
    return out
