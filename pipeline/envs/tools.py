"""Tools that cannot hurt the pipeline: budgets, a concurrency bound, failures as text.

Every tool call of an episode goes through its :class:`ToolBox`::

    result = await tools.run(call)   # call(timeout_s) -> ToolResult, async

- per call: a wall-clock limit (``call_timeout_s``, less when the episode's tool
  time is nearly spent); a call past it is cancelled (its own clean-up runs: pyexec
  kills its process group) and answered with a ``timeout`` observation;
- per episode: at most ``max_tool_calls`` calls and ``episode_tool_s`` seconds of
  tool time, then every call is answered with a ``budget`` observation;
- across the actor's episodes: at most ``concurrency`` calls at once (one shared gate);
- a tool that raises becomes an ``error`` observation, never an exception in the actor;
  observations longer than ``max_observation_tokens`` are cut by the actor (outcome
  ``oversized``, pipeline/envs/template.py).

Outcomes are counted per kind (``ToolBox.counts``); a failure of the tool's
*infrastructure* (``ToolResult.infra``: its process died, the sandbox would not
start) marks the episode, which the preprocessor leaves out of its group's
advantage statistics. None of this touches the engine: tools run on the actor's
episode loop, never under the engine's per-forward-pass lock, so a hung tool
cannot delay a weight swap.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

GRACE_S = 1.0  # beyond a call's own limit, before the box cancels it


@dataclass
class ToolLimits:
    max_tool_calls: int = 4  # per episode
    call_timeout_s: float = 5.0  # wall clock per call
    episode_tool_s: float = 20.0  # wall clock of all of an episode's calls
    concurrency: int = 4  # calls at once across the actor's episodes
    max_observation_tokens: int = 64  # longer observations are cut (outcome "oversized")


@dataclass
class ToolResult:
    outcome: str  # pipeline.messages.TOOL_OUTCOMES
    text: str  # the observation the model sees
    infra: bool = False


def error_text(message: str) -> str:
    return f"<error>{message}</error>"


class ToolBox:
    """One episode's tool budget; ``gate`` bounds the calls of all episodes sharing it."""

    def __init__(self, limits: ToolLimits, gate: asyncio.Semaphore | None = None):
        self.limits = limits
        self.gate = gate or asyncio.Semaphore(limits.concurrency)
        self.calls, self.seconds = 0, 0.0
        self.counts: Counter = Counter()

    def spent(self) -> str | None:
        """Why no further call may run, or None."""
        if self.calls >= self.limits.max_tool_calls:
            return f"{self.limits.max_tool_calls} tool calls used, the episode's budget"
        if self.seconds >= self.limits.episode_tool_s:
            return f"{self.limits.episode_tool_s:g} s of tool time used, the episode's budget"
        return None

    async def run(self, call: Callable[[float], Awaitable[ToolResult]]) -> ToolResult:
        """Run ``call(timeout_s)`` within the budgets; every failure is a ToolResult."""
        why = self.spent()
        if why is not None:
            return self.count(ToolResult("budget", error_text(f"{why}: answer now")))
        timeout = min(self.limits.call_timeout_s, self.limits.episode_tool_s - self.seconds)
        async with self.gate:
            t0 = time.monotonic()
            try:
                result = await asyncio.wait_for(call(timeout), timeout + GRACE_S)
            except TimeoutError:
                result = ToolResult("timeout", error_text(f"the tool ran past {timeout:g} s"))
            except Exception as e:  # a tool's bug is the model's observation, not a crash
                result = ToolResult("error", error_text(f"{type(e).__name__}: {e}"))
            self.seconds += time.monotonic() - t0
        self.calls += 1
        return self.count(result)

    def count(self, result: ToolResult) -> ToolResult:
        self.counts[result.outcome] += 1
        return result
