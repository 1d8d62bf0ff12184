"""TRL's GRPOTrainer on the job of ``+exp=math``: the reference issue 36 compares
``make run`` with, re-run on the machine at hand (TRL is not a dependency of this
project: run it from a venv that has it, e.g. one whose .pth adds this project's venv
and ``pip install trl==1.16.0 datasets``)::

    TRLVENV/bin/python bench/trl_grpo.py --out bench/results/trl-grpo-DATE.json

The job: the SmolLM2-135M-Instruct folder the pipeline trains (pipeline/models.py), the
prompts of ``pipeline/tasks.py``'s ArithmeticTask (difficulty 2, seed 0) in the chat
template, its reward (``pipeline.tasks.reward``), 4 prompts x 4 completions per step,
32 new tokens, temperature 1, lr 2e-5, 20 steps, the DAPO token-mean loss, no KL
(beta 0), float32, torch threads = the machine's cores. Prints and writes: the total
wall (the script's start to the end of training: imports, model load included), the
time to step 1, and the steady seconds per step (steps 3..20, as
``python -m pipeline.bench makerun`` counts them: STEADY_FROM)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

T0 = time.monotonic()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
STEADY_FROM = 3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.models import materialize_model
    from pipeline.tasks import ArithmeticTask, reward

    torch.set_num_threads(os.cpu_count() or 1)
    path = materialize_model("smollm2-135m-instruct")
    task = ArithmeticTask(difficulty=2, seed=0)
    problems = [task.sample() for _ in range(4 * args.steps)]
    data = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": p.question}], "answer": p.answer}
            for p in problems
        ]
    )

    def math_reward(completions, answer, **_):
        return [reward(c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, _args, state, _control, **_kw):
            stamps.append(time.monotonic())
            print(f"step {state.global_step} at {stamps[-1] - T0:.1f} s", flush=True)

    cfg = GRPOConfig(
        output_dir="/tmp/trl-grpo-out",
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=32,
        temperature=1.0,
        learning_rate=2e-5,
        max_steps=args.steps,
        loss_type="dapo",
        beta=0.0,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        shuffle_dataset=False,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=math_reward,
        args=cfg,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(path),
        callbacks=[Clock()],
    )
    trainer.train()
    total = time.monotonic() - T0
    steady = (stamps[-1] - stamps[STEADY_FROM - 1]) / (len(stamps) - STEADY_FROM)
    row = {
        "total_s": round(total, 1),
        "first_step_s": round(stamps[0] - T0, 1),
        "steady_s_per_step": round(steady, 2),
        "samples_per_s": round(16 / steady, 3),
        "steps": len(stamps),
        "torch_threads": torch.get_num_threads(),
        "load_1min_end": os.getloadavg()[0],
    }
    print(json.dumps(row))
    rows = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = json.load(f)
    with open(args.out, "w") as f:
        json.dump([*rows, row], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
