"""``python -m pipeline.bench scale --load pipeline|redis``: a ramp of the pools' whole
traffic in single mode (the package's docstring says what is measured); the ramp's own
processes (``actor``, ``trainer``, ``relay``, ``drain``) and ``Setup``, which starts them
and the redis-server and runs each level."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid

import numpy as np
from omegaconf import OmegaConf

from pipeline.bench.common import (
    busy_cpu_s,
    percentile,
    print_table,
)
from pipeline.bench.scale.common import (
    SATURATED_IDLE,
    VOCAB,
    _level_of,
    cpu_busy_each,
    cpu_seconds,
    main_thread_sched,
    parse_cpus,
    pin,
    sample_pool,
)

SUSTAINED = 0.95
COLUMNS = [
    "load", "mode", "appendfsync", "offered_samples_s", "sent_samples_s",
    "trained_samples_s", "trained_entries_s", "rollouts_mb_s", "trained_tokens_s",
    "xadd_p50_ms", "xadd_p99_ms", "lag_rollouts", "lag_batches", "used_memory_mb_max",
    "redis_cpu_each", "redis_runq_each", "redis_idle_each", "redis_core_others",
    "other_cpu_cores", "sustained", "redis_saturated",
]  # fmt: skip


# ---------------------------------------------------------------- simulated actor
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
        from pipeline.redisd.server import EmbeddedRedis
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
