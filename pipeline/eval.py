"""``python -m pipeline.eval CHECKPOINT_OR_RUN_DIR [key=value ...]``: evaluate one policy.

::

    reads   a checkpoint folder (checkpoints/step-NNNNNN, or any HF model folder), or a
            run directory (its config.yaml and its latest checkpoint); the problems:
            eval.path, else task.path when task.kind=file, else the arithmetic task's
            held-out split (problems training never draws, pipeline/tasks.py)
    writes  a table on stdout; JSON to --out (default RUN_DIR/eval/step-NNNNNN.json
            when the run directory is known, else nothing)
    blocks  never on other pools: it loads its own copy of the weights

Per problem: one greedy completion (greedy accuracy) and ``eval.samples`` sampled
completions at ``eval.temperature`` (mean reward; pass@k with k = eval.samples: the share
of problems with at least one correct sample among the k). Rewards are the task's own
(``pipeline.tasks.reward``). The same :func:`evaluate` serves the periodic evaluator pool
(pipeline/evaluator.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from omegaconf import OmegaConf

from pipeline import checkpoint
from pipeline.config import Config, load_config, validate
from pipeline.tasks import (
    DEFAULT_SYSTEM_PROMPT,
    ArithmeticTask,
    Problem,
    build_prompt_ids,
    load_problems,
    reward,
)


@dataclass
class EvalResult:
    version: int | None  # trainer step of the checkpoint; None for a plain model folder
    checkpoint: str
    source: str  # where the problems came from
    problems: int
    k: int
    temperature: float
    max_new_tokens: int
    greedy_accuracy: float
    mean_reward: float  # over the k sampled completions of every problem
    pass_at_k: float
    seconds: float
    mean_completion_tokens: float
    per_problem: list[dict] = field(default_factory=list)

    def row(self) -> dict:
        """The summary without the per-problem detail (metrics records, tables)."""
        return {k: v for k, v in asdict(self).items() if k != "per_problem"}

    def render(self) -> str:
        rows = [
            ("checkpoint", self.checkpoint),
            ("policy version", "-" if self.version is None else self.version),
            ("problems", f"{self.problems} ({self.source})"),
            ("greedy accuracy", f"{self.greedy_accuracy:.3f}"),
            (f"mean reward ({self.k} samples, T={self.temperature:g})", f"{self.mean_reward:.3f}"),
            (f"pass@{self.k}", f"{self.pass_at_k:.3f}"),
            ("mean completion tokens", f"{self.mean_completion_tokens:.1f}"),
            ("seconds", f"{self.seconds:.1f}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(["evaluation"] + [f"  {k.ljust(width)}  {v}" for k, v in rows])


# ------------------------------------------------------------------ what to evaluate


def resolve(target: str, overrides: list[str]) -> tuple[Any, str, str | None]:
    """(config, model folder, run directory or None) for a run directory or checkpoint."""
    path = os.path.abspath(os.path.expanduser(target))
    if not os.path.isdir(path):
        raise ValueError(f"{target} is not a directory: pass a run directory or a checkpoint")
    if os.path.exists(os.path.join(path, "config.yaml")):  # a run directory
        ckpt = checkpoint.latest(os.path.join(path, "checkpoints"))
        if ckpt is None:
            raise ValueError(
                f"run directory {path} has no checkpoint yet (checkpoints/latest); pass a "
                "checkpoint folder, or wait for trainer.checkpoint_every steps"
            )
        return load_config(os.path.join(path, "config.yaml"), overrides), ckpt, path
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"{path} holds neither config.yaml (a run) nor config.json (a model)")
    run_dir = os.path.dirname(os.path.dirname(path))  # RUN/checkpoints/step-N
    if os.path.exists(os.path.join(run_dir, "config.yaml")):
        return load_config(os.path.join(run_dir, "config.yaml"), overrides), path, run_dir
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(overrides))
    except Exception as e:  # omegaconf's errors name the key
        raise ValueError(f"bad override: {e}") from None
    validate(cfg)
    return cfg, path, None


def checkpoint_version(path: str) -> int | None:
    if not os.path.exists(os.path.join(path, checkpoint.STATE_FILE)):
        return None
    return int(checkpoint.load_state(path)["version"])


def eval_problems(cfg: Any) -> tuple[list[Problem], str]:
    """The problems (at most eval.problems) and where they came from."""
    n = cfg.eval.problems
    if cfg.eval.path:
        return load_problems(cfg.eval.path)[:n], cfg.eval.path
    if cfg.task.kind == "file":
        return load_problems(cfg.task.path)[:n], cfg.task.path
    problems = ArithmeticTask(cfg.task.difficulty).heldout(n)
    return problems, f"arithmetic held-out split, difficulty {cfg.task.difficulty}"


# ------------------------------------------------------------------ generation


def stop_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(ids)


@torch.inference_mode()
def complete(model, tokenizer, prompts: list[list[int]], k: int, ev) -> tuple[list, list]:
    """Per prompt one greedy and ``k`` sampled completions (token id lists, prompt order),
    from one prefill: the prompts' KV cache is computed once and repeated 1 + k times.
    transformers' ``generate`` prefills every returned sequence and every call again (3
    prefills per prompt for a greedy and 2 samples, most of the evaluation's arithmetic
    at 32 new tokens), and keeps a finished sequence in the batch to the end; here a row
    leaves the batch at its stop token. Sampling is ``ev["temperature"]`` over the whole
    vocabulary (top_p 1, top_k 0, as the engines sample); nothing of the model's
    generation_config applies."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at the same column
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1
    )
    cache, rows = out.cache, 1 + k
    cache.batch_repeat_interleave(rows)  # row i * rows: greedy; the k after it: sampled
    logits = out.logits[:, -1].float().repeat_interleave(rows, 0)
    mask = mask.repeat_interleave(rows, 0)
    position = position[:, -1:].repeat_interleave(rows, 0)
    live = torch.arange(len(prompts) * rows)  # the rows still generating, in the batch
    greedy = live % rows == 0
    stops = torch.tensor(stop_ids(tokenizer), dtype=torch.long)
    result: list[list[int]] = [[] for _ in range(len(live))]
    for t in range(ev["max_new_tokens"]):
        sampled = torch.multinomial(torch.softmax(logits / ev["temperature"], -1), 1)[:, 0]
        token = torch.where(greedy, logits.argmax(-1), sampled)
        ended = torch.isin(token, stops)
        for row, tok, end in zip(live.tolist(), token.tolist(), ended.tolist(), strict=True):
            if not end:  # a completion ends before its stop token
                result[row].append(tok)
        if bool(ended.all()) or t + 1 == ev["max_new_tokens"]:
            break
        if bool(ended.any()):  # finished rows leave the batch (and its arithmetic)
            keep = (~ended).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            live, greedy, token = live[keep], greedy[keep], token[keep]
            mask, position = mask[keep], position[keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        position = position + 1
        out = model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=position,
            cache=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1].float()
    return [result[i * rows] for i in range(len(prompts))], [
        c for i in range(len(prompts)) for c in result[i * rows + 1 : (i + 1) * rows]
    ]


