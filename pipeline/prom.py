"""Every pool's ``/metrics`` (Prometheus text format) and ``/health``, and systemd's
watchdog (the sd_notify protocol over ``$NOTIFY_SOCKET``).

::

    reads   the pool's status hash (its counters and gauges), the pool's metric records
            (Pool.record), the lengths, consumer-group lag and pending of the streams
            the pool reads, the published version (trainer rank 0), the main loop's ticks
    writes  every metrics.http.every_s: the exposition text and the health facts into
            RUN_DIR/http/<pool>/ (metrics, health), which the pool's health server
            (pipeline/health_server.py, a child process holding the listening socket)
            answers from
    blocks  on nothing in the main loop: one thread collects (it may wait on Redis),
            another writes the health facts, the server is its own process

Why a child process answers: a pool that hangs, or is SIGSTOPped, cannot answer for
itself. Its server sees the refreshes stop and says so (503, with the reason), as a
liveness check needs; it exits with the pool (after ``linger_s``, so Prometheus scrapes
the final values). What the endpoints show is at most ``every_s`` old.

Names: a status-hash field ``f`` is ``nonstop_<f>`` (``samples_trained``, ``version``,
``dead_lettered``, ``reward_errors``...); the last record of event ``e`` gives
``nonstop_last_<e>_<field>`` (``nonstop_last_step_loss``, ``..._grad_norm``,
``nonstop_last_swap_swap_ms``) and ``nonstop_events_total{event}`` counts them; some
record fields also fill a histogram each (HISTOGRAMS: the actor's swap pauses, added
gaps, staging times and back-pressure waits). With the vllm engine, vLLM's own metrics
(``vllm:*``, which its AsyncLLM keeps in this process's prometheus_client registry) are
re-exported with the pool's labels added (:class:`Reexport`). Labels: run, pool, role
(never a secret: no URL, password or token is ever a label or value).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Histogram,
    Metric,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)
SKIP_FIELDS = {"heartbeat", "pid", "started", "progress", "metrics_url"}
# streams a role reads, with their consumer group (its lag and pending are that role's)
READS = {"preprocessor": ("rollouts", "preprocessor"), "trainer": ("batches", "trainer")}
FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(frozen=True)
class Hist:
    """A histogram filled from one field of one metrics record event."""

    name: str
    doc: str
    scale: float  # the field's unit in seconds
    buckets: tuple[float, ...]
    labels: tuple[str, ...] = ()  # more labels, taken from the record's fields


# (event, field) of a metrics record -> the histogram its value is observed into
HISTOGRAMS = {
    ("swap", "swap_ms"): Hist(
        "nonstop_swap_pause_seconds",
        "generation paused by each weight swap (the swap lock's hold; pause mode: the pause)",
        1e-3,
        FAST,
    ),
    ("swap_gap", "added_gap_ms"): Hist(
        "nonstop_swap_added_gap_seconds",
        "per new version, the gap between the forward passes around it less the median gap "
        "between the passes before it (0 when not longer)",
        1e-3,
        FAST,
    ),
    ("weights", "stage_ms"): Hist(
        "nonstop_weights_stage_seconds",
        "receiving each version into the staging copy while generation goes on",
        1e-3,
        SLOW,
    ),
    ("backpressure", "wait_s"): Hist(
        "nonstop_backpressure_wait_seconds",
        "each time the actor held new groups back, how long, by reason (lag: more than "
        "actor.max_lag versions behind; backlog: actor.max_queue_groups in flight; "
        "cores: the trainer on this host runs its step on the actor's core; drain; "
        "sync: waiting for its share of a sync step; weights: partial weights)",
        1,
        SLOW,
        ("reason",),
    ),
}


def metric_name(*parts: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", "_".join(("nonstop", *parts)))


def number(value: Any) -> float | None:
    """A status or record value as a sample, or None (text, lists, flags as 0/1)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, bytes | str):
        try:
            v = float(value)
        except ValueError:
            return None
        return v if math.isfinite(v) else None
    return None


