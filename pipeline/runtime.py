"""What every pool process shares at start-up: arguments, config, logging,
Redis, stop signals, metrics, and the heartbeat. ``python -m <pool> --config
RUN_DIR/config.yaml --name <pool>-<i> [key=value ...]``.

The heartbeat thread writes ``heartbeat`` (the process is alive) and
``progress`` (the last time the main loop called :meth:`Pool.tick`) into the
pool's status hash every second, so a watchdog can tell a stopped or hung
pool from a busy one. It also checks that Redis still holds the run: if the
server came back empty, the pool exits with code 3 (EXIT_DATA_LOST) and a
message, rather than looping on missing streams.

Told to stop (SIGTERM, SIGINT), a pool stops at once whatever Redis does
(pipeline/stopping.py): its clients retry a failing command only for a short
budget after the stop, and a pool whose main loop meets a Redis that is gone
while stopping exits 0 with one line (its un-acknowledged entries stay pending
and are read again after a restart). A stop during start-up (still connecting)
exits at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from pipeline.config import load_config, redis_tls, redis_url, refuse_shard_urls
from pipeline.prom import Endpoint, Notifier, serve
from pipeline.redisd.server import UnsafeRedis, check_no_eviction
from pipeline.stopping import NOTHING_LOST, StopEvent, guard, watch
from pipeline.streams import (
    DataLost,
    Names,
    RedisRefused,
    RedisUnavailable,
    check_permissions,
    check_run,
    connect,
    mark_run,
)
from pipeline.streams.durable import Durability, NotReplicated, attach
from pipeline.streams.shards import Shards
from pipeline.telemetry import MetricsFile, PoolStatus

log = logging.getLogger(__name__)
EXIT_DATA_LOST = 3
EXIT_SETUP = 2  # Redis unreachable at start-up: the launcher restarts the pool
EXIT_REFUSED = 4  # Redis refuses the pool (ACL, credentials, eviction): the run stops
EXIT_MISMATCH = 5  # the pools' settings disagree (weights transport or kind): the run stops


@dataclass
class Pool:
    cfg: Any
    name: str
    role: str
    client: redis.Redis
    names: Names
    stop: StopEvent  # a threading.Event that remembers when it was set
    status: PoolStatus
    metrics: MetricsFile
    # when the main loop last called tick(); None while the pool still starts (loads its
    # model, joins): the supervisor then judges it by launch.startup_timeout_s, not by
    # launch.watchdog_s
    last_tick: float | None = None
    shards: Shards | None = None  # the work streams' parts (cluster partitions)
    endpoint: Endpoint | None = None  # /metrics and /health (metrics.http.enabled)
    notifier: Notifier | None = None  # systemd's watchdog ($NOTIFY_SOCKET)

    def __post_init__(self) -> None:
        if self.shards is None:  # no partitions: the one part
            self.shards = Shards(self.client, self.names)

    def record(self, **values) -> None:
        self.metrics.write(pool=self.name, role=self.role, **values)
        if self.endpoint is not None:
            self.endpoint.collector.record(values)

    def tick(self) -> bool:
        """The main loop made progress; returns whether to stop (a handy callback)."""
        self.last_tick = time.time()
        if self.notifier is not None:
            self.notifier.tick(self.last_tick)
        return self.stop.is_set()


def heartbeat(pool: Pool, every_s: float = 1.0) -> None:
    """Runs in a daemon thread for the life of the process: ``heartbeat`` (alive) and,
    once the main loop has ticked, ``progress`` (when it last did). Until then the hash
    has no ``progress`` (a former process's is deleted), which tells the supervisor the
    pool is still starting."""
    cleared = False
    while True:
        try:
            check_run(pool.client, pool.names)  # Redis must still hold the run
            beat = {"heartbeat": time.time(), "pid": os.getpid()}
            if pool.last_tick is not None:
                beat["progress"] = pool.last_tick
            elif not cleared:
                pool.client.hdel(pool.status.key, "progress")
                cleared = True
            pool.client.hset(pool.status.key, mapping=beat)
        except DataLost as e:
            log.error("%s", e)
            logging.shutdown()
            os._exit(EXIT_DATA_LOST)
        except Exception as e:  # a Redis outage: the client retries; say so and go on
            if pool.stop.is_set():
                return  # stopping: the main thread says what Redis did not take
            log.warning("heartbeat failed: %s", e)
        time.sleep(every_s)


def start_pool(
    role: str, argv: list[str] | None = None, describe: Callable[[Any], str] | None = None
) -> Pool:
    parser = argparse.ArgumentParser(prog=f"python -m {role}")
    parser.add_argument("--config", required=True, help="the run's config.yaml")
    parser.add_argument("--name", default=role, help="this process's name (stream consumer)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    try:  # NONSTOP_REDIS_SHARD_URLS: independent shards, replaced by redis.mode=cluster
        refuse_shard_urls()
    except ValueError as e:
        raise RedisRefused(str(e)) from None
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s",
    )
    threads = {
        "actor": cfg.sampling.torch_threads,
        "preprocessor": cfg.preprocessor.torch_threads,
        "trainer": cfg.trainer.torch_threads,
        "evaluator": cfg.eval.torch_threads,
    }[role]
    import torch  # here, not at the top: the launcher imports this module without torch

    if threads == "auto":  # trainer.torch_threads=auto: every CPU it may use, until the
        threads = len(os.sched_getaffinity(0))  # trainer's first step shares them
    torch.set_num_threads(int(threads))
    pin_cpus(role, cfg.pipeline.cpus)
    yield_cores(role, cfg.pipeline.nice)
    stop = StopEvent()
    starting = [True]  # a stop while still connecting: nothing to finish, leave now
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_handler(stop, starting))
    client = guard(_connect(cfg, redis_url(cfg, role)), stop)
    durability = Durability.from_config(cfg, stop)  # sentinel, cluster: WAIT behind work writes
    attach(client, durability)
    names = Names.of(cfg)
    check_permissions(client, names, role, redis_url(cfg, role))  # NOPERM: exit 4 now
    if cfg.redis.mode == "cluster":  # the other partitions: their slots' nodes
        for k in range(1, cfg.redis.shards):
            check_permissions(client, names.part(k), role, redis_url(cfg, role), shard=True)
    check_no_eviction(client)
    mark_run(client, names)
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
        shards=Shards.of(cfg, client, names, args.name),
    )
    _current_stop[:] = [stop]
    starting[0] = False
    # a hung server cannot hold the stop either: cut past the longest blocking read
    watch(lambda: [client], stop, cfg.redis.block_ms / 1000)
    try:  # metrics.http: a bad host or a port in use stops the run (exit 4), in one line
        pool.endpoint = serve(pool)
    except ValueError as e:
        raise RedisRefused(str(e)) from None
    pool.notifier = Notifier()  # READY=1 at the first tick, WATCHDOG=1 after
    threading.Thread(target=heartbeat, args=(pool,), name="heartbeat", daemon=True).start()
    # ``describe(cfg)``: what this pool runs, on its first line (the trainer: its backend)
    detail = f": {describe(cfg)}" if describe is not None else ""
    logging.getLogger(role).info("%s started (pid %d)%s", args.name, os.getpid(), detail)
    return pool


def stop_handler(stop: StopEvent, starting: list[bool]) -> Callable[[int, Any], None]:
    """The pool's SIGTERM/SIGINT handler: set ``stop``, and while ``starting[0]`` (still
    connecting) leave at once (:class:`StoppedAtStartup`). It sets ``stop`` once: a
    second signal (a machine's shutdown SIGTERMs every process, and the launcher then
    SIGTERMs its pools again) runs its handler in the same thread, between two bytecodes
    of the first, which may be holding the Event's lock inside ``set()``: a second
    ``set()`` there would wait for that lock forever (the likely cause of a preprocessor
    that, once in about ten shutdown tests, logged nothing after its SIGTERM and lasted
    until the launcher's SIGKILL; not seen since in 9 runs)."""
    entered = [False]

    def on_stop(signum: int, _frame: Any) -> None:
        if not entered[0]:
            entered[0] = True  # before set(): a signal from here on does not enter it
            stop.set()
        if starting[0]:
            raise StoppedAtStartup(signal.Signals(signum).name)

    return on_stop


def _connect(cfg: Any, url: str) -> redis.Redis:
    """:func:`connect` with the TLS files of ``redis.tls`` / NONSTOP_REDIS_TLS_* for a
    ``rediss://`` URL; a missing file or a TLS setting beside a plain URL is
    :class:`RedisRefused` (one line, exit 4: restarting cannot fix it)."""
    try:
        tls = redis_tls(cfg, url)
    except ValueError as e:
        raise RedisRefused(str(e)) from None
    return connect(url, reconnect_s=cfg.redis.reconnect_s, tls=tls)


def pin_cpus(role: str, cpus: Any) -> None:
    """``pipeline.cpus.<role>``: run this process (and its threads) on those CPUs only."""
    chosen = list(getattr(cpus, role, None) or [])
    if chosen:
        os.sched_setaffinity(0, set(chosen))
        logging.getLogger(role).info("pinned to CPUs %s", sorted(chosen))


def yield_cores(role: str, nice: Any) -> None:
    """``pipeline.nice.<role>``: this process (and what it starts) yields the cores to
    pools with a lower niceness when they compete for them."""
    n = int(getattr(nice, role, 0) or 0)
    if n:
        os.nice(n)
        logging.getLogger(role).info("niceness %d (pipeline.nice.%s)", n, role)


class StoppedAtStartup(BaseException):
    """SIGTERM or SIGINT before the pool was connected: it exits at once (status 0).
    A BaseException, so no ``except Exception`` on the way swallows it."""


_current_stop: list[StopEvent] = []  # the process's pool (one per process), for run_main


def run_main(main) -> None:
    """Entry point of a pool, each exit in one line: a lost run (empty Redis) exits with
    EXIT_DATA_LOST; Redis unreachable at start-up, or a work write the replicas never
    confirmed (pipeline.streams.durable.NotReplicated), with EXIT_SETUP (the launcher tries
    again); Redis refusing the pool (credentials, a command the ACL denies, an evicting
    server or one whose policy may not be read) with EXIT_REFUSED (the run stops). A
    pool told to stop whose Redis (or anything else it uses: vLLM's engine core, which a
    machine's shutdown stops too) fails it meanwhile exits 0 with one line."""
    try:
        main()
    except StoppedAtStartup as e:
        log.info("stopped (%s) while starting", e)
        raise SystemExit(0) from None
    except DataLost as e:
        log.error("%s", e)
        raise SystemExit(EXIT_DATA_LOST) from None
    except (RedisRefused, UnsafeRedis) as e:
        log.error("%s", e)
        raise SystemExit(EXIT_REFUSED) from None
    except (RedisUnavailable, NotReplicated) as e:
        log.error("%s", e)
        raise SystemExit(EXIT_SETUP) from None
    # last: the clauses above keep their exit codes (an except that re-raises ends the
    # search, so a catch-all before them would take their exceptions past them)
    except (redis.ConnectionError, redis.TimeoutError) as e:
        if not (_current_stop and _current_stop[0].is_set()):
            raise
        why = " ".join(str(e).split())
        log.warning("stopped; redis did not answer (%s): %s", why, NOTHING_LOST)
        raise SystemExit(0) from None
    except Exception as e:  # told to stop, what the pool used went first (vLLM's engine)
        if not (_current_stop and _current_stop[0].is_set()):
            raise
        why = " ".join(str(e).split())[:300]
        log.warning("stopped; while stopping: %s: %s (%s)", type(e).__name__, why, NOTHING_LOST)
        raise SystemExit(0) from None


def trainer_version(pool: Pool) -> int:
    value = pool.client.get(pool.names.trainer_version)
    return int(value) if value is not None else 0


def model_path(cfg: Any) -> str:
    """The local model folder: the launcher's materialized path, or materialize now."""
    if cfg.model.path:
        return cfg.model.path
    from pipeline.models import materialize_model

    return materialize_model(cfg.model.name)
