"""``task``: the problems the actors sample (pipeline/tasks.py) and the group size."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pipeline.config.checks import check_choice, check_positive


@dataclass
class TaskConfig:
    kind: str = "arithmetic"  # arithmetic | file
    difficulty: int = 2  # 1-5; SmolLM2-135M starts near 36% at 2 (actor/measure_task.py)
    path: str | None = None  # kind=file: a JSONL or parquet file with question/answer fields
    system_prompt: str | None = None  # None: the task's own; "": no system message
    group_size: int = 4  # completions per prompt (G)
    seed: int = 0


def validate_task(cfg: Any) -> None:
    """The ``task`` section: its kind, a file that exists, groups of at least two."""
    check_choice(cfg, "task.kind", ("arithmetic", "file"))
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