class PoolCollector:
    """The pool's samples, read at each refresh (Redis round trips: a few per refresh)."""

    def __init__(self, pool: Any):
        self.pool = pool
        self.labels = {"run": pool.names.run, "pool": pool.name, "role": pool.role}
        self.events: Counter = Counter()
        self.last: dict[tuple[str, str], float] = {}
        self.lock = threading.Lock()
        self.histograms = {
            key: Histogram(
                h.name,
                h.doc,
                labelnames=[*self.labels, *h.labels],
                buckets=h.buckets,
                registry=None,
            )
            for key, h in HISTOGRAMS.items()
        }

    def record(self, values: dict) -> None:
        """Pool.record's hook: count the event, keep its numeric fields, observe the
        fields that fill a histogram."""
        event = str(values.get("event", "metric"))
        for (e, field), hist in self.histograms.items():
            x = number(values.get(field)) if e == event else None
            if x is not None:
                spec = HISTOGRAMS[(e, field)]
                extra = {k: str(values.get(k, "")) for k in spec.labels}
                hist.labels(**self.labels, **extra).observe(x * spec.scale)
        with self.lock:
            self.events[event] += 1
            for k, v in values.items():
                x = number(v) if not isinstance(v, str) else None
                if x is not None and k not in ("time", "pool", "role", "event"):
                    self.last[(event, k)] = x

    def _gauge(self, name: str, doc: str, value: float, **extra: str) -> GaugeMetricFamily:
        labels = self.labels | extra
        g = GaugeMetricFamily(name, doc, labels=list(labels))
        g.add_metric(list(labels.values()), value)
        return g

    def collect(self):
        pool, client = self.pool, self.pool.client
        status = {k.decode(): v.decode() for k, v in client.hgetall(pool.status.key).items()}
        if pool.role in ("preprocessor", "trainer"):
            status.setdefault("dead_lettered", "0")  # a count that is 0 until the first
        for field, raw in sorted(status.items()):
            x = number(raw)
            if x is not None and field not in SKIP_FIELDS:
                yield self._gauge(metric_name(field), f"status hash field {field}", x)
        if pool.last_tick is not None:
            yield self._gauge(
                "nonstop_last_tick_timestamp_seconds",
                "when the main loop last ticked",
                pool.last_tick,
            )
        if self.pool.role == "actor":
            for hist in self.histograms.values():
                yield from hist.collect()
        with self.lock:
            events, last = dict(self.events), dict(self.last)
        c = CounterMetricFamily(
            "nonstop_events", "metric records written, by event", labels=[*self.labels, "event"]
        )
        for event, n in sorted(events.items()):
            c.add_metric([*self.labels.values(), event], n)
        yield c
        for (event, field), x in sorted(last.items()):
            yield self._gauge(
                metric_name("last", event, field), f"last {event} record's {field}", x
            )
        if pool.role == "trainer" and pool.name == "trainer":  # rank 0 speaks for the run
            published = client.get(pool.names.published_version)
            yield self._gauge(
                "nonstop_published_version",
                "newest version some actor received",
                float(published or 0),
            )
            yield from self._streams(("dead", None), "dead letters")
        if pool.role in READS:
            yield from self._streams(READS[pool.role], "work")

    def _streams(self, which: tuple[str, str | None], kind: str):
        stream, group = which
        length = GaugeMetricFamily(
            "nonstop_stream_length",
            "entries in the stream (XLEN)",
            labels=[*self.labels, "stream", "partition"],
        )
        lag = GaugeMetricFamily(
            "nonstop_stream_group_lag",
            "entries the consumer group has not read yet",
            labels=[*self.labels, "stream", "partition", "group"],
        )
        pending = GaugeMetricFamily(
            "nonstop_stream_group_pending",
            "entries read and not acknowledged",
            labels=[*self.labels, "stream", "partition", "group"],
        )
        for part in self.pool.shards.parts:
            key = getattr(part.names, stream)
            base = [*self.labels.values(), stream, str(part.k)]
            length.add_metric(base, part.client.xlen(key))
            if group is None:
                continue
            for g in part.client.xinfo_groups(key) if part.client.exists(key) else []:
                name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
                if name == group:
                    pending.add_metric([*base, group], g.get("pending") or 0)
                    lag.add_metric([*base, group], g.get("lag") or 0)
        yield length
        if group is not None:
            yield lag
            yield pending


class Reexport:
    """The families of another registry whose names start with ``prefix`` (vLLM's
    ``vllm:`` metrics, kept in this process's default registry by the AsyncLLM's
    PrometheusStatLogger), with the pool's labels added to every sample."""

    def __init__(self, source: Any, prefix: str, labels: dict[str, str]):
        self.source, self.prefix, self.labels = source, prefix, labels

    def collect(self):
        for family in self.source.collect():
            if not family.name.startswith(self.prefix):
                continue
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labels = {**s.labels, **self.labels}
                out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
            yield out


