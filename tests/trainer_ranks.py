"""One trainer rank driven on fixed synthetic batches, for the multi-rank tests.

``python -m tests.trainer_ranks OUT.json MODEL_DIR BACKEND ZERO_STAGE STEPS [options]``
with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (tests/test_deepspeed.py
starts the ranks). Rank 0 writes ``{"loss": [...], "grad_norm": [...]}`` per
step it ran. ``--save-at K`` checkpoints after step K into ``--ckpt``;
``--resume`` starts from that checkpoint (at step K+1). ``--weights PATH``: rank 0
saves the weights after the last step (a safetensors file, HF names): the backend's
full parameter set, or with ``--publish REDIS_URL`` what a real actor receiver in rank
0's process received when the trainer published them (the test compares them with
another backend's, never with the publisher's own gather). ``--hang`` waits after
writing OUT (the test SIGKILLs the group). ``--routes`` (a MoE model): every sample
carries random routes, replayed in training; OUT adds ``route_mismatch`` and
``kl_actor_free`` (step 0 probes) per step (and, with deepspeed, ``moe_leaves``: the
ZeRO-3 leaf modules).
``--nan-at K``: step K runs with every logit NaN (a forward hook), and OUT says
whether each step was ``applied`` and whether step K left the weights
``unchanged_at_nan`` (every rank's own copy compared).
``--expert-parallel N``: ``trainer.expert_parallel`` (DeepSpeed AutoEP, ZeRO-3).
"""

from __future__ import annotations

import argparse
import json
import os
import threading

import numpy as np
import torch
from omegaconf import OmegaConf

from pipeline import checkpoint as layout
from pipeline import routing
from pipeline.config import Config
from pipeline.messages import (
    SCHEMA_VERSION,
    Sample,
    TrainBatch,
    encode,
    pack_f32,
    pack_i32,
    rle_encode,
)
from trainer import checkpoint
from trainer.backends import make_backend
from trainer.backends.base import all_ranks_finite
from trainer.ranks import Plan, barrier, close, init_ranks, my_share
from trainer.step import train_step

VOCAB_LOW, VOCAB_HIGH = 10, 90  # printable characters of the tiny tokenizer


def synthetic_routes(rng, rows: int, layout) -> bytes:
    """Random routes (k distinct experts per row and layer) of ``rows`` rows."""
    order = np.argsort(rng.random((rows, layout.layers, layout.experts)), axis=-1)
    return layout.pack(order[..., : layout.k])


def synthetic_batches(step: int, n_batches: int = 3, layout=None) -> list[TrainBatch]:
    """The same micro-batches for a step in every process (seeded by the step);
    ``layout`` (a RouteLayout): every sample carries random routes of it."""
    rng = np.random.default_rng(1000 + step)
    out = []
    for b in range(n_batches):
        rows = int(rng.integers(2, 4))
        samples, prompts = [], []
        for i in range(rows):
            n = int(rng.integers(4, 12))
            samples.append(
                Sample(
                    index=i,
                    completion_ids=pack_i32(rng.integers(VOCAB_LOW, VOCAB_HIGH, n)),
                    logprobs=pack_f32(-rng.uniform(3.0, 6.0, n)),
                    versions=rle_encode([step] * n),
                    reward=float(i % 2),
                    finished=True,
                    advantage=1.0 if i % 2 else -1.0,
                )
            )
            prompts.append(pack_i32(rng.integers(VOCAB_LOW, VOCAB_HIGH, int(rng.integers(3, 9)))))
            if layout is not None:
                rows_fed = len(prompts[-1]) // 4 + n - 1
                samples[-1].routes = synthetic_routes(rng, rows_fed, layout)
        out.append(
            TrainBatch(
                schema=SCHEMA_VERSION,
                batch_id=f"s{step}b{b}",
                group_ids=[f"s{step}b{b}"] * rows,
                prompt_ids=prompts,
                samples=samples,
                temperature=1.0,
                route_layout=layout.as_list() if layout is not None else [],
            )
        )
    return out


def nan_logits(_module, _inputs, out):
    out.logits = out.logits * float("nan")
    return out


def config(backend: str, stage: int, world: int, dtype: str):
    cfg = OmegaConf.structured(Config)
    cfg.trainer.backend, cfg.trainer.zero_stage, cfg.trainer.world_size = backend, stage, world
    cfg.trainer.lr, cfg.trainer.dtype, cfg.trainer.collective_timeout_s = 1e-3, dtype, 60.0
    return cfg


