"""``python -m pipeline.bench scale --load ceiling`` (the default): each redis.mode's
ceiling where Redis itself is the bottleneck (the package's docstring says how);
``ceiling_main`` runs it, ``Topology`` starts each mode's servers, ``writer`` is a load
process on raw sockets."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import uuid

import numpy as np

from pipeline.bench.common import (
    LoadProbe,
    device_name,
    percentile,
    print_table,
    write_json,
)
from pipeline.bench.scale.common import (
    SATURATED_IDLE,
    VOCAB,
    cpu_busy_each,
    main_thread_sched,
    parse_cpus,
    pin,
    redis_cpu_seconds,
    sample_pool,
)

# ---------------------------------------------------------------- ceilings per mode
MODES = ("single", "sentinel", "cluster")
RUN = "scale"  # the run name in the keys: {scale.p0..2} fall on the 3 primaries' slot ranges
CEILING_COLUMNS = [
    "round", "mode", "level", "entries_s", "samples_s", "mb_s", "write_p50_ms",
    "write_p99_ms", "wait_p50_ms", "wait_p99_ms", "main_idle_min", "saturated",
    "main_us_per_sample", "redis_us_per_sample", "redis_cpu", "replica_cpu_share", "core_others",
    "writers_cpu", "load_avg_1m",
]  # fmt: skip
INCOMPLETE = object()


def _bulk(v) -> bytes:
    v = v if isinstance(v, bytes) else str(v).encode()
    return b"$%d\r\n%s\r\n" % (len(v), v)


def resp(*args) -> bytes:
    """One command in the Redis protocol (what redis-py sends for it)."""
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


def parse_reply(buf: bytes, pos: int):
    """One reply at ``pos``: (value, next position), or (INCOMPLETE, pos). An error reply
    is a redis.ResponseError value."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return INCOMPLETE, pos
    kind, line = buf[pos : pos + 1], buf[pos + 1 : end]
    if kind == b":":
        return int(line), end + 2
    if kind == b"+":
        return line, end + 2
    if kind == b"-":
        import redis

        return redis.ResponseError(line.decode(errors="replace")), end + 2
    if kind == b"$":
        n = int(line)
        if n < 0:
            return None, end + 2
        stop = end + 2 + n
        return (INCOMPLETE, pos) if len(buf) < stop + 2 else (buf[end + 2 : stop], stop + 2)
    if kind == b"*":
        items, p = [], end + 2
        for _ in range(max(int(line), 0)):
            v, p2 = parse_reply(buf, p)
            if v is INCOMPLETE:
                return INCOMPLETE, pos
            items.append(v)
            p = p2
        return items, p
    raise ValueError(f"not a Redis reply at byte {pos}: {buf[pos : pos + 20]!r}")


class DurableWrite:
    """The bytes of one rollouts write as the pools send it (pipeline/streams/durable.py):
    the XADD-once script (EVALSHA: the stream, its once keys, the group id as the token,
    the cap, the entry's fields) and, in sentinel and cluster mode, ``WAIT replicas
    timeout`` behind it on the same connection; single mode sends the script alone."""

    def __init__(self, stream: str, entry: dict, replicas: int, timeout_ms: int):
        from pipeline.streams.durable import _XADD_ONCE, ONCE_CAP, once_keys

        self.script = _XADD_ONCE
        keys = [stream, *once_keys(stream)]
        tail = [ONCE_CAP] + [x for kv in entry.items() for x in kv]
        self.head = b"*%d\r\n" % (4 + len(keys) + len(tail))
        self.head += b"".join(_bulk(a) for a in ("EVALSHA", _XADD_ONCE.sha, len(keys), *keys))
        self.tail = b"".join(_bulk(a) for a in tail)
        self.tail += resp("WAIT", replicas, timeout_ms) if replicas else b""
        self.replies, self.replicas = (2 if replicas else 1), replicas
        self.size = sum(len(k) + len(_bulk(v)) - 5 for k, v in entry.items())  # about

    def unit(self, token: bytes) -> bytes:
        return self.head + _bulk(token) + self.tail


