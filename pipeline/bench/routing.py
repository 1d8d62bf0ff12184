"""``python -m pipeline.bench routing [--out FILE] [--engines hf,vllm] [--repeats R]``:
what Keep Routing buys, on the tiny MoE with a bf16 trainer against an fp32 actor.

::

    builds  tiny-moe (pipeline/models.py: Qwen3-MoE shape, 8 experts, top-2, two sparse
            layers, random weights) and each engine (``actor.engine``) in float32 with
            ``sampling.keep_routing=true``, at temperature 1
    runs    per repeat (a new seed, new prompts) and per engine, engines interleaved:
            the actor samples ``--prompts`` x ``--group`` completions of ``--new-tokens``
            and records each token's log-prob and experts; the trainer's model (fp32
            weights, bf16 autocast: ``trainer.dtype=bfloat16``) recomputes the sampled
            tokens' log-probs over the same ids twice:
            ``free``      its own routing (what a trainer without Keep Routing trains)
            ``replayed``  the actor's routes forced (pipeline/routing.replay)
            and, as a control, once more in float32 with its own routing
    reports per engine and repeat: the share of (token, MoE layer) pairs and of tokens
            whose live top-k set differs from the actor's (bf16 and fp32 trainer), the
            trainer-vs-actor KL (k3 estimator, mean over sampled tokens) free and
            replayed, and their ratio; the medians over repeats with [min, max]
    writes  --out JSON (every measurement), a Markdown table beside it

Every sampled token here is of version 0 (no training happens), so the KL measures the
engines' mismatch only, never a policy change.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from pipeline.bench.common import device_name, print_table, write_json

COLUMNS = [
    "engine",
    "actor_nll",
    "mismatch_pairs_bf16",
    "mismatch_tokens_bf16",
    "mismatch_pairs_fp32",
    "kl_free",
    "kl_replayed",
    "kl_ratio",
]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench routing", description=__doc__)
    p.add_argument("--out", default="bench/results/routing.json")
    p.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, vllm")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--model", default="tiny-moe", help="tiny-moe, tiny-olmoe or a folder")
    p.add_argument(
        "--init-std",
        type=float,
        default=0.0,
        help="build tiny-moe with this initializer_range instead (0: tiny-moe as built, "
        "0.02); larger gives sharper next-token distributions, as a trained model has",
    )
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in args.engines if e not in ("hf", "vllm")]
    if bad or not args.engines:
        p.error(f"--engines {','.join(bad) or '(none)'}: name hf and/or vllm")
    if min(args.repeats, args.prompts, args.group, args.new_tokens) < 1:
        p.error("--repeats, --prompts, --group and --new-tokens must be at least 1")
    return args


def k3(actor_lp: torch.Tensor, trainer_lp: torch.Tensor) -> float:
    """Mean k3 estimate of KL(actor || trainer) over tokens the actor sampled."""
    d = (trainer_lp - actor_lp).double()  # log(p_trainer / p_actor)
    return float((d.exp() - 1 - d).mean())


def rows_tensor(completions, prompts, width: int, layers: int, k: int):
    """Per sample [width, L, k] long routes (prompt + completion - 1 rows) and [width] valid."""
    routes = torch.zeros((len(completions), width, layers, k), dtype=torch.long)
    valid = torch.zeros((len(completions), width), dtype=torch.bool)
    for i, (c, p) in enumerate(zip(completions, prompts, strict=True)):
        r = np.asarray(c.routes)
        expect = len(p) + len(c.tokens) - 1
        if r.shape[0] != expect:
            raise RuntimeError(
                f"sample {i}: the engine recorded {r.shape[0]} route rows, not {expect} "
                "(prompt + completion - 1)"
            )
        routes[i, : len(r)] = torch.from_numpy(r.astype(np.int64))
        valid[i, : len(r)] = True
    return routes, valid


def live_routes(model, ids, attn, autocast: torch.dtype | None) -> np.ndarray:
    """[batch, width, L, k] the model's own top-k ids over ``ids`` (ascending per row)."""
    from pipeline import routing

    with (
        torch.no_grad(),
        torch.autocast("cpu", dtype=autocast, enabled=autocast is not None),
        routing.capture(model) as calls,
    ):
        model(input_ids=ids, attention_mask=attn)
    return routing.stack_forward(calls[0], ids.shape[0])