class Endpoint:
    """The pool's side: the listening socket (bound here, so a bad host or a port in use
    is refused before anything starts), the health server child, the refresh thread."""

    def __init__(self, pool: Any, http: Any, deadline_s: float, linger_s: float):
        self.pool, self.http, self.deadline_s = pool, http, deadline_s
        self.sock = bind(http.host, int(http.port))
        self.port = self.sock.getsockname()[1]
        self.url = f"{_bracket(http.host)}:{self.port}"
        # RUN_DIR/http/<pool>: one per pool name, reused by its restart (nothing left behind)
        self.dir = os.path.join(pool.cfg.run_dir or ".", "http", pool.name)
        os.makedirs(self.dir, exist_ok=True)
        self.collector = PoolCollector(pool)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.registry.register(ProcessCollector(registry=None))
        self.error = ""
        self.collecting: float | None = None  # when the running collection began
        # a collection this long without Redis's answer: /health says redis unreachable
        self.redis_s = max(2.0, 2 * float(http.every_s))
        self.refresh()
        self.server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipeline.health_server",
                str(self.sock.fileno()),
                self.dir,
                str(os.getpid()),
                str(linger_s),
            ],
            pass_fds=[self.sock.fileno()],
        )
        self.sock.close()  # the child holds it now
        pool.client.hset(pool.status.key, "metrics_url", self.url)
        threading.Thread(
            target=self._loop, args=(self.collect,), name="metrics", daemon=True
        ).start()
        threading.Thread(target=self._loop, args=(self.facts,), name="health", daemon=True).start()
        atexit.register(self.refresh)  # the final values, for the last scrape

    def reexport(self, prefix: str, source: Any = None) -> None:
        """Serve the metrics of ``source`` (default: this process's default registry)
        named ``prefix*`` beside the pool's own (the actor: vLLM's, ``vllm:``)."""
        self.registry.register(Reexport(source or REGISTRY, prefix, self.collector.labels))

    def refresh(self) -> None:
        """Collect, then write the health facts (at start and at exit)."""
        self.collect()
        self.facts()

    def collect(self) -> None:
        """The exposition text (a few Redis round trips); /metrics keeps the last one
        while Redis does not answer."""
        self.collecting = time.monotonic()
        try:
            text = generate_latest(self.registry)
            self.error = ""
        except Exception as e:  # Redis gone past the client's retries: /health says so
            self.error = f"redis unreachable: {' '.join(str(e).split())[:200]}"
            text = None
        finally:
            self.collecting = None
        if text is not None:
            _write(os.path.join(self.dir, "metrics"), text)

    def facts(self) -> None:
        """What the health server judges by. Written on its own thread, so a collection
        stuck in the client's retries (Redis restarting: up to redis.reconnect_s) is
        reported as ``redis unreachable`` after ``redis_s``, not as a stalled pool."""
        error, since = self.error, self.collecting
        if not error and since is not None and time.monotonic() - since > self.redis_s:
            error = f"redis unreachable: no answer for {time.monotonic() - since:.0f}s"
        facts = {
            "written": time.time(),
            "tick": self.pool.last_tick,
            "deadline_s": self.deadline_s,
            "error": error,
            "labels": self.collector.labels,
        }
        _write(os.path.join(self.dir, "health"), json.dumps(facts).encode())

    def _loop(self, what) -> None:
        while True:
            time.sleep(float(self.http.every_s))
            try:
                what()
            except Exception as e:  # never stops the pool
                log.warning("metrics refresh failed: %s", e)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; ValueError naming the key for a host that is
    no address of this machine or a port in use."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise ValueError(
            f"metrics.http.host={host}: not an address ({e.strerror}); give an address of "
            "this machine's interface, e.g. 127.0.0.1"
        ) from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(16)
    except OSError as e:
        sock.close()
        if e.errno == 98:  # EADDRINUSE
            raise ValueError(
                f"metrics.http.port={port}: in use on {host}; choose a free port, or 0 for "
                "any free one"
            ) from None
        raise ValueError(
            f"metrics.http.host={host}: cannot listen there ({e.strerror}); give an address "
            "of this machine's interface, e.g. 127.0.0.1"
        ) from None
    return sock


class Notifier:
    """systemd's sd_notify: ``READY=1`` at the main loop's first tick, ``WATCHDOG=1`` at
    most once a second after (each from the main loop, so a hung loop stops pinging).
    Nothing without ``$NOTIFY_SOCKET``."""

    def __init__(self, path: str | None = None, every_s: float = 1.0):
        path = path if path is not None else os.environ.get("NOTIFY_SOCKET", "")
        self.address = "\0" + path[1:] if path.startswith("@") else path
        self.every_s, self.last = every_s, None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if path else None

    def send(self, message: str) -> None:
        if self.sock is None:
            return
        try:
            self.sock.sendto(message.encode(), self.address)
        except OSError as e:  # systemd gone or the socket not ours: never stops the pool
            log.warning("sd_notify %s failed: %s", message, e)

    def tick(self, now: float) -> None:
        if self.sock is None:
            return
        if self.last is None:
            self.send("READY=1")
            self.last = now
        elif now - self.last >= self.every_s:
            self.send("WATCHDOG=1")
            self.last = now


def serve(pool: Any) -> Endpoint | None:
    """Start the pool's endpoint when ``metrics.http.enabled``; ValueError for a bad
    host or a port in use (one line naming the key)."""
    cfg = pool.cfg
    http = cfg.metrics.http
    if not http.enabled:
        return None
    deadline = float(http.health_deadline_s) or float(cfg.launch.watchdog_s) or 120.0
    linger = 2 * float(cfg.metrics.prometheus_scrape_s) + 1 if cfg.metrics.prometheus else 0.0
    endpoint = Endpoint(pool, http, deadline, linger)
    logging.getLogger(pool.role).info(
        "%s: /metrics and /health on http://%s (metrics_url in its status hash)",
        pool.name,
        endpoint.url,
    )
    return endpoint