def rollout_entry(args) -> dict:
    """A rollouts entry of real size and shape: an encoded RolloutGroup and the plain
    fields an actor writes beside it (actor/publish.py)."""
    from pipeline.messages import SCHEMA_VERSION, RolloutGroup, encode, pack_i32

    rng = np.random.default_rng(0)
    (samples,) = sample_pool(rng, 1, args.group_size, args.completion_tokens)
    group = RolloutGroup(
        schema=SCHEMA_VERSION, group_id="g", actor="actor-0", problem_id="p",
        prompt_ids=pack_i32(rng.integers(0, VOCAB, args.prompt_tokens)), samples=samples,
        temperature=1.0, created=time.time(),
    )  # fmt: skip
    return {
        "schema": str(SCHEMA_VERSION), "group": "g", "actor": "actor-0", "problem": "p",
        "versions": "0-1", "reward": "0.500",
        "tokens": str(args.group_size * args.completion_tokens), "data": encode(group),
    }  # fmt: skip


def parse_levels(text: str) -> list[tuple[int, int, float | None]]:
    """``CxD[@R]`` comma-joined: C connections, D writes in flight on each, at most R
    writes/s in all (none: as fast as replies come)."""
    out = []
    for part in text.split(","):
        spec, _, rate = part.partition("@")
        try:
            c, d = (int(x) for x in spec.lower().split("x"))
            r = float(rate) if rate else None
        except ValueError:
            raise ValueError(
                f"--levels {part!r}: give CONNECTIONSxDEPTH[@WRITES_PER_S], e.g. 8x4 or 1x1@50"
            ) from None
        if c < 1 or d < 1 or (r is not None and r <= 0):
            raise ValueError(f"--levels {part!r}: connections, depth and rate must be positive")
        out.append((c, d, r))
    return out


def _connect(host: str, port: int, password: str, timeout_s: float = 10.0):
    import socket

    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(resp("AUTH", password))
    buf = b""
    while b"\r\n" not in buf:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError(f"127.0.0.1:{port} closed the connection at AUTH")
        buf += chunk
    if not buf.startswith(b"+OK"):
        raise ConnectionError(f"AUTH on port {port} failed: {buf.strip()!r}")
    return sock


