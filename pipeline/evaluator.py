"""The evaluator pool: held-out evaluation of the trainer's checkpoints while the run
goes on. ``python -m pipeline.evaluator --config RUN_DIR/config.yaml --name evaluator``
(the launcher starts it when ``eval.every_steps`` or ``eval.every_s`` is set).

::

    reads   the initial model first (version 0, ``eval.at_start``), then
            RUN_DIR/checkpoints/step-*/ (each due checkpoint still on disk, oldest
            first; a copy of the weights is loaded here: nothing is asked of other pools)
    writes  metrics.jsonl ``eval`` records (step = policy version: greedy_accuracy,
            mean_reward, pass_at_k, ...), which the sinks send to TensorBoard/W&B;
            status hash (evaluated_version, last eval numbers)
    blocks  sleeping between polls of checkpoints/ (1 s)

Why a separate pool reading checkpoints, not the actor between groups nor another
weight receiver: evaluation never takes the actor's time (generation does not pause,
and the async/sync comparison is not skewed by it), it adds nothing to the weight
transfer (the trainer publishes to the actors only, and the publisher's accounting is
about actors), and each evaluation sees exactly one version, whole. The cost: it sees
only checkpointed versions (``eval.every_steps`` must be a multiple of
``trainer.checkpoint_every``) and it needs the checkpoint folder (a shared file system
when it runs on another machine). The final checkpoint is always evaluated, and the
launcher waits (``eval.final_timeout_s``) for that before it stops the pools; it runs
on every CPU the evaluator may use (training is over), the others on
``eval.torch_threads``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from pipeline import checkpoint
from pipeline.runtime import Pool, model_path, run_main, start_pool
from pipeline.streams import Names
from pipeline.telemetry import read_statuses

log = logging.getLogger("evaluator")
ROLE = "evaluator"


def checkpoints(run_dir: str) -> list[tuple[str, int]]:
    """(folder, version) of every complete checkpoint on disk, oldest first."""
    root = os.path.join(run_dir, "checkpoints")
    from pipeline.eval import checkpoint_version  # torch: not in the launcher's import path

    found = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if not name.startswith("step-") or name.endswith(".tmp"):
            continue
        try:
            version = checkpoint_version(path)
        except (OSError, ValueError, KeyError):  # rotated away while we looked
            continue
        if version is not None:
            found.append((path, version))
    return sorted(found, key=lambda pv: pv[1])


def next_due(
    found: list[tuple[str, int]], last: int, last_t: float, ev: Any, max_steps: int
) -> tuple[str, int] | None:
    """The checkpoint to evaluate now (``last``: the version evaluated last), or None:
    the oldest at a multiple of ``eval.every_steps`` or the final one; else, once
    ``eval.every_s`` has passed, the newest."""
    newer = [(p, v) for p, v in found if v > last]
    for path, version in newer:
        if version >= max_steps or (ev.every_steps and version % ev.every_steps == 0):
            return path, version
    if newer and ev.every_s and time.monotonic() - last_t >= ev.every_s:
        return newer[-1]
    return None


def evaluate_once(pool: Pool, path: str, version: int, problems: list) -> dict | None:
    """Load ``path`` and evaluate it; None when the folder vanished (rotated away)."""
    import torch

    from pipeline.eval import evaluate
    from pipeline.models import load_model

    cfg, t0 = pool.cfg, time.monotonic()
    try:
        model, tokenizer = load_model(path, cfg.model.dtype)
        state = os.path.join(path, checkpoint.STATE_FILE)  # none in the initial model's folder
        written = os.path.getmtime(state) if version else time.time()
    except (OSError, ValueError) as e:
        log.warning("checkpoint %s could not be loaded (%s); waiting for the next", path, e)
        return None
    pool.status.set(state=f"evaluating v{version}")
    out = evaluate(model, tokenizer, problems, cfg, progress=lambda _n: pool.tick())
    out.pop("per_problem")
    return out | {
        "checkpoint_time": written,
        "eval_s": round(time.monotonic() - t0, 2),
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> None:
    from pipeline.eval import eval_problems

    pool = start_pool(ROLE, argv)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # a warning per parse otherwise
    cfg = pool.cfg
    run_dir = cfg.run_dir or "."
    problems, source = eval_problems(cfg)
    log.info("evaluating on %d problems (%s)", len(problems), source)
    last = int(pool.client.hget(pool.status.key, "evaluated_version") or -1)
    if cfg.eval.at_start and last < 0 and not pool.stop.is_set():
        # version 0 is the initial model (with model.lora: the base, the adapter's B is 0)
        report(pool, 0, evaluate_once(pool, model_path(cfg), 0, problems), len(problems))
        last = 0
    last_t = time.monotonic()
    while not pool.tick():
        due = next_due(checkpoints(run_dir), last, last_t, cfg.eval, cfg.trainer.max_steps)
        if due is None:
            pool.status.set(state="waiting for a checkpoint", evaluated_version=last)
            time.sleep(1.0)
            continue
        path, version = due
        if version >= cfg.trainer.max_steps:
            final_threads(cfg)
        out = evaluate_once(pool, path, version, problems)
        if out is None or pool.stop.is_set():
            continue
        last, last_t = version, time.monotonic()
        report(pool, version, out, len(problems))
    pool.status.set(state="stopped")


def final_threads(cfg: Any) -> int:
    """The final checkpoint is evaluated on every CPU this process may use, not
    ``eval.torch_threads``: training is over, so the cores that setting leaves to the
    trainer and the actors are free, and the launcher waits for this evaluation before
    the run ends (the default job's last evaluation took 24 s on one thread of two)."""
    import torch

    threads = max(len(os.sched_getaffinity(0)), int(cfg.eval.torch_threads))
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        log.info("the final checkpoint: evaluating on %d threads (training is over)", threads)
    return threads


def report(pool: Pool, version: int, out: dict | None, problems: int) -> None:
    """The ``eval`` record, the status hash and the log line of one evaluation."""
    if out is None:
        return
    pool.record(event="eval", step=version, version=version, problems=problems, **out)
    pool.status.set(
        state="evaluated",
        evaluated_version=version,
        greedy_accuracy=out["greedy_accuracy"],
        mean_reward=out["mean_reward"],
        pass_at_k=out["pass_at_k"],
    )
    log.info(
        "v%d: greedy accuracy %.3f, mean reward %.3f, pass@%d %.3f (%.1fs)",
        version,
        out["greedy_accuracy"],
        out["mean_reward"],
        out["k"],
        out["pass_at_k"],
        out["eval_s"],
    )


def wait_for_final_eval(client, names: Names, cfg: Any) -> bool:
    """Launcher side: give the evaluator ``eval.final_timeout_s`` to evaluate the
    final checkpoint; True when it did (or when no evaluator runs)."""
    if not (cfg.eval.every_steps or cfg.eval.every_s):
        return True
    deadline = time.monotonic() + cfg.eval.final_timeout_s
    while time.monotonic() < deadline:
        done = [
            int(v.get("evaluated_version", -1))
            for v in read_statuses(client, names).values()
            if v.get("role") == ROLE
        ]
        if done and max(done) >= cfg.trainer.max_steps:
            return True
        time.sleep(0.5)
    print(f"\nthe evaluator did not finish the final checkpoint in {cfg.eval.final_timeout_s}s")
    return False


if __name__ == "__main__":
    run_main(main)
