"""How many rollout entries one redis-server carries when Redis itself is the
bottleneck: ``python -m pipeline.bench redis_ceiling``.

The scale bench (scale.py) drives Redis with the pools' own Python code and, on a
2-core machine, runs out of load-generator CPU long before redis-server is busy
(bench/results/scale-cpu-2026-11-24: its main thread idle 73-75% of every level).
Here the load comes from ``redis-benchmark`` (C, Debian's redis-tools), pinned to
the other core, so redis-server's own core saturates::

    redis-benchmark (core 1)  XADD <rollouts> MAXLEN ~ 1000 * <entry> -->  redis-server (core 0),
                              XREVRANGE <rollouts> + - COUNT 1 ------>  a fresh one per level,
                              (mix write+read: a reader of the newest   its AOF as configured
                              entry beside the writer, as fast as it goes)

Each level runs ``--level-s`` seconds on a fresh redis-server (the AOF of a level can
reach GBs); its rate is counted by the server (INFO commandstats), and the server's main
thread's time on a CPU, waiting for one and idle is read from
/proc/PID/task/PID/schedstat over the same window. A level is saturated when that
thread is idle under 5% of the window: the rate it carried is then Redis's ceiling at
the CPU it got. Entries are ``--entry-kb`` bytes (35 KB: one group of 8 samples x
512 completion tokens after 256 prompt tokens, as the scale bench's entries), so
samples/s = entries/s x 8. What this leaves out, and says so in its notes: the
pipeline's other commands per entry (the batches stream, acks, counters, trims),
which the scale bench measured at 41-65 us of redis-server CPU per sample.

The pipeline's own rollouts write in each redis.mode (the XADD-once script, and WAIT 1
behind it with replicas), single, sentinel and cluster side by side, is
``python -m pipeline.bench scale --load ceiling``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import redis

from pipeline.bench.common import LoadProbe
from pipeline.bench.scale.common import main_thread_sched, parse_cpus, pin
from pipeline.redisd.server import EmbeddedRedis

STREAM = "nonstop:bench:rollouts"
SATURATED_IDLE = 0.05  # the main thread idle under this share of the window


def _benchmark(server: EmbeddedRedis, clients: int, pipe: int, command: list[str]):
    """One redis-benchmark process sending ``command`` until it is stopped."""
    args = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(server.port)]
    args += ["-a", server.password, "-c", str(clients), "-P", str(pipe)]
    args += ["-n", "2000000000", "-q", *command]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _calls(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {k.split("_", 1)[1]: int(v["calls"]) for k, v in stats.items()}


def run_level(args, mix: str, clients: int, payload: str) -> dict:
    """One level on a fresh redis-server: rates counted by the server, its main thread's
    run/wait/idle shares, the machine's load."""
    data = tempfile.mkdtemp(prefix="nonstop-ceiling-")
    server = EmbeddedRedis(data, appendfsync=args.appendfsync)
    server.start()
    procs = []
    try:
        pin(server.proc.pid, parse_cpus(args.redis_cpus))
        client = redis.Redis.from_url(server.url, socket_timeout=30)
        write = ["XADD", STREAM, "MAXLEN", "~", "1000", "*", "p", payload]
        procs.append(_benchmark(server, clients, args.pipeline, write))
        if mix == "write+read":
            read = ["XREVRANGE", STREAM, "+", "-", "COUNT", "1"]
            procs.append(_benchmark(server, clients, args.pipeline, read))
        for p in procs:
            pin(p.pid, parse_cpus(args.load_cpus))
        time.sleep(args.warmup_s)
        probe, calls0 = LoadProbe(), _calls(client)
        run0, wait0, t0 = *main_thread_sched(server.proc.pid), time.monotonic()
        time.sleep(args.level_s)
        run1, wait1, t1 = *main_thread_sched(server.proc.pid), time.monotonic()
        calls1, load = _calls(client), probe.end()
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        server.stop()
        shutil.rmtree(data, ignore_errors=True)
    wall = t1 - t0
    xadd = (calls1.get("xadd", 0) - calls0.get("xadd", 0)) / wall
    reads = (calls1.get("xrevrange", 0) - calls0.get("xrevrange", 0)) / wall
    run, wait = (run1 - run0) / wall, (wait1 - wait0) / wall
    idle = max(0.0, 1.0 - run - wait)
    return {
        "mix": mix,
        "clients": clients,
        "pipeline": args.pipeline,
        "appendfsync": args.appendfsync,
        "entries_s": round(xadd, 1),
        "reads_s": round(reads, 1),
        "samples_s": round(xadd * args.group_size, 1),
        "mb_in_s": round(xadd * len(payload) / 1e6, 1),
        "redis_run": round(run, 3),
        "redis_wait": round(wait, 3),
        "redis_idle": round(idle, 3),
        "saturated": idle < SATURATED_IDLE,
        "window_s": round(wall, 2),
        "load": load,
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per mix: the highest rate of a saturated level (the measured ceiling) - None
    when no level saturated (then there is no ceiling, only the highest rate seen)."""
    out = []
    for mix in dict.fromkeys(r["mix"] for r in rows):
        mine = [r for r in rows if r["mix"] == mix]
        sat = [r for r in mine if r["saturated"]]
        best = max(sat, key=lambda r: r["entries_s"]) if sat else None
        out.append(
            {
                "mix": mix,
                "ceiling_entries_s": best["entries_s"] if best else None,
                "ceiling_samples_s": best["samples_s"] if best else None,
                "ceiling_mb_in_s": best["mb_in_s"] if best else None,
                "ceiling_redis_run": best["redis_run"] if best else None,
                "highest_unsaturated_entries_s": max(
                    (r["entries_s"] for r in mine if not r["saturated"]), default=None
                ),
            }
        )
    return out


def table(rows: list[dict], keys: list[str]) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench redis_ceiling")
    p.add_argument("--out", default="bench/results/redis-ceiling.json")
    p.add_argument("--mixes", default="write,write+read")
    p.add_argument("--clients", default="1,2,4,8,16", help="per redis-benchmark, ramped")
    p.add_argument("--pipeline", type=int, default=4, help="commands in flight per client")
    p.add_argument("--entry-kb", type=float, default=35.0)
    p.add_argument("--group-size", type=int, default=8, help="samples per entry")
    p.add_argument("--level-s", type=float, default=6.0)
    p.add_argument("--warmup-s", type=float, default=1.5)
    p.add_argument("--appendfsync", default="everysec", choices=["always", "everysec"])
    p.add_argument("--redis-cpus", default="0")
    p.add_argument("--load-cpus", default="1")
    args = p.parse_args(argv)
    if shutil.which("redis-benchmark") is None:
        raise ValueError("redis-benchmark is not on PATH: apt-get install redis-tools")
    parse_cpus(args.redis_cpus), parse_cpus(args.load_cpus)  # bad lists fail before a run
    payload = "x" * int(args.entry_kb * 1000)
    rows = []
    levels = [int(c) for c in args.clients.split(",")]
    for mix in args.mixes.split(","):
        if mix not in ("write", "write+read"):
            raise ValueError(f"--mixes: {mix!r} is not a mix; use write and/or write+read")
        for i, clients in enumerate(levels):
            row = run_level(args, mix, clients, payload)
            rows.append(row)
            print(
                f"[{mix} {i + 1}/{len(levels)}] clients {clients}: {row['entries_s']:.0f} "
                f"entries/s, {row['mb_in_s']:.0f} MB/s in, redis run {row['redis_run']:.2f} "
                f"wait {row['redis_wait']:.2f} idle {row['redis_idle']:.2f}",
                flush=True,
            )
    summary = summarize(rows)
    keys = ["mix", "clients", "entries_s", "reads_s", "samples_s", "mb_in_s"]
    keys += ["redis_run", "redis_wait", "redis_idle", "saturated"]
    print(table(rows, keys))
    print(table(summary, list(summary[0])))
    payload_out = {
        "bench": "redis_ceiling",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "argv": argv,
        "redis_version": subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True
        ).stdout.strip(),
        "cpu": _cpu_model(),
        "rows": rows,
        "summary": summary,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload_out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"