def writer(targets, depth: int, rate: float | None, tag: str, t_start: float, t_end: float,
           cpus, nice: int, out) -> None:  # fmt: skip
    """A load process: one connection per ``targets`` entry ((port, password, DurableWrite)),
    each keeping ``depth`` writes in flight (at most ``rate`` writes/s in all) from
    ``t_start`` to ``t_end`` (wall clock); puts (done times, latencies in ms, errors, the
    first error, WAITs short of their replicas, its own CPU seconds) on ``out``."""
    import selectors
    from collections import deque

    if cpus:
        os.sched_setaffinity(0, cpus)
    if nice:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    sel = selectors.DefaultSelector()
    conns = []
    for k, (port, password, w) in enumerate(targets):
        sock = _connect("127.0.0.1", port, password)
        state = {"sock": sock, "w": w, "buf": b"", "flight": deque(), "part": [], "k": k}
        conns.append(state)
        sel.register(sock, selectors.EVENT_READ, state)
    done, lat, waited, errors, first, short, seq = [], [], [], 0, None, 0, 0
    time.sleep(max(0.0, t_start - time.time()))
    t0, cpu0 = time.time(), time.process_time()

    def fill(c, now: float) -> None:
        """Top ``c`` up to ``depth`` writes in flight (within the rate), one send."""
        nonlocal seq
        units = []
        while len(c["flight"]) + len(units) < depth and (rate is None or seq < (now - t0) * rate):
            seq += 1
            units.append(c["w"].unit(f"{tag}:{c['k']}:{seq}".encode()))
        if units:
            c["sock"].sendall(b"".join(units))
            c["flight"].extend([time.perf_counter()] * len(units))

    for c in conns:
        fill(c, t0)
    while (now := time.time()) < t_end:
        if rate is not None:  # paced: top every connection up as time allows
            for c in conns:
                fill(c, now)
        for key, _ in sel.select(timeout=0.01 if rate else 0.05):
            c = key.data
            chunk = c["sock"].recv(1 << 16)
            if not chunk:
                raise ConnectionError("redis-server closed a load connection")
            buf, pos = c["buf"] + chunk, 0
            while True:
                value, pos2 = parse_reply(buf, pos)
                if value is INCOMPLETE:
                    break
                pos = pos2
                c["part"].append(value)
                if len(c["part"]) == 1:
                    c["first_at"] = time.perf_counter()  # the script's reply
                if len(c["part"]) < c["w"].replies:
                    continue
                replies, c["part"] = c["part"], []
                sent = c["flight"].popleft()
                bad = next((r for r in replies if isinstance(r, Exception)), None)
                if bad is not None:
                    errors += 1
                    first = first or str(bad)
                elif c["w"].replicas and replies[-1] < c["w"].replicas:
                    short += 1
                else:
                    done.append(time.time())
                    t = time.perf_counter()
                    lat.append((t - sent) * 1e3)
                    waited.append((t - c["first_at"]) * 1e3)
            c["buf"] = buf[pos:]
            if rate is None:
                fill(c, now)
    cpu = time.process_time() - cpu0
    for c in conns:
        c["sock"].close()
    out.put({"done": done, "lat": lat, "waited": waited, "errors": errors,
             "first_error": first, "short": short, "cpu_s": cpu,
             "wall_s": time.time() - t0})  # fmt: skip


