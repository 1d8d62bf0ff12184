"""``python -m pipeline.bench scale``: how far Redis carries the pipeline's writes, in each
redis.mode, on this machine.

``--load ceiling`` (the default): each mode's ceiling where Redis itself is the
bottleneck, side by side in one run, modes interleaved round by round (``--rounds``,
the order rotating)::

    single    one EmbeddedRedis (pipeline/redisd/server.py)
    sentinel  RedisHA (pipeline/topology/ha.py): primary, one replica, three sentinels
    cluster   LocalCluster (pipeline/topology/cluster.py): 3 primaries, a replica each;
              ``--partitions`` rollouts streams ({scale.p<k>} hash tags), each on its
              slot's primary

The load is the pools' rollouts write as it goes on the wire (pipeline/streams/
durable.py): EVALSHA of the XADD-once script with a group's id as token and an entry
of real size (an encoded RolloutGroup of ``--group-size`` samples and the actor's plain
fields), and in sentinel and cluster mode ``WAIT 1 timeout`` behind it on the same
connection. ``--writers`` forked processes send it over raw sockets (redis-py's own CPU
per command would make the load, not Redis, the limit on a small machine), at each of
``--levels`` (CONNECTIONSxDEPTH: connections, writes in flight on each). Every
redis-server of a mode (replicas and sentinels too) is pinned to ``--redis-cpus``, the
load and this controller to ``--load-cpus``. Per level, over its window: entries/s
(the primaries' own counts), samples/s, MB/s, each redis-server main thread's share on
a CPU, runnable-waiting and idle (/proc/PID/task/PID/schedstat), the mode's redis CPU
(every process and thread, AOF rewrites included) per sample, the replicas' share of
it, the write (and WAIT) latency, the load average at its start. A level is saturated
when the busiest main thread was idle under 5% of the window; a mode's ceiling in a
round is its best saturated level, and a mode with none has no ceiling here.

``--load pipeline`` / ``--load redis`` (single mode): a ramp of the pools' whole
traffic, ``--actors`` simulated actor processes (RolloutGroups of real size through
the real ``publish`` path, the real counting script per group, open loop at
``--rates`` samples/s, ``--level-s`` each) and downstream either the real preprocessor
processes and a trainer stand-in (``pipeline``: the real batch intake, trainer/
batches.py ``collect``, ACK, ``samples_retired``, trimming; no model) or their Redis
commands without the Python work (``redis``: relays and a drain). A level is sustained
when trained >= 95% of offered with no more than a second of backlog; the same
schedstat test says whether Redis was saturated. On a small machine the Python side is
the limit there (bench/results/scale-cpu-2026-11-24.md), hence ``--load ceiling``.

Subcommands ``actor``, ``trainer``, ``relay`` and ``drain`` are the ramp's own processes.

One module per load: ``ceiling.py`` (``--load ceiling``), ``ramp.py`` (``--load pipeline``
and ``--load redis``), and ``common.py``, what both send and measure with; ``main``
here reads the arguments and runs them.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from pipeline.bench.common import (
    LoadProbe,
    device_name,
    print_table,
    write_json,
)
from pipeline.bench.scale.ceiling import ceiling_main
from pipeline.bench.scale.common import parse_cpus, pin
from pipeline.bench.scale.ramp import (
    COLUMNS,
    Setup,
    markdown,
    notes,
    run_actor,
    run_drain,
    run_relay,
    run_trainer,
    summarize,
)


def main(argv: list[str]) -> int:
    subs = {"actor": run_actor, "trainer": run_trainer, "relay": run_relay, "drain": run_drain}
    if argv and argv[0] in subs:
        subs[argv[0]](argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="python -m pipeline.bench scale")
    p.add_argument("--out", default="bench/results/scale.json")
    p.add_argument(
        "--load",
        default="ceiling",
        help="ceiling (each --modes' Redis ceiling under the durable write load), or the "
        "single-mode ramps pipeline and/or redis, comma-joined",
    )
    p.add_argument("--modes", default="single,sentinel,cluster", help="(--load ceiling)")
    p.add_argument("--rounds", type=int, default=3, help="(--load ceiling) interleaved")
    p.add_argument(
        "--levels",
        default="8x4,32x2,96x2,64x8",
        help="(--load ceiling) CONNECTIONSxDEPTH[@WRITES_PER_S], comma-joined, per mode",
    )
    p.add_argument("--writers", type=int, default=4, help="(--load ceiling) load processes")
    p.add_argument("--partitions", type=int, default=3, help="(--load ceiling) cluster's")
    p.add_argument("--keep", type=int, default=1000, help="(--load ceiling) entries kept")
    p.add_argument("--wait-timeout-ms", type=int, default=2000)
    p.add_argument(
        "--data-dir",
        default="",
        help="(--load ceiling) where the redis-servers' AOFs go (default: the temp dir); "
        "/dev/shm keeps a shared disk's writeback out of the CPU ceiling",
    )
    p.add_argument(
        "--load-nice", type=int, default=0, help="(--load ceiling) nice of the load processes"
    )
    p.add_argument("--warmup-s", type=float, default=1.5)
    p.add_argument("--rates", default="250,500,1000,2000,4000,8000", help="samples/s")
    p.add_argument("--level-s", type=float, default=12.0)
    p.add_argument("--startup-s", type=float, default=20.0)
    p.add_argument("--actors", type=int, default=4)
    p.add_argument("--preprocessors", type=int, default=2, help="(or relays)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--completion-tokens", type=int, default=512)
    p.add_argument("--samples-per-step", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--redis-cpus", default="", help="cores for the redis-servers, e.g. 0")
    p.add_argument("--load-cpus", default="", help="cores for everything else, e.g. 1")
    p.add_argument(
        "--redis-nice",
        type=int,
        default=0,
        help="nice value of the redis-servers (e.g. -20, as root): on a machine other work "
        "shares, the pinned core goes mostly to Redis while it has work",
    )
    p.add_argument(
        "--appendfsync",
        default="everysec",
        help="redis appendfsync (--load ceiling: one value, every mode; else comma-joined, "
        "run side by side)",
    )
    args = p.parse_args(argv)
    args.argv = argv
    parse_cpus(args.redis_cpus), parse_cpus(args.load_cpus)  # bad lists fail before any run
    if args.load == "ceiling":
        if args.appendfsync not in ("always", "everysec"):
            raise ValueError(f"--appendfsync {args.appendfsync!r}: always or everysec")
        if args.rounds < 1 or args.writers < 1 or args.partitions < 1:
            raise ValueError("--rounds, --writers and --partitions must be at least 1")
        return ceiling_main(args)
    rates = [float(r) for r in args.rates.split(",")]
    loads = args.load.split(",")
    if set(loads) - {"pipeline", "redis"}:
        raise ValueError(
            f"--load {args.load!r}: choose ceiling, or pipeline and/or redis (comma-joined)"
        )
    if args.modes != "single,sentinel,cluster" and args.modes != "single":
        raise ValueError("--load pipeline/redis run in single mode only: use --load ceiling")
    if args.load_cpus:
        pin(os.getpid(), parse_cpus(args.load_cpus))  # this controller with the load
    probe, rows = LoadProbe(), []
    with tempfile.TemporaryDirectory(prefix="scale-") as root:
        for load, fsync in ((ld, f) for ld in loads for f in args.appendfsync.split(",")):
            args.load = load
            setup = Setup(args, fsync, root)
            try:
                setup.wait_ready()
                rows += setup.ramp(rates)
            finally:
                setup.close()
    args.load = ",".join(loads)
    del args.argv
    payload = {
        "bench": "scale",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python -m pipeline.bench scale " + " ".join(argv),
        "machine": device_name(),
        "args": vars(args),
        "load": probe.end(),
        "rows": rows,
        "summary": summarize(rows),
        "notes": notes(args, rows),
    }
    print()
    print_table(rows, COLUMNS)
    print()
    print_table(payload["summary"], list(payload["summary"][0]))
    for n in payload["notes"]:
        print(f"- {n}")
    write_json(args.out, payload)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(markdown(payload))
    return 0
