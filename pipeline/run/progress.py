"""The launcher's live status line: trainer step, reward, versions (the trainer's,
the newest published to the actors, each actor's), lag, and rates (groups
generated, samples trained per second) over a sliding window of at least
``RATE_MIN_S`` seconds ("-" until that much has passed), and the cores each pool
kept busy over the last second or so (pipeline/run/cpu_meter.py; the launcher sets
``cpu``). An actor whose weight
versions fail more often than they apply (pipeline/run/summary.py, weight_problems)
is named at the end of the line, ``WEIGHTS NOT ARRIVING: ...``, while it happens."""

from __future__ import annotations

import sys
import time
from collections import deque

from pipeline.run.summary import status_version, weight_problems

RATE_MIN_S = 30.0  # a rate is shown only once measured over at least this long
RATE_WINDOW_S = 120.0  # ... and over at most about this long (recent, not whole-run)


class Rate:
    """Growth per second of a counter over a sliding window of ``min_s`` to ``window_s``."""

    def __init__(self, min_s: float = RATE_MIN_S, window_s: float = RATE_WINDOW_S):
        self.min_s, self.window_s = min_s, window_s
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, total: float) -> float | None:
        """Record the counter's ``total`` at ``now``; the rate, or None if not yet known."""
        if self.samples and total < self.samples[-1][1]:
            self.samples.clear()  # the counter went back (a restart): start over
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, v0 = self.samples[0]
        return (total - v0) / (now - t0) if now - t0 >= self.min_s else None


def _rate(value: float | None, unit: str) -> str:
    return f"{value:.2f} {unit}/s" if value is not None else f"- {unit}/s"


class Progress:
    """Rewrites one line on a terminal; prints a line every ``every_s`` otherwise."""

    def __init__(self, total_steps: int, stream=sys.stdout, every_s: float = 10.0):
        self.total, self.stream, self.every_s = total_steps, stream, every_s
        self.tty = stream.isatty()
        self.start = time.monotonic()
        self.last_print = 0.0
        self.last_line = ""
        self.printed = ""
        self.group_rate, self.sample_rate = Rate(), Rate()
        self.published: int | None = None  # newest published version (the launcher sets it)
        self.cpu = "-"  # the pools' recent CPU shares, cpu_meter.shares_text (the launcher)

    @staticmethod
    def line(
        statuses: dict[str, dict[str, str]],
        total: int,
        elapsed: float,
        rates: tuple[float | None, float | None] = (None, None),
        published: int | None = None,
        cpu: str = "-",
    ) -> str:
        trainer = statuses.get("trainer", {})
        step = int(trainer.get("step", 0))
        width = 20
        done = int(width * step / max(total, 1))
        actors = {k: v for k, v in statuses.items() if v.get("role") == "actor"}
        versions = ",".join(v.get("version", "0") for _, v in sorted(actors.items())) or "-"
        trainer_v = status_version(trainer) or 0
        held = [status_version(v) for v in actors.values()]  # None: partial weights
        lag = max((trainer_v - v for v in held if v is not None), default=0)
        groups = sum(int(v.get("groups_produced", 0)) for v in actors.values())
        reward = trainer.get("reward_mean")
        reward_s = f"{float(reward):.3f}" if reward else "-"
        published_s = f" published v{published}" if published is not None else ""
        problems = weight_problems(statuses, at_end=False)
        return (
            f"[{'#' * done}{'.' * (width - done)}] step {step}/{total} "
            f"reward {reward_s} | trainer v{trainer_v}{published_s} actors v{versions} "
            f"lag {lag} | groups {groups} ({_rate(rates[0], 'groups')}, trained "
            f"{_rate(rates[1], 'samples')}) | {elapsed:.0f}s"
            + (f" | cpu {cpu}" if cpu != "-" else "")
            + (f" | WEIGHTS NOT ARRIVING: {'; '.join(problems)}" if problems else "")
        )

    def update(self, statuses: dict[str, dict[str, str]]) -> None:
        now = time.monotonic()
        actors = [v for v in statuses.values() if v.get("role") == "actor"]
        groups = sum(int(v.get("groups_produced", 0)) for v in actors)
        trained = int(statuses.get("trainer", {}).get("samples_trained", 0))
        rates = self.group_rate.add(now, groups), self.sample_rate.add(now, trained)
        self.last_line = self.line(
            statuses, self.total, now - self.start, rates, published=self.published, cpu=self.cpu
        )
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