class Topology:
    """One mode's redis-servers, pinned to ``--redis-cpus``: ``single`` an EmbeddedRedis,
    ``sentinel`` RedisHA (primary, replica, 3 sentinels), ``cluster`` LocalCluster
    (3 primaries, a replica each) with ``--partitions`` rollouts streams, one per
    partition's hash tag, each written on its slot's primary."""

    def __init__(self, mode: str, args, root: str):
        from pipeline.redisd.server import EmbeddedRedis
        from pipeline.streams import Names
        from pipeline.topology.cluster import LocalCluster
        from pipeline.topology.ha import RedisHA

        self.mode, self.args = mode, args
        d = os.path.join(root, mode)
        if mode == "single":
            self.impl = EmbeddedRedis(d, appendfsync=args.appendfsync)
        elif mode == "sentinel":
            self.impl = RedisHA(d, appendfsync=args.appendfsync)
        else:
            self.impl = LocalCluster(d, appendfsync=args.appendfsync)
        self.impl.start()
        if mode == "single":
            self.nodes, self.extra_pids = [self.impl], []
        else:
            self.nodes = list(self.impl.nodes)
            self.extra_pids = [p.pid for p in getattr(self.impl, "sentinel_procs", []) if p]
        self.password = self.nodes[0].password
        cpus = parse_cpus(args.redis_cpus)
        for pid in [n.proc.pid for n in self.nodes] + self.extra_pids:
            pin(pid, cpus)
            for tid in os.listdir(f"/proc/{pid}/task") if args.redis_nice else ():
                os.setpriority(os.PRIO_PROCESS, int(tid), args.redis_nice)
        self.clients = {n.port: n.client(socket_timeout=10) for n in self.nodes}
        roles = {p: c.execute_command("ROLE")[0] for p, c in self.clients.items()}
        self.primaries = [n for n in self.nodes if roles[n.port] in (b"master", "master")]
        self.replicas = [n for n in self.nodes if n not in self.primaries]
        parts = args.partitions if mode == "cluster" else 1
        self.streams = [Names("nonstop", RUN, mode == "cluster", k).rollouts for k in range(parts)]
        self.port_of = {s: self._serving(s) for s in self.streams}
        for port in set(self.port_of.values()):  # the script cached, as after a pool's first
            self.clients[port].script_load(_xadd_source())

    def _serving(self, key: str) -> int:
        if self.mode != "cluster":
            return self.primaries[0].port
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        for lo, hi, primary, *_ in self.clients[self.primaries[0].port].execute_command(
            "CLUSTER SLOTS"
        ):
            if lo <= slot <= hi:
                return int(primary[1])
        raise RuntimeError(f"no cluster node serves slot {slot} of {key}")

    def targets(self, conns: int, entry: dict) -> list[tuple[int, str, DurableWrite]]:
        """Connection k writes partition k mod partitions, on its slot's primary."""
        replicas = 0 if self.mode == "single" else 1
        timeout = self.args.wait_timeout_ms
        writes = {s: DurableWrite(s, entry, replicas, timeout) for s in self.streams}
        out = []
        for k in range(conns):
            s = self.streams[k % len(self.streams)]
            out.append((self.port_of[s], self.password, writes[s]))
        return out

    def trim(self) -> None:
        """Keep each stream short (the pipeline trims what its consumers acknowledged)."""
        for s, port in self.port_of.items():
            self.clients[port].xtrim(s, maxlen=self.args.keep, approximate=True)

    def snapshot(self) -> dict:
        pids = [n.proc.pid for n in self.nodes]
        calls, waits = {}, {}
        for n in self.primaries:
            stats = self.clients[n.port].info("commandstats")
            calls[n.port] = int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
            waits[n.port] = int(stats.get("cmdstat_wait", {}).get("calls", 0))
        return {
            "time": time.time(),
            "sched": {n.port: main_thread_sched(n.proc.pid) for n in self.nodes},
            "cpu": {n.port: redis_cpu_seconds(n.proc.pid) for n in self.nodes},
            "extra_cpu": sum(redis_cpu_seconds(p) for p in self.extra_pids),
            "calls": calls,
            "waits": waits,
            "core_busy": cpu_busy_each(),
            "pids": pids,
        }

    def stop(self) -> None:
        self.impl.stop()


def _mem_gib() -> float:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")


def _xadd_source() -> str:
    from pipeline.streams.durable import _XADD_ONCE

    return _XADD_ONCE.source


