"""``python -m pipeline.bench scale --out FILE [--shards 1,2] [--rates ...]``: how far
one Redis carries the pipeline, and how far several (redis.shards) carry it.

Per shard count, side by side in one run: that many real redis-servers (AOF,
``--appendfsync``), the real preprocessor processes (``python -m preprocessor``,
no scorers, no KL: no model), a trainer stand-in (the real batch intake,
trainer/batches.py ``collect`` over the real consumer, then ACK, ``samples_retired``
and trimming as the trainer does; no model), and ``--actors`` simulated actor
processes. A simulated actor XADDs RolloutGroups of real size and shape (int32
token ids, float32 log-probs, RLE versions; ``--group-size`` samples of about
``--completion-tokens`` tokens after a ``--prompt-tokens`` prompt) through the real
``publish`` path and shard rotation, with the real actor's INCRBY and HINCRBY per
group, open loop at its share of the offered rate.

The offered rate ramps through ``--rates`` (samples/s), ``--level-s`` seconds each,
until a level is not sustained (trained < 95% of offered, or a backlog of more
than one second of offered samples left at its end). Per level: samples/s
offered, produced and trained, MB/s into Redis, XADD p50/p99, consumer lag (entries
unread by the preprocessor and trainer groups, every shard), used_memory (with
the pools' trimming), each redis-server's CPU (from /proc), and what that many
samples/s equals in GPU actors at ``--actor-tok-s`` tokens/s each (a vLLM actor on
the 1.5B shape: ../shared/device/README.md). ``redis_bound_samples_s`` projects the
trained rate to one full core per redis-server (measured rate / busiest
redis-server's CPU share): the ceiling when the pools run on other hosts.

Subcommands ``actor`` and ``trainer`` are the bench's own processes.
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

from pipeline.bench.common import percentile, print_table, write_json

VOCAB = 151936  # Qwen2.5 vocabulary: token ids of the 1.5B shape
SUSTAINED = 0.95
COLUMNS = [
    "shards", "appendfsync", "offered_samples_s", "trained_samples_s", "rollouts_mb_s",
    "xadd_p50_ms", "xadd_p99_ms", "lag_rollouts", "lag_batches", "used_memory_mb_max",
    "redis_cpu_each",
    "gpu_actors_equiv", "redis_bound_gpu_actors", "sustained",
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
    from pipeline.config import load_config, redis_url, shard_urls
    from pipeline.messages import SCHEMA_VERSION, RolloutGroup, encode, pack_i32
    from pipeline.shards import Shards
    from pipeline.streams import Names, connect, count_produced, publish

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
    shards = Shards.for_producer([client, *map(connect, shard_urls(cfg, "actor"))], args.name)
    names = Names(cfg.redis.prefix, cfg.run.name)
    rng = np.random.default_rng(sum(args.name.encode()))
    groups = sample_pool(rng, 16, args.group_size, args.completion_tokens)
    prompt = pack_i32(rng.integers(0, VOCAB, args.prompt_tokens))
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
            publish(shards.next(), names.rollouts, payload, schema=SCHEMA_VERSION, group=g.group_id)
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
    from pipeline.shards import open_consumer
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


# ---------------------------------------------------------------- the controller
def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _level_of(path: str, k: int) -> dict | None:
    try:
        with open(path) as f:
            levels = json.load(f)
    except (OSError, ValueError):
        return None
    return levels[k] if len(levels) > k else None


def lag(clients, names) -> dict[str, int]:
    """Entries not yet delivered to each group, summed over the shards (XINFO GROUPS lag)."""
    out = {"rollouts": 0, "batches": 0}
    for c in clients:
        for stream in out:
            for g in c.xinfo_groups(getattr(names, stream)):
                out[stream] += int(g.get("lag") or 0) + int(g["pending"])
    return out


class Setup:
    """One shard count: its redis-servers, preprocessors and trainer stand-in."""

    def __init__(self, args, shards: int, fsync: str, root: str):
        from pipeline.config import Config
        from pipeline.redis_server import EmbeddedRedis
        from pipeline.streams import Names, connect

        self.args, self.fsync = args, fsync
        self.dir = os.path.join(root, f"shards{shards}-{fsync}")
        self.servers = [
            EmbeddedRedis(os.path.join(self.dir, f"redis{k}"), appendfsync=fsync)
            for k in range(shards)
        ]
        for s in self.servers:
            s.start()
        self.clients = [connect(s.url) for s in self.servers]
        cfg = OmegaConf.structured(Config)
        cfg.run_dir, cfg.run.name, cfg.model.path = self.dir, "scale", "unused-no-scorers"
        cfg.redis.shards, cfg.preprocessor.scorers = shards, []
        cfg.trainer.kl_coef, cfg.trainer.samples_per_step = 0.0, args.samples_per_step
        cfg.preprocessor.token_budget, cfg.preprocessor.read_count = args.token_budget, 8
        cfg.trainer.max_lag = 1000
        self.config = os.path.join(self.dir, "config.yaml")
        OmegaConf.save(cfg, self.config)
        self.names = Names(cfg.redis.prefix, cfg.run.name)
        self.env = dict(os.environ, NONSTOP_REDIS_URL=self.servers[0].url)
        self.env["NONSTOP_REDIS_SHARD_URLS"] = ",".join(s.url for s in self.servers[1:])
        self.env["NONSTOP_RUN_SECRET"] = "scale-bench"
        self.procs = [
            self.spawn(["preprocessor"], f"preprocessor-{i}") for i in range(args.preprocessors)
        ]
        self.procs.append(self.spawn(["pipeline.bench", "scale", "trainer"], "trainer"))

    def spawn(self, module: list[str], name: str, extra=()) -> subprocess.Popen:
        cmd = [sys.executable, "-m", *module, "--config", self.config, "--name", name, *extra]
        with open(os.path.join(self.dir, f"{name}.log"), "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def counters(self) -> tuple[int, int]:
        n = self.names
        produced, retired = self.clients[0].mget(n.samples_produced, n.samples_retired)
        return int(produced or 0), int(retired or 0)

    def ramp(self, rates: list[float]) -> list[dict]:
        """Every level back to back (the actors follow one wall-clock schedule), until
        one is not sustained; one row per level run."""
        a = self.args
        outs = [os.path.join(self.dir, f"actor-{i}.json") for i in range(a.actors)]
        start_at = time.time() + a.startup_s  # the actors import and connect before it
        extra = lambda i: [  # noqa: E731
            "--out", outs[i], "--rates", ",".join(str(r / a.actors) for r in rates),
            "--level-s", str(a.level_s), "--start-at", str(start_at),
            "--prompt-tokens", str(a.prompt_tokens), "--group-size", str(a.group_size),
            "--completion-tokens", str(a.completion_tokens),
        ]  # fmt: skip
        actors = [
            self.spawn(["pipeline.bench", "scale", "actor"], f"actor-{i}", extra(i))
            for i in range(a.actors)
        ]
        rows = []
        try:
            time.sleep(max(0.0, start_at - time.time()))
            for k, rate in enumerate(rates):
                row = self.level(k, rate, start_at + (k + 1) * a.level_s, outs)
                rows.append(row)
                print_table([row], COLUMNS)
                if not row["sustained"]:
                    break
        finally:
            for p in actors:
                p.kill()
                p.wait()
        return rows

    def level(self, k: int, rate: float, end_at: float, outs: list[str]) -> dict:
        a = self.args
        p0, r0 = self.counters()
        cpu0 = [cpu_seconds(s.proc.pid) for s in self.servers]
        t0 = time.monotonic()
        mem = [0] * len(self.clients)
        while time.time() < end_at:
            mem = [
                max(m, c.info("memory")["used_memory"])
                for m, c in zip(mem, self.clients, strict=True)
            ]
            time.sleep(min(1.0, max(0.0, end_at - time.time())))
        wall = time.monotonic() - t0
        p1, r1 = self.counters()
        cpu = [
            (cpu_seconds(s.proc.pid) - c) / wall for s, c in zip(self.servers, cpu0, strict=True)
        ]
        backlog = lag(self.clients, self.names)
        time.sleep(1.0)  # the actors write the level's file
        sent = [_level_of(o, k) for o in outs]
        sent = [s for s in sent if s is not None]
        xadd = [x for s in sent for x in s["xadd_ms"]]
        nbytes = sum(s["bytes"] for s in sent)
        trained = (r1 - r0) / wall
        tokens_s = trained * a.completion_tokens
        bound = trained / max(cpu) if max(cpu) > 0 else 0.0
        row = {
            "shards": len(self.servers),
            "appendfsync": self.fsync,
            "offered_samples_s": rate,
            "produced_samples_s": round((p1 - p0) / wall, 1),
            "trained_samples_s": round(trained, 1),
            "rollouts_mb_s": round(nbytes / wall / 1e6, 2),
            "xadd_p50_ms": round(percentile(xadd, 50), 3),
            "xadd_p99_ms": round(percentile(xadd, 99), 3),
            "lag_rollouts": backlog["rollouts"],
            "lag_batches": backlog["batches"],
            "backlog_samples": p1 - r1,
            "used_memory_mb_max": round(max(mem) / 1e6, 1),
            "redis_cpu_max": round(max(cpu), 3),
            "redis_cpu_each": [round(c, 3) for c in cpu],
            "actors_late_sends": sum(s["late"] for s in sent),
            "actor_files": len(sent),
            "gpu_actors_equiv": round(tokens_s / a.actor_tok_s, 1),
            "redis_bound_samples_s": round(bound),
            "redis_bound_gpu_actors": round(bound * a.completion_tokens / a.actor_tok_s),
        }
        row["sustained"] = bool(trained >= SUSTAINED * rate and row["backlog_samples"] <= rate)
        return row

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
        """Until every pool process has written its heartbeat."""
        from pipeline.telemetry import read_statuses

        want = {f"preprocessor-{i}" for i in range(self.args.preprocessors)} | {"trainer"}
        deadline = time.monotonic() + timeout_s
        while not want <= set(read_statuses(self.clients[0], self.names)):
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"pools did not start (exited: {dead}); logs in {self.dir}")
            time.sleep(0.5)


def summarize(rows: list[dict]) -> list[dict]:
    """Per shard count: the highest sustained level and the redis-bound projection."""
    out = []
    for n, fsync in dict.fromkeys((r["shards"], r["appendfsync"]) for r in rows):
        mine = [r for r in rows if (r["shards"], r["appendfsync"]) == (n, fsync)]
        ok = [r for r in mine if r["sustained"]]
        best = max(ok, key=lambda r: r["trained_samples_s"]) if ok else None
        top = max(mine, key=lambda r: r["offered_samples_s"])
        out.append(
            {
                "shards": n,
                "appendfsync": fsync,
                "sustained_samples_s": best["trained_samples_s"] if best else 0.0,
                "sustained_gpu_actors": best["gpu_actors_equiv"] if best else 0.0,
                "first_unsustained_offered": None if top["sustained"] else top["offered_samples_s"],
                "redis_cpu_at_best": best["redis_cpu_max"] if best else None,
                "redis_bound_samples_s": best["redis_bound_samples_s"] if best else None,
                "redis_bound_gpu_actors": best["redis_bound_gpu_actors"] if best else None,
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
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    lines += ["", "| " + " | ".join(payload["summary"][0]) + " |"]
    lines += ["|" + "---|" * len(payload["summary"][0])]
    lines += ["| " + " | ".join(str(v) for v in s.values()) + " |" for s in payload["summary"]]
    lines += ["", *[f"- {n}" for n in payload["notes"]], ""]
    lines.insert(4, "")
    lines.insert(4, f"shape: {a['group_size']} x ~{a['completion_tokens']} completion tokens "
                 f"after {a['prompt_tokens']} prompt tokens; {a['actors']} actor processes, "
                 f"{a['preprocessors']} preprocessors, {a['level_s']} s per level")  # fmt: skip
    return "\n".join(lines)


def notes(args, load: tuple, rows: list[dict]) -> list[str]:
    return [
        f"{os.cpu_count()} CPU cores shared by the redis-servers, {args.actors} simulated actors, "
        f"{args.preprocessors} preprocessors and the trainer stand-in (and other work on the "
        f"machine: 1/5/15-min load average {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f} at the "
        "start): the Python processes compete with redis-server for CPU, so the sustained "
        "rate is the whole pipeline's on this machine, not Redis's ceiling",
        "redis_bound_*: the trained rate divided by the busiest redis-server's CPU share, "
        "i.e. projected to one full core per redis-server (Redis executes commands on one "
        "thread); what one instance carries when the pools run on other hosts. A projection "
        "from CPU share, not a measurement at that rate",
        f"gpu_actors_equiv: trained samples/s x {args.completion_tokens} tokens / "
        f"{args.actor_tok_s:g} tok/s (a vLLM actor on the 1.5B shape, shared/device/README.md)",
        f"redis appendfsync: {args.appendfsync} (each row says which); lag_* are entries not "
        "yet acknowledged by the preprocessor (rollouts) and trainer (batches) groups at the "
        "level's end, summed over the shards; redis_cpu_each: each redis-server's CPU share "
        "(one core = 1.0), the primary first",
        "appendfsync always: redis-server fsyncs the AOF before it replies; that wait is not CPU, "
        "so its redis_bound_* (a CPU projection) overstates what it carries: read its sustained "
        "rows against everysec's, measured side by side",
        *primary_notes(rows),
    ]


def primary_notes(rows: list[dict]) -> list[str]:
    """With shards, how much more the primary works than the others (the control keys)."""
    out = []
    for r in rows:
        cpu = r["redis_cpu_each"]
        same = [
            x for x in rows if (x["shards"], x["appendfsync"]) == (r["shards"], r["appendfsync"])
        ]
        top = max((x["offered_samples_s"] for x in same if x["sustained"]), default=None)
        if len(cpu) > 1 and r["sustained"] and r["offered_samples_s"] == top:
            rest = sum(cpu[1:]) / (len(cpu) - 1)
            out.append(
                f"{r['shards']} shards ({r['appendfsync']}), {r['trained_samples_s']:g} samples/s: "
                f"primary {cpu[0]:.3f} of a core, the others {rest:.3f} each: the primary also "
                "carries the control keys (per group the actor's INCRBY samples_produced and "
                "HINCRBY status, the pools' status hashes and counters), so its share does not "
                "shrink with more shards; that part bounds the sharded pipeline"
            )
    return out


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("actor", "trainer"):
        {"actor": run_actor, "trainer": run_trainer}[argv[0]](argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="python -m pipeline.bench scale")
    p.add_argument("--out", default="bench/results/scale.json")
    p.add_argument("--shards", default="1,2", help="shard counts, run side by side")
    p.add_argument("--rates", default="250,500,1000,2000,4000,8000", help="samples/s")
    p.add_argument("--level-s", type=float, default=12.0)
    p.add_argument("--startup-s", type=float, default=8.0)
    p.add_argument("--actors", type=int, default=4)
    p.add_argument("--preprocessors", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--completion-tokens", type=int, default=512)
    p.add_argument("--samples-per-step", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument(
        "--appendfsync", default="everysec", help="redis appendfsync values, run side by side"
    )
    p.add_argument("--actor-tok-s", type=float, default=19000.0)
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    load, rows = os.getloadavg(), []
    with tempfile.TemporaryDirectory(prefix="scale-") as root:
        for fsync, n in (
            (f, int(x)) for f in args.appendfsync.split(",") for x in args.shards.split(",")
        ):
            setup = Setup(args, n, fsync, root)
            try:
                setup.wait_ready()
                rows += setup.ramp(rates)
            finally:
                setup.close()
    payload = {
        "bench": "scale",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python -m pipeline.bench scale " + " ".join(argv),
        "args": vars(args),
        "load_average_start": load,
        "load_average_end": os.getloadavg(),
        "rows": rows,
        "summary": summarize(rows),
        "notes": notes(args, load, rows),
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
