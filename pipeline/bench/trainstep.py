"""``python -m pipeline.bench trainstep [--out FILE] [--repeats R] [--threads T]``: where
the trainer's step goes on this CPU, and what the lean step saves.

::

    builds  SmolLM2-135M-Instruct (the math experiment's model; ``--model`` names another
            folder or ``tiny``), the math job's step: one TrainBatch of 16 samples (4 real
            arithmetic prompts in the chat template x 4 completions the model samples at
            temperature 1, at most 32 tokens each, as the actor would)
    runs    per repeat, the three steps in turn on the same batch and weights:
            ``former``  trainer/step.py before 2026-11-28: padded rows, the vocabulary
                        projection and log-softmax at every position, AdamW's default on
                        the CPU (a Python loop over the parameters)
            ``padded``  before the packed layout: padded rows, the projection from the
                        first completion position on (logits_to_keep), fused AdamW
            ``packed``  the trainer's own code now (trainer/step.py token_logprobs):
                        pipeline/packing.py, one row without padding, each prompt once
            each timed by phase (wall clock) and in CPU seconds of the process (the
            machine is shared: CPU time moves less with the load than wall time):
            collation (trainer/collate.py, both layouts), forward + log-probs + loss,
            backward, clip + optimizer step; then, once per repeat, the snapshot a
            publish takes on the training thread (WeightPublisher.submit's copy)
    writes  --out JSON (every repeat's phases and the 1-minute load average, per step the
            median and range, the tokens each forward computes), a Markdown table beside
            it; prints the table and the speed-ups

The optimizer steps use lr 0, so every repeat trains the same weights; the loss of each
step is recorded, and the packed and padded losses must agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.bench.common import device_name, print_table, write_json
from pipeline.logprobs import completion_logprobs, sampling_logprobs
from pipeline.messages import unpack_i32
from pipeline.transfer.buckets import bucket_layout, flatten, named_tensors
from trainer.backends.base import adamw
from trainer.collate import collate
from trainer.loss import policy_loss
from trainer.step import token_logprobs

PHASES = ("collate_s", "forward_s", "backward_s", "optimizer_s")


def math_batch(model, tokenizer, prompts: int, group: int, completion: int, seed: int):
    """One TrainBatch of the math job: real prompts, completions sampled by the model."""
    from pipeline.messages import SCHEMA_VERSION, Sample, TrainBatch, pack_f32, pack_i32, rle_encode
    from pipeline.tasks import DEFAULT_SYSTEM_PROMPT, build_prompt_ids, make_task

    task, rng = make_task("arithmetic", seed=seed), np.random.default_rng(seed)
    torch.manual_seed(seed)
    samples, prompt_ids, group_ids = [], [], []
    for g in range(prompts):
        ids = build_prompt_ids(tokenizer, task.sample().question, DEFAULT_SYSTEM_PROMPT)
        x = torch.tensor([ids] * group)
        with torch.no_grad():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=completion,
                pad_token_id=tokenizer.pad_token_id,
            )
        for i, row in enumerate(out[:, len(ids) :].tolist()):
            end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else None
            c = np.array(row[:end])
            samples.append(
                Sample(
                    index=i,
                    completion_ids=pack_i32(c),
                    logprobs=pack_f32(-rng.uniform(0.1, 3.0, len(c))),
                    versions=rle_encode([0] * len(c)),
                    reward=float(i % 2),
                    finished=True,
                    advantage=1.0 if i % 2 else -1.0,
                )
            )
            prompt_ids.append(pack_i32(ids))
            group_ids.append(f"g{g}")
    return TrainBatch(
        schema=SCHEMA_VERSION,
        batch_id="bench",
        group_ids=group_ids,
        prompt_ids=prompt_ids,
        samples=samples,
        temperature=1.0,
    )


def former_logprobs(model, mb) -> torch.Tensor:
    """The projection and log-softmax at every position (trainer/step.py before)."""
    ids = mb.ids
    logits = model(input_ids=ids, attention_mask=mb.attn).logits[:, :-1, :]
    token_lp = sampling_logprobs(logits, 1.0).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(token_lp, (1, 0)).masked_fill(~mb.comp, 0.0)


def padded_logprobs(model, mb) -> torch.Tensor:
    return completion_logprobs(model, mb.ids, mb.attn, mb.comp, mb.temperature)


def timed_step(model, optimizer, logprobs, batch, params) -> dict:
    optimizer.zero_grad(set_to_none=False)
    c0, t0 = time.process_time(), time.perf_counter()
    mb = collate(batch, 0, torch.device("cpu"))
    t1 = time.perf_counter()
    new_lp = logprobs(model, mb)
    weights = torch.full((mb.comp.shape[0], 1), 1.0 / mb.tokens)
    loss = policy_loss(new_lp, mb.actor_lp, mb.advantages, mb.comp, 0.2, 0.28, 3.0, weights=weights)
    t2 = time.perf_counter()
    loss.loss.backward()
    t3 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    t4, c4 = time.perf_counter(), time.process_time()
    return {
        "cpu_s": c4 - c0,  # every thread of this process: core-seconds, whatever the load
        "collate_s": t1 - t0,
        "forward_s": t2 - t1,
        "backward_s": t3 - t2,
        "optimizer_s": t4 - t3,
        "loss": float(loss.loss.detach()),
    }


def publish_copy_s(model) -> float:
    """The training thread's share of a publish: the snapshot WeightPublisher.submit takes
    (fp32: full_parameters hands the parameters themselves, submit flattens them)."""
    t0 = time.perf_counter()
    named = named_tensors({n: p.detach() for n, p in model.named_parameters()})
    flatten(dict(named), bucket_layout(named, 64 << 20))
    return time.perf_counter() - t0


def run(args) -> dict:
    from types import SimpleNamespace

    from pipeline.models import load_model, materialize_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(materialize_model(args.model), "float32", "cpu")
    batch = math_batch(model, tok, args.prompts, args.group, args.completion, args.seed)
    model.train()
    params = list(model.parameters())
    t = SimpleNamespace(lr=0.0, weight_decay=0.0)
    steps = {
        "former": (torch.optim.AdamW(params, lr=0.0, foreach=False), former_logprobs),
        "padded": (adamw(params, t), padded_logprobs),
        "packed": (adamw(params, t), lambda m, mb: token_logprobs(m, mb, None)),
    }
    for opt, lp in steps.values():  # warm-up: allocator, optimizer state
        timed_step(model, opt, lp, batch, params)
    rows = []
    for r in range(args.repeats):
        for name, (opt, lp) in steps.items():
            load = os.getloadavg()[0]
            phases = timed_step(model, opt, lp, batch, params)
            total = sum(phases[k] for k in PHASES)
            rows.append({"repeat": r, "step": name, **phases, "total_s": total, "load_1m": load})
            print(f"repeat {r + 1}/{args.repeats} {name}: {total:.2f} s (load {load:.2f})")
        rows.append({"repeat": r, "step": "publish copy", "total_s": publish_copy_s(model)})
    mb = collate(batch, 0, torch.device("cpu"))
    sampled = mb.tokens
    # ids each forward computes: rows x width (packed: a row per distinct prompt)
    computed = {
        "former": int(mb.ids.numel()),
        "padded": int(mb.ids.numel()),
        "packed": int(mb.packed.ids.numel()),
    }
    distinct = {p: len(unpack_i32(p)) for p in batch.prompt_ids}
    packed_real = sum(distinct.values()) + sum(len(s.tokens()) for s in batch.samples)
    summary = []
    for name in (*steps, "publish copy"):
        mine = [x for x in rows if x["step"] == name]
        row = {"step": name}
        for k in (*PHASES, "total_s") if name in steps else ("total_s",):
            vals = [x[k] for x in mine]
            row[k] = round(statistics.median(vals), 3)
            row[k.replace("_s", "_range")] = [round(min(vals), 3), round(max(vals), 3)]
        if name in steps:
            row["forward_tokens"] = computed[name]
            row["loss"] = mine[0]["loss"]
            per_s = sampled / row["total_s"] / args.threads
            row["sampled_tokens_per_s_per_core"] = round(per_s, 1)
            cpu = statistics.median(x["cpu_s"] for x in mine)
            row["cpu_s"] = round(cpu, 3)
            row["cpu_range"] = [
                round(min(x["cpu_s"] for x in mine), 3),
                round(max(x["cpu_s"] for x in mine), 3),
            ]
            row["sampled_tokens_per_cpu_s"] = round(sampled / cpu, 1)
            row["load_1m_range"] = [
                min(x["load_1m"] for x in mine),
                max(x["load_1m"] for x in mine),
            ]
        summary.append(row)
    by = {r["step"]: r for r in summary}
    return {
        "device": device_name("cpu"),
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "threads": args.threads,
        "batch": {
            "rows": len(batch.samples),
            "width": int(mb.ids.shape[1]),
            "sampled": sampled,
            "real_ids": int(mb.attn.sum()),
            "padded_ids": int(mb.ids.numel()),
            "packed_ids": computed["packed"],
            "packed_real_ids": packed_real,
            "packed_rows": int(mb.packed.ids.shape[0]),
        },
        "rows": rows,
        "summary": summary,
        "speedup_total": {
            "packed_vs_padded": round(by["padded"]["total_s"] / by["packed"]["total_s"], 2),
            "packed_vs_former": round(by["former"]["total_s"] / by["packed"]["total_s"], 2),
        },
        "loss_packed_minus_padded": by["packed"]["loss"] - by["padded"]["loss"],
    }


def markdown(result: dict) -> str:
    b = result["batch"]
    n = len([r for r in result["rows"] if r["step"] == "packed"])
    lines = [
        f"# trainer step phases, {result['device']}, {result['date']}",
        "",
        f"`python -m pipeline.bench trainstep`: {result['model']}, {result['threads']} torch "
        f"thread(s), the math job's step: {b['rows']} samples of 4 real prompts x 4 sampled "
        f"completions, {b['sampled']} sampled tokens; padded {b['rows']} rows x "
        f"{b['width']} = {b['padded_ids']} ids ({b['real_ids']} real), packed "
        f"{b['packed_rows']} rows (one per prompt) = {b['packed_ids']} ids "
        f"({b['packed_real_ids']} real: each prompt once). Medians over {n} interleaved "
        "repeats, [min, max]; CPU s: the process's CPU seconds (core-seconds).",
        "",
        "| step | forward ids | collate s | forward+log-probs+loss s | backward s "
        "| clip+optimizer s | total s | sampled tokens/s/core | CPU s "
        "| sampled tokens/CPU-s | load 1-min |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["summary"]:
        if "collate_s" not in r:
            continue
        cells = [f"{r[k]:.3f} {r[k.replace('_s', '_range')]}" for k in (*PHASES, "total_s")]
        lo, hi = r["load_1m_range"]
        lines.append(
            f"| {r['step']} | {r['forward_tokens']} | "
            + " | ".join(cells)
            + f" | {r['sampled_tokens_per_s_per_core']} | {r['cpu_s']:.3f} {r['cpu_range']} "
            f"| {r['sampled_tokens_per_cpu_s']} | {lo:.2f}-{hi:.2f} |"
        )
    pub = next(r for r in result["summary"] if r["step"] == "publish copy")
    s = result["speedup_total"]
    lines += [
        "",
        f"packed / padded: {s['packed_vs_padded']}x faster; packed / former: "
        f"{s['packed_vs_former']}x. Loss packed - padded: "
        f"{result['loss_packed_minus_padded']:.2e}. "
        f"A publish's snapshot on the training thread: {pub['total_s']:.3f} s "
        f"{pub['total_range']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench trainstep")
    p.add_argument("--out", default="outputs/bench/trainstep.json")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer: 1)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--completion", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads at least 1")
    result = run(args)
    cols = ["step", *PHASES, "total_s", "sampled_tokens_per_s_per_core", "cpu_s"]
    print_table(result["summary"], cols)
    print(f"speed-up: {result['speedup_total']}")
    write_json(args.out, result)
    md = Path(args.out).with_suffix(".md")
    md.write_text(markdown(result))
    print(f"wrote {md}")
    return 0