def run_level(topo: Topology, args, entry: dict, level, rnd: int) -> dict:
    """One level on ``topo``: ``--writers`` load processes (pinned to ``--load-cpus``)
    share the level's connections; after ``--warmup-s`` the window of ``--level-s``
    seconds, over which every figure is taken: writes/s counted by the primaries
    (INFO commandstats), each redis-server main thread's run/wait/idle (schedstat),
    the redis-servers' CPU, the write latency (a write and its WAIT: sent to reply)."""
    import multiprocessing as mp
    from queue import Empty

    conns, depth, rate = level
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    targets = topo.targets(conns, entry)
    nproc = min(args.writers, conns)
    load_avg = os.getloadavg()
    t_start = time.time() + 0.5  # the writers fork and connect before it
    t_a = t_start + args.warmup_s
    t_b = t_a + args.level_s
    procs = [
        ctx.Process(
            target=writer,
            args=(
                targets[i::nproc],
                depth,
                rate / nproc if rate else None,
                f"{uuid.uuid4().hex[:8]}.{i}",
                t_start,
                t_b + 0.3,
                parse_cpus(args.load_cpus),
                args.load_nice,
                queue,
            ),
        )
        for i in range(nproc)
    ]
    for p in procs:
        p.start()
    try:
        while time.time() < t_a:
            topo.trim()
            time.sleep(min(0.2, max(0.0, t_a - time.time())))
        s0 = topo.snapshot()
        while time.time() < t_b:
            time.sleep(min(0.2, max(0.0, t_b - time.time())))
            topo.trim()
        s1 = topo.snapshot()
        results = []
        deadline = time.monotonic() + 60
        while len(results) < len(procs):
            try:
                results.append(queue.get(timeout=1))
            except Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{topo.mode} {conns}x{depth}: a load process failed (exit codes "
                        f"{dead}; its traceback is above) or sent nothing in 60 s"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    wall = s1["time"] - s0["time"]
    lat = [
        x
        for r in results
        for t, x in zip(r["done"], r["lat"], strict=True)
        if s0["time"] <= t <= s1["time"]
    ]
    waited = [
        x
        for r in results
        for t, x in zip(r["done"], r["waited"], strict=True)
        if s0["time"] <= t <= s1["time"]
    ]
    has_wait = bool(topo.replicas) and bool(waited)
    writes = sum(s1["calls"][p] - s0["calls"][p] for p in s1["calls"]) / wall
    waits = sum(s1["waits"][p] - s0["waits"][p] for p in s1["waits"]) / wall
    run = {p: (s1["sched"][p][0] - s0["sched"][p][0]) / wall for p in s1["sched"]}
    wait = {p: (s1["sched"][p][1] - s0["sched"][p][1]) / wall for p in s1["sched"]}
    idle = {p: max(0.0, 1 - run[p] - wait[p]) for p in run}
    cpu = {p: (s1["cpu"][p] - s0["cpu"][p]) / wall for p in s1["cpu"]}
    extra = (s1["extra_cpu"] - s0["extra_cpu"]) / wall
    redis_cpu = sum(cpu.values()) + extra
    core = [(y - x) / wall for x, y in zip(s0["core_busy"], s1["core_busy"], strict=True)]
    rc = sorted(parse_cpus(args.redis_cpus) or [])
    prim = [n.port for n in topo.primaries]
    samples = writes * args.group_size
    replica_cpu = sum(cpu[n.port] for n in topo.replicas)
    per = lambda x: round(x / samples * 1e6, 2) if samples else None  # noqa: E731
    return {
        "round": rnd,
        "mode": topo.mode,
        "level": f"{conns}x{depth}" + (f"@{rate:g}" if rate else ""),
        "partitions": len(topo.streams),
        "entries_s": round(writes, 1),
        "samples_s": round(samples, 1),
        "waits_s": round(waits, 1),
        "mb_s": round(writes * topo.targets(1, entry)[0][2].size / 1e6, 1),
        "write_p50_ms": round(percentile(lat, 50), 3) if lat else None,
        "write_p99_ms": round(percentile(lat, 99), 3) if lat else None,
        "wait_p50_ms": round(percentile(waited, 50), 3) if has_wait else None,
        "wait_p99_ms": round(percentile(waited, 99), 3) if has_wait else None,
        "main_run_each": {str(p): round(run[p], 3) for p in run},
        "main_wait_each": {str(p): round(wait[p], 3) for p in wait},
        "main_idle_each": {str(p): round(idle[p], 3) for p in idle},
        "main_idle_min": round(min(idle.values()), 3),
        "saturated": bool(min(idle.values()) < SATURATED_IDLE),
        "main_us_per_sample": per(sum(run[p] for p in prim)),
        "redis_us_per_sample": per(redis_cpu),
        "redis_cpu": round(redis_cpu, 3),
        "replica_cpu": round(replica_cpu, 3),
        "replica_cpu_share": round(replica_cpu / redis_cpu, 3) if redis_cpu else None,
        "sentinel_cpu": round(extra, 3),
        "core_others": round(sum(core[c] for c in rc) - redis_cpu, 3) if rc else None,
        "load_cpu": round(sum(core[c] for c in parse_cpus(args.load_cpus) or []), 3),
        "writers_cpu": round(sum(r["cpu_s"] / r["wall_s"] for r in results), 3),
        "load_avg_1m": round(load_avg[0], 2),
        "load_avg": [round(x, 2) for x in load_avg],
        "errors": sum(r["errors"] for r in results),
        "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
        "wait_short": sum(r["short"] for r in results),
        "window_s": round(wall, 2),
    }


def ceilings(rows: list[dict]) -> dict:
    """Per mode and round: the ceiling, the highest rate of a level whose busiest
    redis-server main thread was saturated (None when no level was: then there is no
    ceiling), and the best level, the highest rate seen (saturated or not: its CPU per
    sample is the mode's cost). Per mode the medians over rounds (ceiling min-max
    beside); per round each mode's ratio to single, of the ceilings (rounds where both
    saturated) and of the Redis CPU per sample at the best levels, median and min-max."""
    import statistics

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    rounds = sorted({r["round"] for r in rows})
    top: dict[tuple[str, int], dict | None] = {}
    best: dict[tuple[str, int], dict] = {}
    for m in modes:
        for k in rounds:
            mine = [r for r in rows if r["mode"] == m and r["round"] == k]
            sat = [r for r in mine if r["saturated"]]
            top[m, k] = max(sat, key=lambda r: r["entries_s"]) if sat else None
            best[m, k] = max(mine, key=lambda r: r["entries_s"])

    def spread(xs: list) -> tuple:
        if not xs:
            return None, None, None
        return round(statistics.median(xs), 3), round(min(xs), 3), round(max(xs), 3)

    out: dict[str, list] = {"per_mode": [], "ratios": []}
    for m in modes:
        tops = [top[m, k] for k in rounds if top[m, k] is not None]
        bests = [best[m, k] for k in rounds]
        med = lambda key, t: spread([r[key] for r in t if r[key] is not None])  # noqa: E731
        e, us = med("entries_s", tops), med("redis_us_per_sample", bests)[0]
        out["per_mode"].append(
            {
                "mode": m,
                "saturated_rounds": f"{len(tops)}/{len(rounds)}",
                "ceiling_entries_s": e[0], "ceiling_min": e[1], "ceiling_max": e[2],
                "ceiling_samples_s": med("samples_s", tops)[0],
                "ceiling_mb_s": med("mb_s", tops)[0],
                "best_entries_s": med("entries_s", bests)[0],
                "best_main_idle_min": med("main_idle_min", bests)[0],
                "main_us_per_sample": med("main_us_per_sample", bests)[0],
                "redis_us_per_sample": us,
                "projection_per_core_samples_s": round(1e6 / us) if us else None,
                "redis_cpu": med("redis_cpu", bests)[0],
                "replica_cpu_share": med("replica_cpu_share", bests)[0],
                "write_p50_ms": med("write_p50_ms", bests)[0],
                "write_p99_ms": med("write_p99_ms", bests)[0],
                "wait_p50_ms": med("wait_p50_ms", bests)[0],
                "wait_p99_ms": med("wait_p99_ms", bests)[0],
            }
        )  # fmt: skip
    for m in modes:
        if m == "single" or "single" not in modes:
            continue
        for what, table, key in (
            ("ceiling", top, "entries_s"),
            ("best_entries_s", best, "entries_s"),
            ("redis_us_per_sample", best, "redis_us_per_sample"),
        ):
            per_round = []
            for k in rounds:
                a, b = table[m, k], table["single", k]
                ok = a and b and a[key] and b[key]
                per_round.append(round(a[key] / b[key], 3) if ok else None)
            med, lo, hi = spread([x for x in per_round if x is not None])
            out["ratios"].append(
                {"ratio": f"{m}/single", "of": what, "per_round": per_round,
                 "median": med, "min": lo, "max": hi}
            )  # fmt: skip
    return out


def ceiling_markdown(payload: dict) -> str:
    a = payload["args"]
    lines = [
        f"# scale bench: Redis ceilings per mode ({payload['date']})",
        "",
        f"`{payload['command']}`",
        "",
        f"Machine: {payload['machine']}; {payload['redis_version']}. Redis on core(s) "
        f"{a['redis_cpus']}, the load (and this controller) on {a['load_cpus']} (nice "
        f"{a['redis_nice']} / {a['load_nice']}, the bench's own autogroup at "
        f"{a['redis_nice']}); appendfsync {a['appendfsync']}, data in "
        f"{a['data_dir'] or 'the temp dir'}; entries {payload['entry_bytes']} bytes (a group of "
        f"{a['group_size']} x ~{a['completion_tokens']} completion tokens after "
        f"{a['prompt_tokens']} prompt tokens); {a['rounds']} rounds, modes interleaved in "
        f"each; levels {a['levels']}; {a['warmup_s']} s warm-up + {a['level_s']} s window "
        f"per level. Machine load over the run: {payload['load']}",
        "",
        "## Every level",
        "",
        "| " + " | ".join(CEILING_COLUMNS) + " |",
        "|" + "---|" * len(CEILING_COLUMNS),
    ]
    lines += ["| " + " | ".join(str(r[c]) for c in CEILING_COLUMNS) + " |" for r in payload["rows"]]
    per = payload["ceilings"]["per_mode"]
    lines += ["", "## Ceilings (median over rounds of each round's saturated best)", ""]
    lines += ["| " + " | ".join(per[0]) + " |", "|" + "---|" * len(per[0])]
    lines += ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in per]
    rat = payload["ceilings"]["ratios"]
    if rat:
        lines += ["", "## Ratios, per round (side by side)", ""]
        lines += ["| " + " | ".join(rat[0]) + " |", "|" + "---|" * len(rat[0])]
        lines += ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in rat]
    lines += ["", *[f"- {n}" for n in payload["notes"]], ""]
    return "\n".join(lines)


