"""``python -m pipeline.bench scorers --out FILE``: groups/s of each preprocessor scorer.

For every model (default: ``tiny`` and the default SmolLM2-135M-Instruct) it builds
rollout groups like the math experiment's (chat-template arithmetic prompts,
G completions of a few reasoning lines each, some with a wrong step), then runs each
scorer through the preprocessor's own code path (``build_scorers`` + ``score_groups``)
on ``--read-count`` groups at a time, as one preprocessor process does, and reports
groups/s, samples/s and completion tokens/s (median of ``--repeats`` timed passes).
Scorers: ``reference``, ``prm-arithmetic``, ``prm-model`` (the same model as PRM),
``teacher`` (``tiny-teacher`` for ``tiny``; for other models the model itself, the
only teacher with its tokenizer offline). Prints a table and writes JSON with the
machine, date and load.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import time

import numpy as np
import torch
from omegaconf import OmegaConf

from pipeline.bench.common import device_name, print_table, write_json
from pipeline.config import Config
from pipeline.messages import SCHEMA_VERSION, RolloutGroup, Sample, pack_f32, pack_i32, rle_encode
from pipeline.models import load_model, materialize_model

SCORER_SETTINGS = {
    "reference": {"scorers": ["reference"]},
    "prm-arithmetic": {"scorers": ["prm"], "prm": {"kind": "arithmetic"}},
    "prm-model": {"scorers": ["prm"], "prm": {"kind": "model"}},
    "teacher": {"scorers": ["teacher"]},
}
TEACHERS = {"tiny": "tiny-teacher"}


def derivation(rng: random.Random) -> tuple[str, str]:
    """A question and a few-line answer; one in four has a wrong step."""
    a, b, c = rng.randint(2, 50), rng.randint(2, 50), rng.randint(2, 9)
    s = a + b
    wrong = rng.random() < 0.25
    lines = [f"First, {a} + {b} = {s + (1 if wrong else 0)}.", f"Then {s} * {c} = {s * c}."]
    lines.append(f"So the answer is {s * c}.")
    return f"What is ({a} + {b}) * {c}?", "\n".join(lines)


def make_groups(tokenizer, n_groups: int, group_size: int, seed: int = 0) -> list[RolloutGroup]:
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    groups = []
    for gi in range(n_groups):
        question, _ = derivation(rng)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        samples = []
        for k in range(group_size):
            ids = tokenizer(derivation(rng)[1], add_special_tokens=False)["input_ids"]
            samples.append(
                Sample(
                    index=k,
                    completion_ids=pack_i32(ids),
                    logprobs=pack_f32(-np.abs(nrng.normal(size=len(ids)))),
                    versions=rle_encode([0] * len(ids)),
                    reward=float(rng.random() < 0.5),
                    finished=True,
                )
            )
        groups.append(
            RolloutGroup(
                schema=SCHEMA_VERSION,
                group_id=f"bench-{gi}",
                actor="bench",
                problem_id=f"p{gi}",
                prompt_ids=pack_i32(prompt),
                samples=samples,
                temperature=0.7,
            )
        )
    return groups


def bench_scorer(cfg, path: str, groups, read_count: int, repeats: int) -> list[float]:
    """Seconds to score ``groups`` in reads of ``read_count``, per repeat (after a warm-up)."""
    from preprocessor.main import score_groups  # the pool's own code path
    from preprocessor.scorers import build_scorers

    scorers = build_scorers(cfg, path)
    score_groups(scorers, groups[:read_count], drop_no_signal=False)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, len(groups), read_count):
            score_groups(scorers, groups[i : i + read_count], drop_no_signal=False)
        runs.append(time.perf_counter() - t0)
    return runs


def config_for(model: str, path: str, scorer: str, budget: int):
    cfg = OmegaConf.structured(Config)
    cfg.model.name, cfg.model.path = model, path
    cfg.preprocessor.token_budget = budget
    cfg = OmegaConf.merge(cfg, {"preprocessor": SCORER_SETTINGS[scorer]})
    cfg.preprocessor.prm.model = model
    cfg.preprocessor.teacher.model = TEACHERS.get(model, model)
    return cfg


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench scorers")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--models", default="tiny,smollm2-135m-instruct")
    parser.add_argument("--scorers", default=",".join(SCORER_SETTINGS))
    parser.add_argument("--groups", type=int, default=16, help="groups timed per scorer")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--read-count", type=int, default=4, help="groups per scoring call")
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (pool default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes; the median counts")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models.split(","):
        path = materialize_model(model)
        _, tokenizer = load_model(path)
        groups = make_groups(tokenizer, args.groups, args.group_size)
        samples = sum(len(g.samples) for g in groups)
        tokens = sum(len(s.tokens()) for g in groups for s in g.samples)
        for scorer in args.scorers.split(","):
            cfg = config_for(model, path, scorer, args.token_budget)
            runs = bench_scorer(cfg, path, groups, args.read_count, args.repeats)
            seconds = float(np.median(runs))
            rows.append(
                {
                    "model": model,
                    "scorer": scorer,
                    "groups_per_s": len(groups) / seconds,
                    "samples_per_s": samples / seconds,
                    "tokens_per_s": tokens / seconds,
                    "seconds": seconds,
                    "seconds_runs": [round(r, 4) for r in runs],
                    "completion_tokens_mean": tokens / samples,
                }
            )
            print(f"{model} {scorer}: {rows[-1]['groups_per_s']:.2f} groups/s", flush=True)
    columns = ["model", "scorer", "groups_per_s", "samples_per_s", "tokens_per_s", "seconds"]
    print_table(rows, columns)
    write_json(
        args.out,
        {
            "bench": "scorers",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": {
                "device": device_name(),
                "host": socket.gethostname(),
                "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
                "torch": torch.__version__,
            },
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "results": rows,
        },
    )
    return 0