def publish_and_receive(backend, ranks, url: str, model_dir: str) -> dict | None:
    """Every rank gathers (collective under ZeRO-3); rank 0 publishes to a real actor
    receiver in this process and returns the parameters the actor received."""
    params = backend.full_parameters()
    if not ranks.is_main:
        return None
    from actor.engines.hf import HFEngine
    from actor.weight_receiver import WeightReceiver
    from pipeline.models import load_model
    from pipeline.streams import Names, connect, wait_until
    from trainer.weight_publisher import WeightPublisher

    client, names, secret = connect(url), Names("test", "ds-publish"), "s"
    actor_model, tok = load_model(model_dir)
    engine = HFEngine(actor_model, tok, temperature=1.0, top_p=1.0, top_k=0)
    publisher = WeightPublisher(client, names, "127.0.0.1", 0.05, timeout_s=20, secret=secret)
    receiver = WeightReceiver(client, names, "actor-0", engine, timeout_s=20, secret=secret)
    receiver.start()
    try:
        assert wait_until(lambda: client.xlen(names.stream("joins")) >= 1, 20)
        publisher.submit(7, params)
        assert wait_until(lambda: engine.version == 7, 30), "the actor got no weights"
        return {n: p.detach().clone() for n, p in actor_model.named_parameters()}
    finally:
        receiver.stop()
        publisher.close(timeout_s=5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("model_dir")
    ap.add_argument("backend")
    ap.add_argument("stage", type=int)
    ap.add_argument("steps", type=int)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--publish", default="")
    ap.add_argument("--weights", default="")
    ap.add_argument("--hang", action="store_true")
    ap.add_argument("--nan-at", type=int, default=-1)
    ap.add_argument("--routes", action="store_true")
    ap.add_argument("--expert-parallel", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", 1))
    cfg = config(args.backend, args.stage, world, args.dtype)
    cfg.trainer.expert_parallel = args.expert_parallel
    ranks = init_ranks(world, "cpu", 60.0, need_dist=args.backend == "deepspeed")
    resume = layout.latest(args.ckpt) if args.resume else None
    backend = make_backend(cfg, ranks, args.model_dir, resume)
    start = layout.load_state(resume)["version"] if resume else 0
    result: dict = {"loss": [], "grad_norm": [], "start": start, "applied": []}
    module = backend.engine.module if hasattr(backend, "engine") else backend.model
    route_layout = routing.layout_of(module) if args.routes else None
    if args.routes and args.backend == "deepspeed":
        from deepspeed.utils import z3_leaf_module

        result["moe_leaves"] = sum(z3_leaf_module(m) for m in module.modules())
    for step in range(start, args.steps):
        batches = synthetic_batches(step, layout=route_layout)
        tokens = sum(len(s.tokens()) for b in batches for s in b.samples)
        plan = Plan(version=step, batches=[encode(b) for b in batches], tokens=tokens)
        mine, slots = my_share(ranks, plan)
        first = mine[0] if mine else batches[0]
        poisoned = step == args.nan_at
        if poisoned:
            before = [p.detach().clone() for p in module.parameters()]
            handle = module.register_forward_hook(nan_logits)
        version = step if args.routes else None  # step 0 probes (trainer.route_probe_every)
        m = train_step(backend, ranks, mine, slots, first, cfg.trainer, 0, tokens, version=version)
        if poisoned:
            handle.remove()
            same = all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
            result["unchanged_at_nan"] = bool(all_ranks_finite(ranks, same))
        result["applied"].append(m["applied"])
        result["loss"].append(m["loss"])
        result["grad_norm"].append(m["grad_norm"])
        if args.routes:
            result.setdefault("route_mismatch", []).append(m["route_mismatch"])
            result.setdefault("kl_actor_free", []).append(m.get("kl_actor_free"))
        if args.save_at == step + 1:
            checkpoint.save(args.ckpt, backend, {"version": step + 1}, 2, ranks)
    if args.publish:
        weights = publish_and_receive(backend, ranks, args.publish, args.model_dir)
    elif args.weights:
        weights = backend.full_parameters()  # collective under ZeRO-3
    if args.weights and ranks.is_main:
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in weights.items()}, args.weights)
    if ranks.is_main:
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(args.out + ".tmp", args.out)
    if args.hang:
        threading.Event().wait()
    # leave the group together, as trainer/main.py does: a rank that exits with the
    # process group alive can abort in teardown ("terminate called without an
    # active exception", seen once in CI under ZeRO-3)
    barrier(ranks)
    close(ranks)


if __name__ == "__main__":
    main()