def ceiling_notes(args) -> list[str]:
    return [
        "load: the pools' rollouts write as they send it (pipeline/streams/durable.py), "
        "byte for byte on the wire: EVALSHA of the XADD-once script with the group id as "
        "token; sentinel and cluster put WAIT 1 "
        f"{args.wait_timeout_ms} behind it on the same connection (one pipeline), cluster "
        "on the slot's primary. Sent by --writers forked Python processes over raw "
        "sockets (no redis-py: its per-command CPU would saturate the load core first); "
        "the controller trims each stream to ~--keep entries every 0.2 s, as consumers do",
        f"saturated: the busiest redis-server main thread (primaries and replicas) idle "
        f"under {SATURATED_IDLE:.0%} of the window (schedstat: 1 - on CPU - runnable "
        "waiting). A mode's ceiling in a round is its best saturated level; a mode with "
        "no saturated level has no ceiling here (None), only its highest_unsaturated rate",
        "every redis-server of a mode (sentinels too) is pinned to the Redis core: the "
        "replica applies and the sentinels run on the same core as the primary, so the "
        "sentinel and cluster ceilings include the replicas' CPU (replica_cpu_share). A "
        "6-node cluster on one core measures the per-core cost of cluster mode, not its "
        "scaling with nodes (see projection_per_core_samples_s)",
        "redis CPU counts every thread of each redis-server (schedstat) and the AOF "
        "rewrites it forked (appendfsync everysec with the default auto-rewrite: the "
        "streams trimmed short, the AOF is rewritten every few seconds at these rates), "
        "counted when each rewrite is reaped: a level's redis_cpu can exceed 1 when a "
        "rewrite begun before its window ends inside it",
        "projection_per_core_samples_s = 1e6 / redis_us_per_sample: the samples/s one "
        "whole core of that mode's Redis work would carry at the cost per sample measured "
        "at the best levels - a PROJECTION (cluster: x the cores its primaries and "
        "replicas get, if the partitions spread evenly), not a measurement",
        "main_us_per_sample: the primaries' main-thread time on a CPU per sample; "
        "redis_us_per_sample: all redis-server processes of the mode (every thread, "
        "replicas and sentinels included) per sample; samples = entries x group size",
        "write_p50/p99_ms: a write (and its WAIT) from send to the last reply, with "
        "CONNxDEPTH writes in flight: queueing at the ceiling included, not an idle "
        "round trip (wait_cost.py measures that); wait_p50/p99_ms: from the script's "
        "reply to WAIT's as the load read them (the replica's apply and ack, behind the "
        "other work queued on the core; 0 when both came in one read)",
        "--data-dir /dev/shm (tmpfs): the AOF's writes and rewrites cost Redis its CPU "
        "but no disk I/O, so the figure is the CPU ceiling; on a disk (a shared one "
        "here), writeback stalls made levels 2x slower at random; with appendfsync "
        "always the fsync per event-loop pass would come on top",
        "core_others: CPU others used on the Redis core (its busy time less the mode's "
        "redis-servers); other helpers share this machine and pinning cannot keep them "
        "off it. load_avg_1m: the machine's 1-minute load average at the level's start",
    ]


