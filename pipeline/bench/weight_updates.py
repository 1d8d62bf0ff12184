"""``python -m pipeline.bench weights --out FILE``: what a weight update costs
the generating engine.

For random-weight models shaped like SmolLM2-135M and Qwen2.5-1.5B, a trainer
process publishes ``--updates`` versions over the real transfer (Redis
announcement + gloo buckets) to an hf engine that generates throughout, once
with staging (the default) and once receiving in place under the lock (a
pause-for-the-whole-transfer baseline). Per update:

- transfer: announcement to version installed, as the receiver saw it;
- swap: the engine's lock hold (staged: installing the received copy; in-place:
  the whole receive, which happens under the lock);
- stall: the gap between the two forward passes around the moment the new
  version took effect. An update with no forward pass on one side of it (before
  the first or after the last recorded pass) is counted as unmeasured, never as 0;
- copy floor: copying the model's own parameter tensors into preallocated
  buffers, in the same process while generation goes on.

``--kinds full,lora``: the same measurements for full weights and for a LoRA
adapter alone (``model.lora``, pipeline/lora.py: rank ``--lora-rank`` on the
attention projections; the actor's engine holds the peft model, the trainer
publishes only the adapter, announced ``kind=lora``), side by side in one run.
"""

from __future__ import annotations

import argparse
import bisect
import multiprocessing as mp
import os
import tempfile
import threading
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from pipeline.bench.common import device_name, percentile, print_table, write_json
from pipeline.redisd.server import EmbeddedRedis
from pipeline.streams import Names, connect, wait_until

SHAPES = {
    "smollm2-135m": (
        LlamaConfig,
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            tie_word_embeddings=True,
        ),
        "float32",
    ),
    "qwen2.5-1.5b": (
        Qwen2Config,
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        "bfloat16",
    ),
}
NAMES = Names("bench", "weights")
SECRET = "bench-weights-run-secret"  # both processes of this local benchmark


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build(shape: str, seed: int, lora_rank: int = 0):
    """A random-weight model of ``shape``; with ``lora_rank`` wrapped in a peft adapter."""
    cls, kwargs, dtype = SHAPES[shape]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**kwargs), dtype=getattr(torch, dtype))
    if lora_rank:
        from omegaconf import OmegaConf

        from pipeline.config import LoraConfig
        from pipeline.lora import apply_lora

        settings = OmegaConf.structured(LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank))
        settings.target_modules = LORA_TARGETS
        model = apply_lora(model, settings, seed)
    return model.eval()


def published(model) -> dict[str, torch.Tensor]:
    """What the trainer publishes: the adapter alone for a peft model, else every weight."""
    from pipeline.lora import adapter_parameters, is_lora

    return adapter_parameters(model) if is_lora(model) else dict(model.named_parameters())


def trainer_proc(
    url: str,
    shape: str,
    updates: int,
    interval_s: float,
    timeout_s: float,
    bucket_mb: float,
    lora_rank: int,
    ready,
    transport: str = "gloo",
    nccl_backend: str = "gloo",
) -> None:
    from trainer.weight_publisher import WeightPublisher

    torch.set_num_threads(1)
    client = connect(url)
    model = build(shape, seed=1, lora_rank=lora_rank)
    kind = "lora" if lora_rank else "full"
    publisher = WeightPublisher(
        client, NAMES, "127.0.0.1", bucket_mb, timeout_s, SECRET, kind=kind,
        transport=transport, nccl_backend=nccl_backend,
    )  # fmt: skip
    ready.set()
    wait_until(lambda: bool(publisher.members()), 120)
    params = published(model)
    for version in range(1, updates + 1):
        time.sleep(interval_s)
        with torch.no_grad():
            next(iter(params.values())).add_(1e-3)
        publisher.submit(version, {n: p.detach() for n, p in params.items()})
        wait_until(publisher.idle, timeout_s + 5)
    publisher.close(timeout_s=timeout_s)


def stalls(
    timeline: list[tuple[float, float]], times: list[float]
) -> tuple[list[float], int, float]:
    """Per update, the gap (ms) between the forward passes around the moment it took
    effect; how many updates had no pass on one side (unmeasured, left out, never 0);
    and the usual gap between passes."""
    passes = sorted(timeline)
    starts = [start for start, _ in passes]
    gaps = [nxt - end for (_, end), (nxt, _) in zip(passes, passes[1:], strict=False)]
    usual = percentile([g for g in gaps if g > 0], 50) * 1000
    measured, unmeasured = [], 0
    for t in times:
        i = bisect.bisect_right(starts, t)  # passes[i] is the first to start after t
        if i == 0 or i == len(passes) or passes[i - 1][1] > t:
            unmeasured += 1  # before the first, after the last, or (never) inside a pass
            continue
        measured.append(1000 * (starts[i] - passes[i - 1][1]))
    return measured, unmeasured, usual


def copy_floor_ms(model, repeats: int = 5) -> float:
    """Copying the model's own parameter tensors into preallocated buffers (median of
    ``repeats``); called while generation runs, so under the same load as the updates."""
    params = [p.data for p in published(model).values()]
    dst = [torch.empty_like(p) for p in params]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, params)
        times.append(1000 * (time.perf_counter() - t0))
    return percentile(times, 50)


