"""What a durable write costs: ``python -m pipeline.bench wait_cost``.

One client publishes rollout-sized entries one after another (an actor's publish:
each waits for its reply) into a real redis-server that has one replica attached, in
three modes, interleaved round by round (the order rotates each round)::

    xadd       a plain XADD (what publish did before XADD-once)
    once       XADD-once (pipeline/streams/durable.py), single mode: no WAIT
    once+wait  XADD-once with WAIT 1 behind it in one pipeline (redis.mode=sentinel,
               redis.min_replicas_acked=1): returns once the replica has the entry

Per mode: the median over rounds of writes/s (with min and max), the median of the
rounds' p50 and p99 write latency, and each round's rate relative to ``xadd`` in the
same round (median, min, max). Primary and replica run with the run's AOF setting
(``--appendfsync``, default always, as the embedded server); both on this machine, so
WAIT measures the replica's apply and acknowledgement over loopback, not a network.

One client waiting for each reply is bound by latency, not by Redis: these rates are
not ceilings. What each mode's write costs Redis at saturation, with enough writes in
flight, is ``python -m pipeline.bench scale --load ceiling``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import redis

from pipeline.bench.common import LoadProbe, device_name, percentile, print_table, write_json
from pipeline.redisd.server import EmbeddedRedis
from pipeline.streams import connect
from pipeline.streams.durable import Durability, attach, once_keys, publish_once

STREAM = "nonstop:bench:rollouts"
MODES = ("xadd", "once", "once+wait")


def start_pair(root: str, appendfsync: str) -> tuple[EmbeddedRedis, EmbeddedRedis]:
    primary = EmbeddedRedis(os.path.join(root, "primary"), appendfsync)
    primary.start()
    replica = EmbeddedRedis(os.path.join(root, "replica"), appendfsync)
    replica.password = primary.password
    replica.extra_args = ["--replicaof", "127.0.0.1", str(primary.port)]
    replica.extra_args += ["--masterauth", primary.password]
    replica.start()
    probe = primary.client(socket_timeout=5)
    deadline = time.monotonic() + 30
    while probe.wait(1, 200) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the replica never came online")
    return primary, replica


def one_round(clients: dict[str, redis.Redis], mode: str, writes: int, payload: bytes, r: int):
    """``writes`` sequential publishes in ``mode``; (writes/s, latencies in ms)."""
    client = clients[mode]
    lat = []
    t0 = time.perf_counter()
    for i in range(writes):
        entry = {"schema": "1", "group": f"{mode}:{r}:{i}", "data": payload}
        t = time.perf_counter()
        if mode == "xadd":
            client.xadd(STREAM, entry)
        else:
            publish_once(client, STREAM, f"{mode}:{r}:{i}", entry)
        lat.append((time.perf_counter() - t) * 1000)
    rate = writes / (time.perf_counter() - t0)
    client.delete(STREAM, *once_keys(STREAM))  # the next round starts from empty keys
    return rate, lat


def summarize(rounds: list[dict]) -> list[dict]:
    rows = []
    for mode in MODES:
        rates = [r[mode]["rate"] for r in rounds]
        ratio = [r[mode]["rate"] / r["xadd"]["rate"] for r in rounds]
        rows.append(
            {
                "mode": mode,
                "writes_per_s": round(statistics.median(rates), 1),
                "rate_min": round(min(rates), 1),
                "rate_max": round(max(rates), 1),
                "p50_ms": round(statistics.median(r[mode]["p50_ms"] for r in rounds), 3),
                "p99_ms": round(statistics.median(r[mode]["p99_ms"] for r in rounds), 3),
                "vs_xadd": round(statistics.median(ratio), 3),
                "vs_xadd_min": round(min(ratio), 3),
                "vs_xadd_max": round(max(ratio), 3),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench wait_cost")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--writes", type=int, default=300, help="publishes per mode per round")
    p.add_argument("--entry-kb", type=float, default=35.0, help="payload size (a group: 35)")
    p.add_argument("--appendfsync", default="always", choices=("always", "everysec"))
    day = datetime.date.today().isoformat()
    p.add_argument("--out", default=f"bench/results/wait-cost-cpu-{day}.json")
    args = p.parse_args(argv)
    payload = os.urandom(int(args.entry_kb * 1024))
    probe = LoadProbe()
    with tempfile.TemporaryDirectory(prefix="wait-cost-") as root:
        primary, replica = start_pair(root, args.appendfsync)
        try:
            clients = {m: connect(primary.url, attempts=3) for m in MODES}
            attach(clients["once+wait"], Durability(replicas=1, timeout_ms=2000))
            for m in MODES:  # warm-up: connections open, scripts cached
                one_round(clients, m, 20, payload, -1)
            rounds = []
            for r in range(args.rounds):
                order = MODES[r % 3 :] + MODES[: r % 3]
                res = {}
                for mode in order:
                    rate, lat = one_round(clients, mode, args.writes, payload, r)
                    res[mode] = {
                        "rate": rate,
                        "p50_ms": percentile(lat, 50),
                        "p99_ms": percentile(lat, 99),
                    }
                rounds.append(res)
                print(
                    f"round {r + 1}/{args.rounds}: "
                    + ", ".join(f"{m} {res[m]['rate']:.0f}/s" for m in order)
                )
            waits = int(primary.client().info("commandstats")["cmdstat_wait"]["calls"])
        finally:
            replica.stop()
            primary.stop()
    rows = summarize(rounds)
    print_table(
        rows,
        [
            "mode",
            "writes_per_s",
            "rate_min",
            "rate_max",
            "p50_ms",
            "p99_ms",
            "vs_xadd",
            "vs_xadd_min",
            "vs_xadd_max",
        ],
    )
    write_json(
        args.out,
        {
            "bench": "wait_cost",
            "machine": device_name("cpu"),
            "load": probe.end(),
            "settings": {**vars(args), "replicas": 1, "wait_timeout_ms": 2000},
            "wait_commands_seen": waits,
            "rows": rows,
            "rounds": rounds,
            "notes": "one client, sequential publishes (each waits for its reply); primary "
            "and replica on this machine (loopback); rounds interleaved, order rotating",
        },
    )
    return 0