def evaluate(model, tokenizer, problems: list[Problem], cfg: Any, progress=None) -> dict:
    """Greedy accuracy, mean sampled reward and pass@k over ``problems``."""
    ev = cfg.eval
    k, settings = (
        ev.samples,
        {
            "temperature": ev.temperature or cfg.sampling.temperature,
            "max_new_tokens": ev.max_new_tokens or cfg.sampling.max_new_tokens,
        },
    )
    system = DEFAULT_SYSTEM_PROMPT if cfg.task.system_prompt is None else cfg.task.system_prompt
    torch.manual_seed(ev.seed)
    model.eval()
    rows, lengths = [], []
    for start in range(0, len(problems), ev.batch_size):
        chunk = problems[start : start + ev.batch_size]
        prompts = [build_prompt_ids(tokenizer, p.question, system) for p in chunk]
        greedy, sampled = complete(model, tokenizer, prompts, k, settings)
        lengths += [len(c) for c in greedy + sampled]
        for i, p in enumerate(chunk):
            texts = tokenizer.batch_decode(
                [greedy[i]] + sampled[i * k : (i + 1) * k], skip_special_tokens=True
            )
            scores = [reward(t, p.answer) for t in texts]
            rows.append(
                {"id": p.id, "answer": p.answer, "greedy": scores[0], "sampled": scores[1:]}
                | {"greedy_text": texts[0]}
            )
        if progress is not None:
            progress(len(chunk))
    n = max(len(rows), 1)
    return {
        "k": k,
        **settings,
        "greedy_accuracy": sum(r["greedy"] for r in rows) / n,
        "mean_reward": sum(sum(r["sampled"]) for r in rows) / (n * k),
        "pass_at_k": sum(max(r["sampled"]) > 0 for r in rows) / n,
        "mean_completion_tokens": sum(lengths) / max(len(lengths), 1),
        "per_problem": rows,
    }


def evaluate_checkpoint(path: str, cfg: Any, progress_bar: bool = False) -> EvalResult:
    """Load ``path`` (a model folder) and evaluate it on the configured problems."""
    from pipeline.models import load_model

    problems, source = eval_problems(cfg)
    t0 = time.monotonic()
    model, tokenizer = load_model(path, cfg.model.dtype)
    bar = None
    if progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=len(problems), desc="evaluating", unit="problem", file=sys.stderr)
    try:
        out = evaluate(model, tokenizer, problems, cfg, bar.update if bar else None)
    finally:
        if bar is not None:
            bar.close()
    return EvalResult(
        version=checkpoint_version(path),
        checkpoint=path,
        source=source,
        problems=len(problems),
        seconds=round(time.monotonic() - t0, 2),
        **out,
    )


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.eval", description=__doc__.split("\n")[0].strip("`")
    )
    p.add_argument("target", help="a run directory (its latest checkpoint) or a model folder")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. eval.problems=32 eval.samples=8")
    p.add_argument("--out", help="JSON file to write (default RUN_DIR/eval/step-N.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # a warning per parse otherwise
    try:
        cfg, ckpt, run_dir = resolve(args.target, args.overrides)
        torch.set_num_threads(cfg.eval.torch_threads)
        result = evaluate_checkpoint(ckpt, cfg, progress_bar=not args.no_progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.render())
    out = args.out
    if out is None and run_dir is not None and result.version is not None:
        out = os.path.join(run_dir, "eval", f"step-{result.version:06d}.json")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(asdict(result), f, indent=2)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
