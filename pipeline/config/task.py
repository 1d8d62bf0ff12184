"""``task``: the problems the actors sample (pipeline/tasks.py) and the group size."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pipeline.config.checks import check_choice, check_positive


@dataclass
class EpisodeConfig:
    """``task.episode``: the budgets of an episode (task.kind=env; pipeline/envs/tools.py)."""

    max_turns: int = 4  # model turns per episode (the last one answers)
    max_tokens: int = 512  # every id after the prompt: sampled, boundary and observation
    max_tool_calls: int = 3
    call_timeout_s: float = 5.0  # wall clock per tool call
    episode_tool_s: float = 20.0  # wall clock of all of an episode's tool calls
    concurrency: int = 4  # tool calls at once across an actor's episodes
    max_observation_tokens: int = 64  # longer observations are cut (outcome "oversized")
    # an actor's lease on its open groups of episodes (actor/journal.py): a group whose
    # actor has not renewed it for this long is taken over by another actor
    takeover_s: float = 30.0


@dataclass
class TaskConfig:
    kind: str = "arithmetic"  # arithmetic | file | env (multi-turn episodes, task.env)
    difficulty: int = 2  # 1-5; SmolLM2-135M starts near 36% at 2 (actor/measure_task.py)
    path: str | None = None  # kind=file: a JSONL or parquet file with question/answer fields
    system_prompt: str | None = None  # None: the task's own; "": no system message
    group_size: int = 4  # completions per prompt (G)
    seed: int = 0
    # kind=env: the environment (calc, pyexec or module:Class, pipeline/envs), its own
    # settings, and the episode's budgets
    env: str = ""
    env_args: dict[str, Any] = field(default_factory=dict)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)


def validate_task(cfg: Any) -> None:
    """The ``task`` section: its kind, a file that exists, groups of at least two."""
    check_choice(cfg, "task.kind", ("arithmetic", "file", "env"))
    check_positive(cfg, "task.group_size")
    t = cfg.task
    if t.group_size < 2:
        raise ValueError("task.group_size must be >= 2: group-relative advantages need peers")
    if t.kind == "file":
        if not t.path:
            raise ValueError("task.kind=file needs task.path=/path/to/problems.jsonl")
        if not os.path.exists(t.path):
            raise ValueError(
                f"task.path={t.path} does not exist; give a JSONL or parquet file "
                "with question/answer fields"
            )
    if t.kind == "env":
        validate_episode(cfg)


def validate_episode(cfg: Any) -> None:
    """task.kind=env: an environment that loads, positive budgets, no step scorer."""
    from pipeline.envs import load_env

    t = cfg.task
    if not t.env:
        raise ValueError("task.kind=env needs task.env=calc, pyexec or module:Class")
    load_env(t.env)
    names = ("max_turns", "max_tokens", "max_tool_calls", "concurrency", "max_observation_tokens")
    names += ("call_timeout_s", "episode_tool_s", "takeover_s")
    check_positive(cfg, *(f"task.episode.{name}" for name in names))
    if t.episode.max_tokens < cfg.sampling.max_new_tokens:
        raise ValueError(
            f"task.episode.max_tokens={t.episode.max_tokens} is below "
            f"sampling.max_new_tokens={cfg.sampling.max_new_tokens}: one turn would not fit"
        )
    if "prm" in cfg.preprocessor.scorers:
        raise ValueError(
            "preprocessor.scorers=[prm] scores a completion's steps and does not read "
            "episodes (task.kind=env): leave prm out, or use the teacher or reference scorer"
        )
