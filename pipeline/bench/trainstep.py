"""``python -m pipeline.bench trainstep [--out FILE] [--repeats R] [--threads T]``: where
the trainer's step goes on this CPU, and what the lean step saves.

::

    builds  SmolLM2-135M-Instruct (the math experiment's model; ``--model`` names another
            folder or ``tiny``), the math job's step: 16 samples (4 prompts x 4) of real
            arithmetic prompts in the chat template, 32 sampled tokens each
    runs    per repeat, the two steps in turn on the same batch and weights:
            ``former``  what trainer/step.py did before 2026-11-28: the vocabulary
                        projection and log-softmax at every position, AdamW's default
                        on the CPU (a Python loop over the parameters)
            ``lean``    the trainer's own code now: pipeline/logprobs.completion_logprobs
                        (projection from the first completion position on, logits_to_keep)
                        and trainer/backends/base.adamw (fused)
            each timed by phase: forward + log-probs + loss, backward, optimizer step
    writes  --out JSON (every repeat's phases, per step the median and range), a Markdown
            table beside it; prints the table and the speed-up

The optimizer steps use lr 0, so every repeat trains the same weights.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.bench.common import device_name, print_table, write_json
from pipeline.logprobs import completion_logprobs, pad_sequences, sampling_logprobs
from trainer.backends.base import adamw
from trainer.loss import policy_loss

PHASES = ("forward_s", "backward_s", "optimizer_s")


def math_batch(tokenizer, rows: int, group: int, completion: int, seed: int):
    """Real prompts of the math task in the chat template, random sampled ids."""
    from pipeline.tasks import DEFAULT_SYSTEM_PROMPT, build_prompt_ids, make_task

    task, rng = make_task("arithmetic", seed=seed), np.random.default_rng(seed)
    prompts = []
    for _ in range(rows // group):
        ids = build_prompt_ids(tokenizer, task.sample().question, DEFAULT_SYSTEM_PROMPT)
        prompts += [np.asarray(ids)] * group
    vocab = len(tokenizer)
    completions = [rng.integers(0, vocab, completion) for _ in prompts]
    return pad_sequences(prompts, completions, tokenizer.pad_token_id or 0)


def former_logprobs(model, ids, attn, comp) -> torch.Tensor:
    """The projection and log-softmax at every position (trainer/step.py before)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1, :]
    token_lp = sampling_logprobs(logits, 1.0).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(token_lp, (1, 0)).masked_fill(~comp, 0.0)


def timed_step(model, optimizer, logprobs, batch) -> dict:
    ids, attn, comp = batch
    optimizer.zero_grad(set_to_none=False)
    t0 = time.perf_counter()
    new_lp = logprobs(model, ids, attn, comp)
    old = new_lp.detach()
    adv = torch.where(comp, 1.0, 0.0)
    weights = torch.full((ids.shape[0], 1), 1.0 / int(comp.sum()))
    loss = policy_loss(new_lp, old, adv, comp, 0.2, 0.28, 3.0, weights=weights).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    t3 = time.perf_counter()
    return {"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2}


def run(args) -> dict:
    from types import SimpleNamespace

    from pipeline.models import load_model, materialize_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_model(materialize_model(args.model), "float32", "cpu")
    model.train()
    batch = math_batch(tok, args.rows, args.group, args.completion, args.seed)
    params = list(model.parameters())
    t = SimpleNamespace(lr=0.0, weight_decay=0.0)
    steps = {
        "former": (torch.optim.AdamW(params, lr=0.0, foreach=False), former_logprobs),
        "lean": (adamw(params, t), lambda m, i, a, c: completion_logprobs(m, i, a, c, 1.0)),
    }
    for opt, lp in steps.values():  # warm-up: allocator, optimizer state
        timed_step(model, opt, lp, batch)
    rows = []
    for r in range(args.repeats):
        for name, (opt, lp) in steps.items():
            phases = timed_step(model, opt, lp, batch)
            rows.append({"repeat": r, "step": name, **phases, "total_s": sum(phases.values())})
            print(f"repeat {r + 1}/{args.repeats} {name}: {rows[-1]['total_s']:.2f} s", flush=True)
    ids, _, comp = batch
    sampled, total = int(comp.sum()), int(ids.numel())
    summary = []
    for name in steps:
        mine = [x for x in rows if x["step"] == name]
        row = {"step": name}
        for k in (*PHASES, "total_s"):
            vals = [x[k] for x in mine]
            row[k] = round(statistics.median(vals), 3)
            row[k.replace("_s", "_range")] = [round(min(vals), 3), round(max(vals), 3)]
        row["sampled_tokens_per_s_per_core"] = round(sampled / row["total_s"] / args.threads, 1)
        summary.append(row)
    speedup = summary[0]["total_s"] / summary[1]["total_s"]
    return {
        "device": device_name("cpu"),
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "threads": args.threads,
        "batch": {"rows": args.rows, "width": ids.shape[1], "sampled": sampled, "ids": total},
        "rows": rows,
        "summary": summary,
        "speedup_total": round(speedup, 2),
    }


def markdown(result: dict) -> str:
    b = result["batch"]
    lines = [
        f"# trainer step phases, {result['device']}, {result['date']}",
        "",
        f"`python -m pipeline.bench trainstep`: {result['model']}, {result['threads']} torch "
        f"thread(s), {b['rows']} rows x {b['width']} ids ({b['sampled']} sampled); medians "
        f"over {len(result['rows']) // 2} interleaved repeats, [min, max].",
        "",
        "| step | forward+log-probs+loss s | backward s | optimizer s | total s "
        "| sampled tokens/s/core |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["summary"]:
        cells = [f"{r[k]:.3f} {r[k.replace('_s', '_range')]}" for k in (*PHASES, "total_s")]
        lines.append(
            f"| {r['step']} | " + " | ".join(cells) + f" | {r['sampled_tokens_per_s_per_core']} |"
        )
    lines += ["", f"lean / former total: {result['speedup_total']}x faster"]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench trainstep")
    p.add_argument("--out", default="outputs/bench/trainstep.json")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer: 1)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--completion", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.threads < 1 or args.rows % args.group:
        p.error("--repeats and --threads at least 1; --rows a multiple of --group")
    result = run(args)
    print_table(result["summary"], ["step", *PHASES, "total_s", "sampled_tokens_per_s_per_core"])
    print(f"lean / former: {result['speedup_total']}x")
    write_json(args.out, result)
    md = Path(args.out).with_suffix(".md")
    md.write_text(markdown(result))
    print(f"wrote {md}")
    return 0