def own_autogroup(nice: int) -> int | None:
    """With autogroup scheduling (kernel.sched_autogroup_enabled), a thread's nice
    only ranks it within its session's group, and every session's group gets an equal
    share of a core: other sessions' work would take half of the Redis core whatever
    the redis-servers' nice. So: fork, make the child a session of its own (its group),
    set that group's nice; the parent waits and returns the child's exit code, the
    child returns None and goes on with the bench (its redis-servers and load in its
    group)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            if f.read().strip() != "1":
                return None
    except OSError:
        return None
    pid = os.fork()
    if pid:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os.setsid()
    with open("/proc/self/autogroup", "w") as f:
        f.write(str(nice))
    return None


def ceiling_main(args) -> int:

    if args.redis_nice and (code := own_autogroup(args.redis_nice)) is not None:
        return code

    modes = args.modes.split(",")
    if not modes or set(modes) - set(MODES):
        raise ValueError(f"--modes {args.modes!r}: choose from {','.join(MODES)}, comma-joined")
    levels = parse_levels(args.levels)
    cpus = parse_cpus(args.load_cpus)
    if cpus:
        pin(os.getpid(), cpus)
    entry = rollout_entry(args)
    probe, rows, topos = LoadProbe(), [], {}
    with tempfile.TemporaryDirectory(prefix="scale-modes-", dir=args.data_dir or None) as root:
        try:
            for m in modes:
                topos[m] = Topology(m, args, root)
            for rnd in range(args.rounds):
                order = modes[rnd % len(modes) :] + modes[: rnd % len(modes)]
                for m in order:
                    for level in levels:
                        row = run_level(topos[m], args, entry, level, rnd)
                        rows.append(row)
                        print_table([row], CEILING_COLUMNS)
        finally:
            for t in topos.values():
                t.stop()
    summary = ceilings(rows)
    payload = {
        "bench": "scale",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m pipeline.bench scale " + " ".join(args.argv),
        "machine": f"{device_name()}, {_cpu_model()}, {_mem_gib():.0f} GiB",
        "redis_version": subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True
        ).stdout.strip(),
        "args": {k: v for k, v in vars(args).items() if k != "argv"},
        "entry_bytes": DurableWrite(RUN, entry, 0, 1).size,
        "load": probe.end(),
        "rows": rows,
        "ceilings": summary,
        "notes": ceiling_notes(args),
    }
    print()
    print_table(rows, CEILING_COLUMNS)
    print()
    print_table(summary["per_mode"], list(summary["per_mode"][0]))
    for r in summary["ratios"]:
        print(f"{r['ratio']} {r['of']}: median {r['median']} (min {r['min']}, max {r['max']}) "
              f"per round {r['per_round']}")  # fmt: skip
    write_json(args.out, payload)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(ceiling_markdown(payload))
    return 0