def mismatch(live: np.ndarray, actor: torch.Tensor, valid: torch.Tensor) -> tuple[float, float]:
    """Share of valid (token, layer) pairs, and of valid tokens, whose top-k sets differ."""
    differ = (live != np.sort(actor.numpy(), axis=-1)).any(axis=-1)  # [B, T, L]
    v = valid.numpy()
    pairs = differ[v]  # [n, L]
    return float(pairs.mean()), float(pairs.any(axis=-1).mean())


def measure(cfg, engine, trainer_model, prompts: list[list[int]], args, seed: int) -> dict:
    from pipeline import routing
    from pipeline.logprobs import completion_logprobs, pad_sequences

    torch.manual_seed(seed)
    t0 = time.monotonic()
    completions = engine.generate(prompts, args.new_tokens)
    gen_s = time.monotonic() - t0
    layout = routing.layout_of(trainer_model)
    p_arr = [np.asarray(p) for p in prompts]
    ids, attn, comp = pad_sequences(p_arr, [np.asarray(c.tokens) for c in completions])
    routes, valid = rows_tensor(completions, prompts, ids.shape[1], layout.layers, layout.k)
    actor_lp = torch.cat([torch.tensor(c.logprobs, dtype=torch.float64) for c in completions])
    temp = float(cfg.sampling.temperature)

    def trainer_lp(autocast, replay: bool) -> torch.Tensor:
        forced = routing.replay(trainer_model, routes, valid) if replay else nullcontext()
        with torch.no_grad(), forced:
            lp = completion_logprobs(trainer_model, ids, attn, comp, temp, 1.0, 0, None, autocast)
        return lp[comp].double()

    bf16 = torch.bfloat16
    pairs_bf16, tokens_bf16 = mismatch(live_routes(trainer_model, ids, attn, bf16), routes, valid)
    pairs_fp32, tokens_fp32 = mismatch(live_routes(trainer_model, ids, attn, None), routes, valid)
    kl_free = k3(actor_lp, trainer_lp(bf16, replay=False))
    kl_replayed = k3(actor_lp, trainer_lp(bf16, replay=True))
    kl_fp32 = k3(actor_lp, trainer_lp(None, replay=False))
    return {
        "sampled_tokens": int(comp.sum()),
        "route_rows": int(valid.sum()),
        "generate_s": round(gen_s, 2),
        # mean negative log-prob of the sampled tokens (nats): near log(vocab) for a
        # model whose next-token distributions are flat, lower for a sharper one
        "actor_nll": float(-actor_lp.mean()),
        "mismatch_pairs_bf16": pairs_bf16,
        "mismatch_tokens_bf16": tokens_bf16,
        "mismatch_pairs_fp32": pairs_fp32,
        "mismatch_tokens_fp32": tokens_fp32,
        "kl_free": kl_free,
        "kl_replayed": kl_replayed,
        "kl_fp32_free": kl_fp32,
        "kl_ratio": kl_free / kl_replayed if kl_replayed > 0 else float("inf"),
    }


def prompt_set(tokenizer, n: int, seed: int) -> list[list[int]]:
    from pipeline.tasks import DEFAULT_SYSTEM_PROMPT, build_prompt_ids, make_task

    task = make_task("arithmetic", seed=seed)
    questions = [task.sample().question for _ in range(n)]
    return [build_prompt_ids(tokenizer, q, DEFAULT_SYSTEM_PROMPT) for q in questions]


def summarize(rows: list[dict], engines: list[str]) -> list[dict]:
    out = []
    for engine in engines:
        mine = [r for r in rows if r["engine"] == engine]
        row = {"engine": engine, "repeats": len(mine)}
        for c in COLUMNS[1:]:
            vals = [r[c] for r in mine]
            med = statistics.median(vals)
            row[c] = f"{med:.3g} [{min(vals):.3g}, {max(vals):.3g}]"
            row[f"{c}_median"] = med
        out.append(row)
    return out


