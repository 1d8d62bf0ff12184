"""``python -m pipeline.bench trainer [--shape small] [--out FILE]``: trainer throughput.

Side by side in one run, on one random-weight model shape and the same
synthetic batches: the torch backend and DeepSpeed ZeRO-2 and ZeRO-3, each at 1
and 2 ranks (``--ranks``). Per setting: optimizer steps/s and tokens/s (every
prompt + completion token through forward and backward; completion tokens/s
beside it) over ``--steps`` steps after one warm-up step, and the time to
gather the full weight set (ZeRO-3: from every rank) and publish it to a real
actor receiver over gloo, until the actor has swapped it in (median of
``--publishes``). Ranks are separate processes over gloo on the CPU (nccl on
CUDA), started here as the launcher starts them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.bench.common import device_name, print_table, stop_process, write_json

SHAPES = {  # name -> LlamaConfig fields (tiny tokenizer ids stay below 100)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, heads=4, vocab=128),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, heads=4, vocab=8192),
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, heads=9, vocab=49152
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, heads=12, vocab=151936
    ),
}
SETTINGS = [("torch", 0), ("deepspeed", 2), ("deepspeed", 3)]


def build_model(shape: str, out: Path) -> str:
    """A seeded random-weight Llama of ``shape`` with the tiny tokenizer, saved once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.models import _tiny_tokenizer

    s = SHAPES[shape]
    tokenizer = _tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_hidden_layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["heads"],
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return str(out)


def batches(step: int, n: int, rows: int, prompt: int, completion: int):
    """The same synthetic micro-batches for a step in every process."""
    from pipeline.messages import SCHEMA_VERSION, Sample, TrainBatch, pack_f32, pack_i32, rle_encode

    rng = np.random.default_rng(step)
    out = []
    for b in range(n):
        samples = [
            Sample(
                index=i,
                completion_ids=pack_i32(rng.integers(10, 90, completion)),
                logprobs=pack_f32(-rng.uniform(3, 6, completion)),
                versions=rle_encode([step] * completion),
                reward=float(i % 2),
                finished=True,
                advantage=1.0 if i % 2 else -1.0,
            )
            for i in range(rows)
        ]
        out.append(
            TrainBatch(
                schema=SCHEMA_VERSION,
                batch_id=f"{step}-{b}",
                group_ids=[f"{step}-{b}"] * rows,
                prompt_ids=[pack_i32(rng.integers(10, 90, prompt)) for _ in range(rows)],
                samples=samples,
                temperature=1.0,
            )
        )
    return out


def worker(args) -> None:
    """One rank: warm-up, timed steps, timed publishes; rank 0 writes the JSON."""
    from omegaconf import OmegaConf

    from pipeline.config import Config
    from pipeline.messages import encode
    from trainer.backends import make_backend
    from trainer.ranks import Plan, barrier, init_ranks, my_share
    from trainer.step import train_step

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", 1))
    cfg = OmegaConf.structured(Config)
    t = cfg.trainer
    t.backend, t.zero_stage, t.world_size, t.device = args.backend, args.stage, world, args.device
    t.dtype, t.lr = args.dtype, 1e-5
    ranks = init_ranks(world, args.device, 300.0, need_dist=args.backend == "deepspeed")
    backend = make_backend(cfg, ranks, args.model, None)
    times, tokens, comp_tokens = [], 0, 0
    for step in range(args.steps + 1):
        bs = batches(step, args.micro, args.rows, args.prompt, args.completion)
        n_comp = sum(len(s.tokens()) for b in bs for s in b.samples)
        plan = Plan(version=step, batches=[encode(b) for b in bs], tokens=n_comp)
        mine, slots = my_share(ranks, plan)
        barrier(ranks)
        t0 = time.perf_counter()
        train_step(backend, ranks, mine, slots, mine[0] if mine else bs[0], t, 0, n_comp)
        if step:  # the first step is warm-up
            times.append(time.perf_counter() - t0)
            comp_tokens += n_comp
            tokens += n_comp + args.micro * args.rows * args.prompt
    publish_s = publish_times(backend, ranks, args)
    params = backend.full_parameters()  # every rank: a gather under ZeRO-3
    if ranks.is_main:
        n_params = sum(p.numel() for p in params.values())
        result = {
            "step_s": statistics.median(times),
            "tokens_per_s": tokens / sum(times),
            "completion_tokens_per_s": comp_tokens / sum(times),
            "publish_ms": 1000 * statistics.median(publish_s) if publish_s else None,
            "params": n_params,
        }
        Path(args.result).write_text(json.dumps(result))


def publish_times(backend, ranks, args) -> list[float]:
    """Gather (every rank) and publish to a real receiver until it swapped the weights in."""
    if not args.redis:
        return []
    rig = PublishRig(args) if ranks.is_main else None
    out = []
    try:
        for v in range(1, args.publishes + 1):
            t0 = time.perf_counter()
            params = backend.full_parameters()
            if rig is not None:
                rig.send(v, params)
                out.append(time.perf_counter() - t0)
    finally:
        if rig is not None:
            rig.close()
    return out


