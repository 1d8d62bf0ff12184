"""The launcher's live status line: trainer step, reward, versions, lag."""

from __future__ import annotations

import sys
import time


class Progress:
    """Rewrites one line on a terminal; prints a line every ``every_s`` otherwise."""

    def __init__(self, total_steps: int, stream=sys.stdout, every_s: float = 10.0):
        self.total, self.stream, self.every_s = total_steps, stream, every_s
        self.tty = stream.isatty()
        self.start = time.monotonic()
        self.last_print = 0.0
        self.last_line = ""
        self.printed = ""

    @staticmethod
    def line(statuses: dict[str, dict[str, str]], total: int, elapsed: float) -> str:
        trainer = statuses.get("trainer", {})
        step = int(trainer.get("step", 0))
        width = 20
        done = int(width * step / max(total, 1))
        actors = {k: v for k, v in statuses.items() if v.get("role") == "actor"}
        versions = ",".join(v.get("version", "0") for _, v in sorted(actors.items())) or "-"
        trainer_v = int(trainer.get("version", 0))
        lag = max((trainer_v - int(v.get("version", 0)) for v in actors.values()), default=0)
        groups = sum(int(v.get("groups_produced", 0)) for v in actors.values())
        reward = trainer.get("reward_mean")
        reward_s = f"{float(reward):.3f}" if reward else "-"
        return (
            f"[{'#' * done}{'.' * (width - done)}] step {step}/{total} "
            f"reward {reward_s} | trainer v{trainer_v} actors v{versions} lag {lag} | "
            f"groups {groups} | {elapsed:.0f}s"
        )

    def update(self, statuses: dict[str, dict[str, str]]) -> None:
        now = time.monotonic()
        self.last_line = self.line(statuses, self.total, now - self.start)
        if self.tty:
            self.stream.write("\r" + self.last_line.ljust(110))
            self.stream.flush()
        elif now - self.last_print >= self.every_s:
            self.stream.write(self.last_line + "\n")
            self.stream.flush()
            self.last_print = now
            self.printed = self.last_line

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
        elif self.last_line and self.last_line != self.printed:
            self.stream.write(self.last_line + "\n")
        self.stream.flush()