def markdown(summary: list[dict], meta: dict) -> str:
    lines = [
        "# Keep Routing: tiny MoE, bf16 trainer against an fp32 actor",
        "",
        f"`{meta['command']}` on {meta['device']}, {meta['date']}; medians over "
        f"{meta['repeats']} repeats (engines interleaved) with [min, max].",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in summary:
        lines.append("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
    lines += [
        "",
        "actor_nll: mean negative log-prob of the sampled tokens (nats; log(vocab) = "
        f"{meta['log_vocab']:.2f} for a flat distribution). "
        "mismatch_pairs / _tokens: share of (token, MoE layer) pairs / of tokens whose top-k "
        "expert set in the trainer's own forward differs from the actor's. kl_free / "
        "kl_replayed: trainer-vs-actor KL (k3, mean over sampled tokens) with the trainer's "
        "own routing / with the actor's routes replayed; kl_ratio = free / replayed.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from actor.engines import make_engine
    from actor.measure_episodes import compose
    from pipeline.models import load_model
    from pipeline.runtime import model_path

    args = parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a tiny model needs little
    engines, cfgs = {}, {}
    trainer_model = tokenizer = None
    if args.init_std > 0:  # a sharper variant of tiny-moe, built once into a temp folder
        from pipeline.models import _build_tiny_moe

        args.model = tempfile.mkdtemp(prefix="bench-routing-model-")
        _build_tiny_moe(Path(args.model), initializer_range=args.init_std)
    try:
        for name in args.engines:
            overrides = [
                "+exp=tiny_moe",  # the tiny MoE's context (actor.vllm.max_model_len 512)
                f"model.name={args.model}",
                "model.dtype=float32",
                f"actor.engine={name}",
                "actor.vllm.enforce_eager=true",
                "sampling.keep_routing=true",
                "sampling.temperature=1.0",
                f"sampling.max_new_tokens={args.new_tokens}",
            ]
            cfg = compose(overrides)
            t0 = time.monotonic()
            engines[name] = make_engine(cfg, model_path(cfg), cfg.run.seed)
            cfgs[name] = cfg
            print(f"{name} engine started in {time.monotonic() - t0:.1f} s", flush=True)
            if trainer_model is None:
                trainer_model, tokenizer = load_model(model_path(cfg), "float32")
                trainer_model.eval()
        rows = []
        for repeat in range(args.repeats):
            order = args.engines if repeat % 2 == 0 else args.engines[::-1]
            for name in order:
                prompts = [
                    p
                    for p in prompt_set(tokenizer, args.prompts, seed=repeat)
                    for _ in range(args.group)
                ]
                row = {"engine": name, "repeat": repeat}
                row.update(measure(cfgs[name], engines[name], trainer_model, prompts, args, repeat))
                print(
                    f"repeat {repeat} {name}: mismatch {row['mismatch_pairs_bf16']:.3f} of pairs, "
                    f"KL free {row['kl_free']:.2e} replayed {row['kl_replayed']:.2e}",
                    flush=True,
                )
                rows.append(row)
    finally:
        for engine in engines.values():
            engine.close()
    summary = summarize(rows, args.engines)
    meta = {
        "command": "python -m pipeline.bench routing " + " ".join(argv),
        "device": device_name("cpu"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "repeats": args.repeats,
        "log_vocab": float(np.log(len(tokenizer))),
        "model": args.model if args.init_std <= 0 else f"tiny-moe, init std {args.init_std}",
        "prompts": args.prompts,
        "group": args.group,
        "new_tokens": args.new_tokens,
    }
    print_table(summary, COLUMNS)
    write_json(args.out, {"meta": meta, "summary": summary, "rows": rows})
    md = Path(args.out).with_suffix(".md")
    md.write_text(markdown(summary, meta))
    print(f"wrote {md}")
    return 0
