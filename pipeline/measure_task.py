"""Measure a model's starting accuracy on the arithmetic task, per difficulty.

    python -m pipeline.measure_task --difficulty 1 2 3 --n 64

Samples one completion per held-out problem (batched, left padding, temperature sampling
without top-k/top-p truncation, fp32) and scores it with the task's reward. A good RL
starting point is 15-50% correct: enough signal, room to improve.
"""

from __future__ import annotations

import argparse
import time

import torch

from pipeline.models import DEFAULT_MODEL, load_model, materialize_model
from pipeline.tasks import (
    DEFAULT_DIFFICULTY,
    DEFAULT_SYSTEM_PROMPT,
    QUESTION_TEMPLATE,
    ArithmeticTask,
    build_prompt_ids,
    reward,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--difficulty", type=int, nargs="+", default=[DEFAULT_DIFFICULTY])
    parser.add_argument("--n", type=int, default=64, help="problems per difficulty")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system-prompt", default=DEFAULT_SYSTEM_PROMPT)
    parser.add_argument("--question-template", default=QUESTION_TEMPLATE)
    parser.add_argument("--show", type=int, default=0, help="print this many completions")
    return parser.parse_args()


def generate(model, tokenizer, prompts: list[list[int]], args) -> list[str]:
    """One sampled completion per prompt, decoded without special tokens."""
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **batch,
            do_sample=args.temperature > 0,
            temperature=args.temperature or None,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    width = batch["input_ids"].shape[1]
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def measure(model, tokenizer, difficulty: int, args) -> dict:
    problems = ArithmeticTask(difficulty, args.seed, args.question_template).heldout(args.n)
    start, correct, shown = time.time(), 0, 0
    for i in range(0, len(problems), args.batch_size):
        chunk = problems[i : i + args.batch_size]
        prompts = [build_prompt_ids(tokenizer, p.question, args.system_prompt) for p in chunk]
        for problem, text in zip(chunk, generate(model, tokenizer, prompts, args), strict=True):
            score = reward(text, problem.answer)
            correct += int(score)
            if shown < args.show:
                shown += 1
                print(f"[{score:.0f}] {problem.question} = {problem.answer} :: {text!r}")
    return {
        "difficulty": difficulty,
        "n": len(problems),
        "correct": correct,
        "seconds": time.time() - start,
    }


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(materialize_model(args.model))
    tokenizer.padding_side = "left"
    print(
        f"model={args.model} temperature={args.temperature} "
        f"max_new_tokens={args.max_new_tokens} system_prompt={args.system_prompt!r} "
        f"question_template={args.question_template!r}"
    )
    rows = [measure(model, tokenizer, d, args) for d in args.difficulty]
    print(f"{'difficulty':>10} {'n':>5} {'correct':>8} {'accuracy':>9} {'seconds':>8}")
    for r in rows:
        acc = r["correct"] / r["n"]
        print(
            f"{r['difficulty']:>10} {r['n']:>5} {r['correct']:>8} {acc:>9.1%} {r['seconds']:>8.1f}"
        )


if __name__ == "__main__":
    main()
