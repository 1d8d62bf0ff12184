"""``python -m pipeline.inspect`` arguments and the watch loop."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import redis

from pipeline.inspect.gather import cluster_partitions, snapshot
from pipeline.inspect.render import render
from pipeline.inspect.replication import replication_snapshot
from pipeline.inspect.target import pick_run, resolve
from pipeline.run.prometheus import targets_of, write_targets
from pipeline.streams import Names, connect
from pipeline.streams.cluster import is_cluster
from pipeline.telemetry import read_statuses

CLEAR = "\x1b[H\x1b[2J"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.inspect",
        description="Streams, consumer groups and pools of a live nonstop-rl run.",
    )
    p.add_argument(
        "--run-dir", help="a run directory (its redis/url or redis/port+auth, and config.yaml)"
    )
    p.add_argument(
        "--url",
        help="redis[s]://[:PASS@]host:port/db, redis[s]+sentinel://[:PASS@]host:port,.../"
        "SERVICE or redis[s]+cluster://[:PASS@]host:port,.../ (default: $NONSTOP_REDIS_URL)",
    )
    for what, help_ in (
        ("ca", "the CA that signs the server's certificate"),
        ("cert", "a client certificate"),
        ("key", "its private key"),
    ):
        p.add_argument(
            f"--tls-{what}",
            metavar="FILE",
            help=f"rediss[+sentinel|+cluster]://: {help_} (default: the run dir's redis/tls, "
            f"$NONSTOP_REDIS_TLS_{what.upper()} or the config's redis.tls.{what})",
        )
    p.add_argument("--config", help="a config.yaml to take redis.prefix and run.name from")
    p.add_argument("--prefix", help="redis.prefix of the run (default: from config, or found)")
    p.add_argument("--run", help="run.name (default: from config, or the only run found)")
    p.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=float,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--prometheus-targets",
        metavar="FILE",
        help="also write Prometheus file-based discovery targets (each pool's metrics_url) "
        "to FILE, at every redraw with --watch (deploy/prometheus/)",
    )
    p.add_argument(
        "--stale-after",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a heartbeat older than this marks a pool as not alive (default 30)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        target = resolve(args)
        client = connect(target.url, attempts=3, tls=target.tls)
        target = pick_run(client, target)
    except (ValueError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = Names(target.prefix, target.run, cluster=is_cluster(target.url))
    prev = None
    if args.watch is not None:
        # Ctrl-C ends the watch even where it started with SIGINT ignored (Python then
        # installs no KeyboardInterrupt handler): a shell without job control starts its
        # background commands so, and their children inherit it (the launcher and the
        # pools install their own handlers already)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            try:
                parts = cluster_partitions(client, names) if names.cluster else []
                snap = snapshot(client, names, args.stale_after, parts)
                rep = replication_snapshot(target.url, client, target.tls)  # sentinel mode
                snap["replication"] = rep
                if args.prometheus_targets:  # each pool's /metrics, for a Prometheus
                    statuses = read_statuses(client, names)
                    write_targets(args.prometheus_targets, targets_of(names.run, statuses))
                text = json.dumps(snap) if args.json else render(snap, prev, target.url)
                prev = snap
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if args.watch is None:
                    print(f"error: redis unreachable: {e}", file=sys.stderr)
                    return 1
                text = f"redis unreachable ({e}); retrying every {args.watch}s"
            if args.watch is not None and not args.json:
                sys.stdout.write(CLEAR)  # a live terminal view: clear the screen, redraw
            print(text, flush=True)
            if args.watch is None:
                return 0
            time.sleep(max(args.watch, 0.05))
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()