class PublishRig:
    """rank 0's WeightPublisher and one actor's WeightReceiver on the same host."""

    def __init__(self, args):
        from actor.engines.hf import HFEngine
        from actor.weight_receiver import WeightReceiver
        from pipeline.models import load_model
        from pipeline.streams import Names, connect, wait_until
        from trainer.weight_publisher import WeightPublisher

        self.wait_until = wait_until
        client, names = connect(args.redis), Names("bench", f"trainer-{os.getpid()}")
        model, tok = load_model(args.model, args.dtype)
        self.engine = HFEngine(model, tok, temperature=1.0, top_p=1.0, top_k=0)
        self.publisher = WeightPublisher(client, names, "127.0.0.1", 64, 120, "bench")
        self.receiver = WeightReceiver(client, names, "actor-0", self.engine, 120, "bench")
        self.receiver.start()
        assert wait_until(lambda: client.xlen(names.joins) >= 1, 60)

    def send(self, version: int, params) -> None:
        self.publisher.submit(version, params)
        assert self.wait_until(lambda: self.engine.version == version, 300, 0.002), "lost"

    def close(self) -> None:
        self.receiver.stop()
        self.publisher.close(timeout_s=5)


def run_setting(args, backend: str, stage: int, world: int, tmp: Path, redis_url: str) -> dict:
    from pipeline.redisd.server import free_port

    result = tmp / f"{backend}-{stage}-{world}.json"
    port = str(free_port("127.0.0.1"))
    cmd = [sys.executable, "-W", "ignore::FutureWarning", "-m", "pipeline.bench", "trainer"]
    cmd += ["--worker", "--backend", backend, "--stage", str(stage), "--model", args.model]
    cmd += ["--result", str(result), "--redis", redis_url]
    cmd += [f"--{k}={getattr(args, k)}" for k in ("steps", "micro", "rows", "prompt")]
    cmd += [f"--{k}={getattr(args, k)}" for k in ("completion", "publishes", "threads")]
    cmd += [f"--device={args.device}", f"--dtype={args.dtype}"]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        log = open(tmp / f"{result.stem}-{rank}.log", "w")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=args.timeout_s) for p in procs]
    finally:  # timed out, Ctrl-C or SIGTERM: no rank outlives the bench
        for p in procs:
            stop_process(p, signal.SIGTERM, 10.0)
    if any(codes):
        tail = (tmp / f"{result.stem}-0.log").read_text()[-2000:]
        raise RuntimeError(f"{backend} stage {stage} x{world} failed ({codes}):\n{tail}")
    row = json.loads(result.read_text())
    name = "torch" if backend == "torch" else f"deepspeed zero-{stage}"
    return {"backend": name, "ranks": world, **row}


def parse(argv: list[str]):
    ap = argparse.ArgumentParser(prog="python -m pipeline.bench trainer")
    ap.add_argument("--out", default="outputs/bench/trainer.json")
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--model", default="", help="a model folder instead of --shape")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--rows", type=int, default=4, help="samples per micro-batch")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--completion", type=int, default=96)
    ap.add_argument("--publishes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="torch", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--redis", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    from pipeline.redisd.server import EmbeddedRedis

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp_dir:
        tmp = Path(tmp_dir)
        args.model = args.model or build_model(args.shape, tmp / "model")
        server = EmbeddedRedis(str(tmp / "redis"))
        server.start()
        rows = []
        try:
            for world in [int(r) for r in args.ranks.split(",")]:
                for backend, stage in SETTINGS:
                    rows.append(run_setting(args, backend, stage, world, tmp, server.url))
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            server.stop()
    base = {r["ranks"]: r["tokens_per_s"] for r in rows if r["backend"] == "torch"}
    for r in rows:
        r["vs_torch"] = r["tokens_per_s"] / base[r["ranks"]] if r["ranks"] in base else None
        r["publish_ms"] = round(r["publish_ms"], 1) if r["publish_ms"] is not None else None
    cols = ["backend", "ranks", "step_s", "tokens_per_s", "completion_tokens_per_s"]
    print_table(rows, cols + ["vs_torch", "publish_ms"])
    payload = {
        "benchmark": "trainer",
        "device": device_name(args.device),
        "shape": args.shape if not argv or "--model" not in " ".join(argv) else args.model,
        "params": rows[0]["params"],
        "dtype": args.dtype,
        "torch_threads_per_rank": args.threads,
        "tokens_per_step": args.micro * args.rows * (args.prompt + args.completion),
        "steps_timed": args.steps,
        # other processes on the machine skew CPU numbers: the load while this ran
        "load_avg_1m": {"start": load_start, "end": os.getloadavg()[0]},
        "rows": rows,
    }
    write_json(args.out, payload)
    return 0
