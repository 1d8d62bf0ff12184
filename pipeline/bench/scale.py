"""``python -m pipeline.bench scale``: how far Redis carries the pipeline's writes, in each
redis.mode, on this machine.

``--load ceiling`` (the default): each mode's ceiling where Redis itself is the
bottleneck, side by side in one run, modes interleaved round by round (``--rounds``,
the order rotating)::

    single    one EmbeddedRedis (pipeline/redis_server.py)
    sentinel  RedisHA (pipeline/redis_ha.py): primary, one replica, three sentinels
    cluster   LocalCluster (pipeline/redis_cluster.py): 3 primaries, a replica each;
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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
from omegaconf import OmegaConf

from pipeline.bench.common import (
    LoadProbe,
    busy_cpu_s,
    device_name,
    percentile,
    print_table,
    write_json,
)

VOCAB = 151936  # Qwen2.5 vocabulary: token ids of the 1.5B shape
SUSTAINED = 0.95
SATURATED_IDLE = 0.05  # a redis-server main thread idle less than this share is saturated
COLUMNS = [
    "load", "mode", "appendfsync", "offered_samples_s", "sent_samples_s",
    "trained_samples_s", "trained_entries_s", "rollouts_mb_s", "trained_tokens_s",
    "xadd_p50_ms", "xadd_p99_ms", "lag_rollouts", "lag_batches", "used_memory_mb_max",
    "redis_cpu_each", "redis_runq_each", "redis_idle_each", "redis_core_others",
    "other_cpu_cores", "sustained", "redis_saturated",
]  # fmt: skip


# ---------------------------------------------------------------- simulated actor
def sample_pool(rng, n: int, group_size: int, tokens: int) -> list[list]:
    """``n`` groups' worth of samples of real shape, reused (fresh group ids) on send."""
    from pipeline.messages import Sample, pack_f32, pack_i32, rle_encode

    out = []
    for _ in range(n):
        samples = []
        for i in range(group_size):
            t = int(rng.integers(tokens // 2, tokens * 3 // 2 + 1))
            split = int(rng.integers(t // 2, t))  # a weight update landed mid-sequence
            samples.append(
                Sample(
                    index=i,
                    completion_ids=pack_i32(rng.integers(0, VOCAB, t)),
                    logprobs=pack_f32(-rng.exponential(1.0, t)),
                    versions=rle_encode([0] * split + [1] * (t - split)),
                    reward=float(i % 2),  # group-relative signal: never dropped
                    finished=True,
                )
            )
        out.append(samples)
    return out


def run_actor(argv: list[str]) -> None:
    """Send at each rate of ``--rates`` for ``--level-s`` seconds from ``--start-at``
    (wall clock, the same for every actor); after each level, rewrite ``--out``."""
    from pipeline.config import load_config, redis_url
    from pipeline.messages import SCHEMA_VERSION, RolloutGroup, encode, pack_i32
    from pipeline.streams import Names, connect, count_produced, publish
    from pipeline.streams.shards import Shards

    p = argparse.ArgumentParser(prog="scale actor")
    for a in ("--config", "--name", "--out", "--rates"):
        p.add_argument(a, required=True)
    for a in ("--level-s", "--start-at"):
        p.add_argument(a, type=float, required=True)
    for a in ("--prompt-tokens", "--completion-tokens", "--group-size"):
        p.add_argument(a, type=int, required=True)
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    client = connect(redis_url(cfg, "actor"))
    names = Names.of(cfg)
    shards = Shards.of(cfg, client, names, args.name)
    rng = np.random.default_rng(sum(args.name.encode()))
    groups = sample_pool(rng, 16, args.group_size, args.completion_tokens)
    prompt = pack_i32(rng.integers(0, VOCAB, args.prompt_tokens))
    tokens = args.group_size * args.completion_tokens  # about: the plain field only
    open(args.out + ".ready", "w").close()  # connected and built: the controller waits for it
    levels = []
    for k, rate in enumerate(float(r) for r in args.rates.split(",")):
        start = args.start_at + k * args.level_s
        per_s = rate / args.group_size  # groups/s
        lat, sent, nbytes, late = [], 0, 0, 0
        while (now := time.time()) < start + args.level_s:
            due = start + sent / per_s
            if due >= start + args.level_s:
                time.sleep(max(0.0, start + args.level_s - now))
                break
            if due > now:
                time.sleep(due - now)
            elif now - due > 0.05:
                late += 1
            g = RolloutGroup(
                schema=SCHEMA_VERSION,
                group_id=f"{args.name}:{uuid.uuid4().hex[:16]}",
                actor=args.name,
                problem_id="p",
                prompt_ids=prompt,
                samples=groups[sent % len(groups)],
                temperature=1.0,
                created=time.time(),
            )
            payload = encode(g)
            t0 = time.perf_counter()
            part = shards.next()
            publish(  # the plain fields a real actor writes beside the payload
                part.client, part.names.rollouts, payload, schema=SCHEMA_VERSION,
                group=g.group_id, actor=args.name, problem="p", versions="0-1",
                reward="0.500", tokens=tokens,
            )  # fmt: skip
            lat.append((time.perf_counter() - t0) * 1e3)
            count_produced(client, names, args.name, g.group_id, args.group_size)  # as actors do
            sent, nbytes = sent + 1, nbytes + len(payload)
        levels.append({"groups": sent, "bytes": nbytes, "xadd_ms": lat, "late": late})
        with open(args.out + ".tmp", "w") as f:
            json.dump(levels, f)
        os.replace(args.out + ".tmp", args.out)


# ---------------------------------------------------------------- trainer stand-in
def run_trainer(argv: list[str]) -> None:
    """The real intake (collect over open_consumer), ACK, samples_retired, trim; no model."""
    from pipeline.messages import TrainBatch
    from pipeline.runtime import start_pool
    from pipeline.streams.shards import open_consumer
    from trainer.batches import collect

    pool = start_pool("trainer", argv)
    consumer = open_consumer(
        pool.shards, pool.names, pool.names.batches, "trainer", pool.name, TrainBatch,
        block_ms=pool.cfg.redis.block_ms, recover_pending=False,
    )  # fmt: skip
    position, seen = "0-0", {}
    while (data := collect(pool, consumer, 0, seen, VOCAB)) is not None:
        consumer.ack(data.entry_ids)
        pool.client.incrby(pool.names.samples_retired, data.retired)
        position = consumer.position(position, data.entry_ids)
        consumer.trim(keep_after=position)
        pool.status.incr("samples_trained", data.samples)


# ---------------------------------------------------------------- redis-only load
def _raw_pool(argv: list[str], prog: str):
    """--config, --name: this process's client, names, status key."""
    from pipeline.config import load_config, redis_url
    from pipeline.streams import Names, connect

    p = argparse.ArgumentParser(prog=f"scale {prog}")
    p.add_argument("--config", required=True)
    p.add_argument("--name", required=True)
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    client = connect(redis_url(cfg, "trainer"))
    names = Names.of(cfg)
    return client, client, names, names.status(args.name), args.name, cfg


def _stop_flag() -> list[bool]:
    import signal

    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    return stop


def run_relay(argv: list[str]) -> None:
    """A preprocessor's Redis commands, without its Python work: read up to 8
    rollouts, XADD each entry's fields to batches and XACK them (one round trip), trim
    rollouts to what every group acknowledged, HINCRBY the totals on the primary."""
    from pipeline.streams import ensure_group, trim_consumed

    client, primary, names, status, name, _cfg = _raw_pool(argv, "relay")
    ensure_group(client, names.rollouts, "preprocessor")
    stop = _stop_flag()
    while not stop[0]:
        reply = client.xreadgroup("preprocessor", name, {names.rollouts: ">"}, count=8, block=200)
        entries = [e for _s, es in reply or [] for e in es]
        if not entries:
            continue
        pipe = client.pipeline(transaction=False)
        for _id, fields in entries:
            pipe.xadd(names.batches, fields)
        pipe.xack(names.rollouts, "preprocessor", *(i for i, _ in entries))
        pipe.execute()
        trim_consumed(client, names.rollouts)
        for key in ("kept", "dropped", "batches"):  # as add_totals does
            primary.hincrby(status, key, len(entries) if key != "dropped" else 0)


def run_drain(argv: list[str]) -> None:
    """The trainer's Redis commands, without a model: read up to 8 batches,
    XACK, the samples_retired script (add_once, on the primary), trim batches, HINCRBY."""
    from pipeline.streams import add_once, ensure_group, trim_consumed

    client, primary, names, status, name, cfg = _raw_pool(argv, "drain")
    group_size = int(cfg.task.group_size)
    ensure_group(client, names.batches, "trainer")
    stop, step = _stop_flag(), 0
    while not stop[0]:
        reply = client.xreadgroup("trainer", name, {names.batches: ">"}, count=8, block=200)
        entries = [e for _s, es in reply or [] for e in es]
        if not entries:
            continue
        client.xack(names.batches, "trainer", *(i for i, _ in entries))
        samples = len(entries) * group_size
        step += 1
        add_once(
            primary, names.samples_retired, status, "last_retired_step", f"{name}:{step}",
            samples, {"samples_trained": samples},
        )  # fmt: skip
        trim_consumed(client, names.batches)


# ---------------------------------------------------------------- the controller
def cpu_seconds(pid: int) -> float:
    """CPU seconds of a live process, all its threads (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_cpu_seconds(pid: int) -> float:
    """CPU seconds of a live redis-server: every thread's time on a CPU (schedstat, ns)
    and the children it waited for (its AOF rewrites; /proc/PID/stat, clock ticks)."""
    total = 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone, or a thread ended between the listing and the read
        return total
    return total + (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def main_thread_sched(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of a process's main thread
    (/proc/PID/task/PID/schedstat); Redis executes commands on that thread."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        run_ns, wait_ns, _ = f.read().split()
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


def cpu_busy_each() -> list[float]:
    """Busy CPU seconds since boot per core (/proc/stat cpuN lines)."""
    out = []
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                v = [int(x) for x in line.split()[1:9]]
                out.append((v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK"))
    return out


def parse_cpus(text: str | None) -> set[int] | None:
    if not text:
        return None
    try:
        cpus = {int(x) for x in text.split(",")}
    except ValueError:
        raise ValueError(f"CPU list {text!r}: give core ids like 0 or 0,1") from None
    if not cpus <= set(range(os.cpu_count() or 1)):
        raise ValueError(f"CPU list {text!r}: this machine has cores 0-{os.cpu_count() - 1}")
    return cpus


def pin(pid: int, cpus: set[int] | None) -> None:
    """Every thread of ``pid`` onto ``cpus`` (taskset -a)."""
    if cpus:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cpus)


def _level_of(path: str, k: int) -> dict | None:
    try:
        with open(path) as f:
            levels = json.load(f)
    except (OSError, ValueError):
        return None
    return levels[k] if len(levels) > k else None


def lag(clients, names) -> dict[str, int]:
    """Entries not yet delivered to each group (XINFO GROUPS lag)."""
    out = {"rollouts": 0, "batches": 0}
    for c in clients:
        for stream in out:
            for g in c.xinfo_groups(getattr(names, stream)):
                out[stream] += int(g.get("lag") or 0) + int(g["pending"])
    return out


class Setup:
    """One redis-server (single mode) and the load downstream of the actors."""

    def __init__(self, args, fsync: str, root: str):
        from pipeline.config import Config
        from pipeline.redis_server import EmbeddedRedis
        from pipeline.streams import Names, connect

        self.args, self.fsync = args, fsync
        self.redis_cpus, self.load_cpus = parse_cpus(args.redis_cpus), parse_cpus(args.load_cpus)
        self.dir = os.path.join(root, f"{args.load}-{fsync}")
        self.servers = [EmbeddedRedis(os.path.join(self.dir, "redis"), appendfsync=fsync)]
        for s in self.servers:
            s.start()
            pin(s.proc.pid, self.redis_cpus)
            for tid in os.listdir(f"/proc/{s.proc.pid}/task") if args.redis_nice else ():
                os.setpriority(os.PRIO_PROCESS, int(tid), args.redis_nice)
        self.clients = [connect(s.url) for s in self.servers]
        cfg = OmegaConf.structured(Config)
        cfg.run_dir, cfg.run.name, cfg.model.path = self.dir, "scale", "unused-no-scorers"
        cfg.preprocessor.scorers = []
        cfg.task.group_size = args.group_size
        cfg.trainer.kl_coef, cfg.trainer.samples_per_step = 0.0, args.samples_per_step
        cfg.preprocessor.token_budget, cfg.preprocessor.read_count = args.token_budget, 8
        cfg.trainer.max_lag = 1000
        self.config = os.path.join(self.dir, "config.yaml")
        OmegaConf.save(cfg, self.config)
        self.names = Names.of(cfg)
        self.env = dict(os.environ, NONSTOP_REDIS_URL=self.servers[0].url)
        self.env["NONSTOP_RUN_SECRET"] = "scale-bench"
        self.procs, self.actors = [], []
        if args.load == "pipeline":
            self.procs += [
                self.spawn(["preprocessor"], f"preprocessor-{i}") for i in range(args.preprocessors)
            ]
            self.procs.append(self.spawn(["pipeline.bench", "scale", "trainer"], "trainer"))
        else:  # relays and a drain
            self.procs += [
                self.spawn(["pipeline.bench", "scale", "relay"], f"relay-{i}")
                for i in range(args.preprocessors)
            ]
            self.procs.append(self.spawn(["pipeline.bench", "scale", "drain"], "drain"))

    def spawn(self, module: list[str], name: str, extra=()) -> subprocess.Popen:
        cmd = [sys.executable, "-m", *module, "--config", self.config, "--name", name, *extra]
        if self.load_cpus:
            cmd = ["taskset", "-c", ",".join(map(str, sorted(self.load_cpus))), *cmd]
        with open(os.path.join(self.dir, f"{name}.log"), "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def counters(self) -> tuple[int, int]:
        n = self.names
        produced, retired = self.clients[0].mget(n.samples_produced, n.samples_retired)
        return int(produced or 0), int(retired or 0)

    def snapshot(self) -> dict:
        """Everything a level's figures are differences of, taken at one instant."""
        pids = [p.pid for p in self.procs + self.actors]
        return {
            "time": time.time(),
            "counters": self.counters(),
            "redis_cpu": [cpu_seconds(s.proc.pid) for s in self.servers],
            "redis_sched": [main_thread_sched(s.proc.pid) for s in self.servers],
            "core_busy": cpu_busy_each(),
            "busy": busy_cpu_s(),
            "own": sum(cpu_seconds(p) for p in pids)
            + sum(cpu_seconds(s.proc.pid) for s in self.servers)
            + cpu_seconds(os.getpid()),
        }

    def ramp(self, rates: list[float]) -> list[dict]:
        """Every level back to back (the actors follow one wall-clock schedule), until
        one is not sustained; one row per level run, each over its own window."""
        a = self.args
        outs = [os.path.join(self.dir, f"actor-{i}.json") for i in range(a.actors)]
        start_at = time.time() + a.startup_s  # the actors import and connect before it
        extra = lambda i: [  # noqa: E731
            "--out", outs[i], "--rates", ",".join(str(r / a.actors) for r in rates),
            "--level-s", str(a.level_s), "--start-at", str(start_at),
            "--prompt-tokens", str(a.prompt_tokens), "--group-size", str(a.group_size),
            "--completion-tokens", str(a.completion_tokens),
        ]  # fmt: skip
        self.actors = [
            self.spawn(["pipeline.bench", "scale", "actor"], f"actor-{i}", extra(i))
            for i in range(a.actors)
        ]
        rows = []
        try:
            while not all(os.path.exists(o + ".ready") for o in outs):
                if time.time() > start_at:  # a level must not start with actors missing
                    raise RuntimeError(
                        f"the simulated actors were not ready {a.startup_s:g} s after their "
                        f"start (logs in {self.dir}): raise --startup-s on a loaded machine"
                    )
                time.sleep(0.2)
            time.sleep(max(0.0, start_at - time.time()))
            before = self.snapshot()
            for k, rate in enumerate(rates):
                end_at = start_at + (k + 1) * a.level_s
                mem = self.poll_memory(end_at)
                after = self.snapshot()
                row = self.level(k, rate, before, after, mem, outs)
                before = after
                rows.append(row)
                print_table([row], COLUMNS)
                if not row["sustained"]:
                    break
        finally:
            for p in self.actors:
                p.kill()
                p.wait()
            self.actors = []
        return rows

    def poll_memory(self, end_at: float) -> list[int]:
        mem = [0] * len(self.clients)
        while end_at - time.time() > 0:
            mem = [
                max(m, c.info("memory")["used_memory"])
                for m, c in zip(mem, self.clients, strict=True)
            ]
            time.sleep(min(1.0, max(0.0, end_at - time.time())))
        return mem

    def level(self, k: int, rate: float, s0: dict, s1: dict, mem: list, outs: list) -> dict:
        a = self.args
        wall = s1["time"] - s0["time"]
        per = lambda key: [(y - x) / wall for x, y in zip(s0[key], s1[key], strict=True)]  # noqa: E731
        cpu = per("redis_cpu")
        run = [
            (y[0] - x[0]) / wall for x, y in zip(s0["redis_sched"], s1["redis_sched"], strict=True)
        ]
        runq = [
            (y[1] - x[1]) / wall for x, y in zip(s0["redis_sched"], s1["redis_sched"], strict=True)
        ]
        idle = [max(1 - r - q, 0.0) for r, q in zip(run, runq, strict=True)]
        core = per("core_busy")
        redis_cores = sorted(self.redis_cpus) if self.redis_cpus else []
        # CPU others used on the redis-servers' cores: those cores' busy time less Redis's
        on_redis_cores = sum(core[c] for c in redis_cores) - sum(cpu) if redis_cores else None
        (p0, r0), (p1, r1) = s0["counters"], s1["counters"]
        backlog = lag(self.clients, self.names)
        sent = self.actor_levels(outs, k)
        xadd = [x for s in sent for x in s["xadd_ms"]]
        nbytes = sum(s["bytes"] for s in sent)
        trained = (r1 - r0) / wall
        row = {
            "load": a.load,
            "mode": "single",
            "appendfsync": self.fsync,
            "offered_samples_s": rate,
            "window_s": round(wall, 2),
            "sent_samples_s": round(sum(s["groups"] for s in sent) * a.group_size / a.level_s, 1),
            "produced_samples_s": round((p1 - p0) / wall, 1),
            "trained_samples_s": round(trained, 1),
            "trained_entries_s": round(trained / a.group_size, 1),
            "trained_tokens_s": round(trained * a.completion_tokens),
            "rollouts_mb_s": round(nbytes / a.level_s / 1e6, 2),
            "xadd_p50_ms": round(percentile(xadd, 50), 3),
            "xadd_p99_ms": round(percentile(xadd, 99), 3),
            "lag_rollouts": backlog["rollouts"],
            "lag_batches": backlog["batches"],
            "backlog_samples": p1 - r1,
            "used_memory_mb_max": round(max(mem) / 1e6, 1),
            "redis_cpu_max": round(max(cpu), 3),
            "redis_cpu_each": [round(c, 3) for c in cpu],
            "redis_runq_each": [round(q, 3) for q in runq],
            "redis_idle_each": [round(i, 3) for i in idle],
            "redis_core_others": None if on_redis_cores is None else round(on_redis_cores, 2),
            "other_cpu_cores": round(max(s1["busy"] - s0["busy"] - (s1["own"] - s0["own"]), 0)
                                     / wall, 2),
            "actors_late_sends": sum(s["late"] for s in sent),
            "actor_files": len(sent),
        }  # fmt: skip
        row["sustained"] = bool(trained >= SUSTAINED * rate and row["backlog_samples"] <= rate)
        row["redis_saturated"] = bool(min(idle) < SATURATED_IDLE)
        return row

    @staticmethod
    def actor_levels(outs: list[str], k: int, timeout_s: float = 5.0) -> list[dict]:
        """Each actor's record of level ``k`` (written just after the level ends)."""
        deadline = time.monotonic() + timeout_s
        while True:
            sent = [_level_of(o, k) for o in outs]
            if all(s is not None for s in sent) or time.monotonic() > deadline:
                return [s for s in sent if s is not None]
            time.sleep(0.2)

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        for s in self.servers:
            s.stop()

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every pool process has written its heartbeat (pipeline load), or until
        every consumer group exists (redis load)."""
        from pipeline.telemetry import read_statuses

        if self.args.load == "pipeline":
            want = {f"preprocessor-{i}" for i in range(self.args.preprocessors)} | {"trainer"}
            ready = lambda: want <= set(read_statuses(self.clients[0], self.names))  # noqa: E731
        else:
            ready = lambda: all(  # noqa: E731
                c.exists(self.names.rollouts) and c.exists(self.names.batches)
                and len(c.xinfo_groups(self.names.rollouts)) == 1
                and len(c.xinfo_groups(self.names.batches)) == 1
                for c in self.clients
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"pools did not start (exited: {dead}); logs in {self.dir}")
            time.sleep(0.5)


def summarize(rows: list[dict]) -> list[dict]:
    """Per load: the highest sustained level, and the highest rate carried
    while a redis-server was saturated (measured), with the projection to a whole core
    beside the CPU share it rests on."""
    out = []
    for key in dict.fromkeys((r["load"], r["mode"], r["appendfsync"]) for r in rows):
        mine = [r for r in rows if (r["load"], r["mode"], r["appendfsync"]) == key]
        ok = [r for r in mine if r["sustained"]]
        best = max(ok, key=lambda r: r["trained_samples_s"]) if ok else None
        sat = [r for r in mine if r["redis_saturated"]]
        top = max(sat, key=lambda r: r["trained_samples_s"]) if sat else None
        top_mine = max(mine, key=lambda r: r["offered_samples_s"])
        out.append(
            {
                "load": key[0],
                "mode": key[1],
                "appendfsync": key[2],
                "sustained_samples_s": best["trained_samples_s"] if best else 0.0,
                "sustained_mb_s": best["rollouts_mb_s"] if best else 0.0,
                "redis_cpu_at_sustained": best["redis_cpu_max"] if best else None,
                "first_unsustained_offered": None
                if top_mine["sustained"]
                else top_mine["offered_samples_s"],
                "saturated_trained_samples_s": top["trained_samples_s"] if top else None,
                "saturated_entries_s": top["trained_entries_s"] if top else None,
                "saturated_mb_s": top["rollouts_mb_s"] if top else None,
                "saturated_tokens_s": top["trained_tokens_s"] if top else None,
                "saturated_redis_cpu": top["redis_cpu_max"] if top else None,
                "projection_full_core_samples_s": round(
                    top["trained_samples_s"] / top["redis_cpu_max"]
                )
                if top and top["redis_cpu_max"] > 0
                else None,
            }
        )
    return out


def markdown(payload: dict) -> str:
    rows, a = payload["rows"], payload["args"]
    lines = [
        f"# scale bench ({payload['date']})",
        "",
        f"`{payload['command']}`",
        "",
        f"shape: {a['group_size']} x ~{a['completion_tokens']} completion tokens after "
        f"{a['prompt_tokens']} prompt tokens; {a['actors']} actor processes, "
        f"{a['preprocessors']} preprocessors (or relays), {a['level_s']} s per level; "
        f"redis-servers on cores {a['redis_cpus'] or 'any'}, everything else on "
        f"{a['load_cpus'] or 'any'} (redis nice {a.get('redis_nice', 0)}); machine load: "
        f"{payload['load']}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    lines += ["", "| " + " | ".join(payload["summary"][0]) + " |"]
    lines += ["|" + "---|" * len(payload["summary"][0])]
    lines += ["| " + " | ".join(str(v) for v in s.values()) + " |" for s in payload["summary"]]
    lines += ["", *[f"- {n}" for n in payload["notes"]], ""]
    return "\n".join(lines)


def notes(args, rows: list[dict]) -> list[str]:
    return [
        f"{os.cpu_count()} CPU cores shared by the redis-servers, {args.actors} simulated "
        "actors, the load downstream and other work on the machine (other_cpu_cores: CPU the "
        "rest of the machine used during the level, in cores; redis_core_others: CPU others "
        "used on the redis-servers' pinned cores, which pinning cannot keep them off)",
        "load=pipeline: real preprocessors and the trainer stand-in (Python work included); "
        "load=redis: the same Redis commands per entry without the Python work (relays and "
        "a drain), the way to reach Redis's own limit on a machine this small",
        "redis_cpu_each / redis_runq_each / redis_idle_each: each redis-server main thread's "
        "share of the level's window on a CPU, runnable but waiting for one, and idle "
        f"(waiting for commands); saturated = idle under {SATURATED_IDLE:.0%}: Redis had "
        "work the whole window and the rate it carried is its ceiling at the CPU it got",
        "saturated_* in the summary: measured at the highest level where a redis-server was "
        "saturated. projection_full_core_samples_s = that rate / its redis_cpu share: a "
        "projection to a whole core, resting on the CPU share measured at saturation (the "
        "cost per sample is taken as fixed), not a measurement",
        "trained_tokens_s: trained samples/s x --completion-tokens; trained_entries_s: "
        f"samples/s / {args.group_size} (one rollouts entry per group); rollouts_mb_s: the "
        "actors' payload bytes over the level; each row is that level's own window",
        "lag_* are entries not yet acknowledged by the preprocessor (rollouts) and trainer "
        "(batches) groups at the level's end",
    ]


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
        from pipeline.redis_cluster import LocalCluster
        from pipeline.redis_ha import RedisHA
        from pipeline.redis_server import EmbeddedRedis
        from pipeline.streams import Names

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
    from pipeline.bench.common import LoadProbe

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