def measure(shape: str, staged: bool, lora_rank: int, args) -> dict:
    from actor.engines.hf import HFEngine
    from actor.weight_receiver import WeightReceiver

    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(tmp)
        server.start()
        try:
            client = connect(server.url)
            model = build(shape, seed=0, lora_rank=lora_rank)
            engine = HFEngine(model, _NoTokenizer(), temperature=1.0, top_p=1.0, top_k=0)
            engine.stop_ids = set()
            receiver = WeightReceiver(
                client, NAMES, "actor-0", engine, args.timeout_s, SECRET, staged=staged,
                transport=args.transport,
            )  # fmt: skip
            ctx = mp.get_context("spawn")
            ready = ctx.Event()
            trainer = ctx.Process(
                target=trainer_proc,
                args=(
                    server.url,
                    shape,
                    args.updates,
                    args.interval_s,
                    args.timeout_s,
                    args.bucket_mb,
                    lora_rank,
                    ready,
                    args.transport,
                    args.nccl_backend,
                ),
            )
            trainer.start()
            ready.wait(300)
            receiver.start()
            stop = threading.Event()
            gen = threading.Thread(target=_generate, args=(engine, stop, args), daemon=True)
            gen.start()
            trainer.join(timeout=args.updates * (args.interval_s + args.timeout_s) + 300)
            floor = copy_floor_ms(model)  # generation still running: the same load
            stop.set()
            gen.join(timeout=120)
            receiver.stop()
            per_update, unmeasured, usual = stalls(
                list(engine.stats.timeline), list(engine.stats.version_times)
            )
            sent = published(model).values()
            nbytes = sum(p.numel() * p.element_size() for p in sent)  # per update
            return {
                "device": device_name("cpu"),  # the engine and the transfer ran on the CPU
                "model": shape,
                "kind": f"lora-r{lora_rank}" if lora_rank else "full",
                "mode": "staged" if staged else "in-place",
                "transport": args.transport
                + (f"/{args.nccl_backend}" if args.transport == "nccl" else ""),
                "dtype": SHAPES[shape][2],
                "bytes": nbytes,
                "updates_applied": receiver.applied,
                "updates_failed": receiver.failed,
                "transfer_ms_p50": percentile(receiver.transfer_ms, 50),
                "swap_ms_p50": percentile(engine.stats.swap_ms, 50),  # lock held, both modes
                "swap_ms_max": max(engine.stats.swap_ms, default=0.0),
                "stall_ms_p50": percentile(per_update, 50),
                "stall_ms_max": max(per_update, default=0.0),
                "stalls_measured": len(per_update),
                "stalls_unmeasured": unmeasured,
                "usual_gap_ms_p50": usual,
                "forward_passes": engine.stats.forward_passes,
                "copy_floor_ms": floor,
            }
        finally:
            server.stop()


class _NoTokenizer:
    """The bench feeds token ids directly; the engine only needs these fields."""

    eos_token_id = None
    pad_token_id = 0
    unk_token_id = None

    def convert_tokens_to_ids(self, token):
        return None


def _generate(engine, stop: threading.Event, args) -> None:
    prompt = list(range(10, 10 + args.prompt_len))
    while not stop.is_set():
        engine.generate([prompt] * args.batch, args.new_tokens, should_stop=stop.is_set)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench weights")
    p.add_argument("--out", default="outputs/bench-weights.json")
    p.add_argument("--models", default=",".join(SHAPES), help="comma-separated shapes")
    p.add_argument("--modes", default="staged,in-place")
    p.add_argument("--kinds", default="full,lora", help="full weights and/or a LoRA adapter")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--interval-s", type=float, default=2.0)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--transport", default="gloo", help="weights.transport: gloo|nccl|cuda_ipc")
    p.add_argument("--nccl-backend", default="gloo", help="nccl transport's backend: nccl|gloo")
    p.add_argument("--note", default="", help="load conditions etc., saved with the results")
    args = p.parse_args(argv)
    load_start = os.getloadavg()
    torch.set_num_threads(args.threads)
    rows = []
    for shape in args.models.split(","):
        for kind in args.kinds.split(","):
            if kind not in ("full", "lora"):
                raise ValueError(f"--kinds names {kind!r}; use full and/or lora")
            rank = args.lora_rank if kind == "lora" else 0
            for mode in args.modes.split(","):
                print(f"measuring {shape} {kind} ({mode}), {args.updates} updates", flush=True)
                rows.append(measure(shape, mode == "staged", rank, args))
                print_table(rows[-1:], COLUMNS)
    print()
    print_table(rows, COLUMNS)
    for r in rows:
        measured = r["stalls_measured"] > 0
        r["stall_within_2x_copy_floor"] = (
            r["stall_ms_p50"] <= 2 * r["copy_floor_ms"] if measured else None
        )
    write_json(
        args.out,
        {
            "benchmark": "weights",
            "date": time.strftime("%Y-%m-%d"),
            "args": vars(args),
            "cpu_count": os.cpu_count(),
            "load_average_start": [round(x, 2) for x in load_start],  # 1, 5, 15 min
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "results": rows,
        },
    )
    return 0


COLUMNS = [
    "model",
    "kind",
    "mode",
    "transport",
    "bytes",
    "updates_applied",
    "transfer_ms_p50",
    "swap_ms_p50",
    "swap_ms_max",
    "stall_ms_p50",
    "stall_ms_max",
    "stalls_unmeasured",
    "usual_gap_ms_p50",
    "copy_floor_ms",
]
