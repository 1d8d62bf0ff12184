"""``eval``: held-out evaluation, by ``python -m pipeline.eval`` and the periodic
evaluator pool (pipeline/evaluator.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass
class EvalConfig:
    """Held-out evaluation: ``python -m pipeline.eval`` and the periodic evaluator pool."""

    every_steps: int = 0  # evaluate checkpoints whose step is a multiple of this (0: off)
    every_s: float = 0.0  # or the newest checkpoint, at most this often (0: off)
    # also evaluate version 0 (the initial model) first, so the summary shows the
    # held-out accuracy before and after training
    at_start: bool = True
    problems: int = 64  # held-out problems (the arithmetic split has ~30 at difficulty <= 3)
    path: str | None = None  # a problem file to evaluate on; None: the task's held-out split
    samples: int = 4  # sampled completions per problem, for mean reward and pass@k
    temperature: float | None = None  # None: sampling.temperature
    max_new_tokens: int | None = None  # None: sampling.max_new_tokens
    batch_size: int = 32  # prompts per batch (each with 1 + samples completions)
    torch_threads: int = 1
    seed: int = 0
    final_timeout_s: float = 600.0  # the launcher waits this long for the final evaluation


def validate_eval(cfg: Any) -> None:
    """The ``eval`` section, against the checkpoints it reads and the task's split."""
    ev = cfg.eval
    for key in ("problems", "samples", "batch_size", "torch_threads"):
        if getattr(ev, key) <= 0:
            raise ValueError(f"eval.{key}={getattr(ev, key)} must be > 0")
    if ev.every_steps < 0 or ev.every_s < 0:
        raise ValueError("eval.every_steps and eval.every_s must be >= 0 (0 turns them off)")
    if ev.temperature is not None and ev.temperature <= 0:
        raise ValueError("eval.temperature must be > 0 (greedy accuracy is measured anyway)")
    if ev.max_new_tokens is not None and ev.max_new_tokens <= 0:
        raise ValueError("eval.max_new_tokens must be > 0")
    if ev.path and not os.path.exists(ev.path):
        raise ValueError(f"eval.path={ev.path} does not exist; give a JSONL or parquet file")
    every_ckpt = cfg.trainer.checkpoint_every
    if ev.every_steps and ev.every_steps % every_ckpt:
        raise ValueError(
            f"eval.every_steps={ev.every_steps} must be a multiple of trainer.checkpoint_every="
            f"{every_ckpt}: the evaluator reads checkpoints"
        )
    periodic = ev.every_steps or ev.every_s
    if periodic and cfg.task.kind == "file" and not ev.path:
        raise ValueError(
            "periodic evaluation with task.kind=file needs eval.path=heldout.jsonl: the "
            "training file has no held-out split"
        )
