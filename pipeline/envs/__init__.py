"""The environment contract: async, gym-like objects the actor runs episodes with.

One instance per episode (``task.kind=env task.env=module:Class``, settings in
``task.env_args``, budgets in ``task.tools``)::

    env = Env(settings, tools)                 # tools: ToolBox (budgets, concurrency)
    messages = await env.reset(problem)        # the opening messages (system, user)
    step = await env.step(Turn(text, ended))   # after each model turn:
    step.observation, step.reward, step.done   #   what the model sees next (None when
    step.outcome, step.infra                   #   done), the turn's reward, the tool
                                               #   outcome (TOOL_OUTCOMES), infra failure
    await env.close()

Resumable environments (``resumable = True``) let an episode outlive its actor: after
each finished turn the actor writes what the turn added and ``env.state()`` (plain
data, whole each time) to Redis (actor/journal.py); an actor that takes the episode
over builds a new instance and calls ``await env.restore(problem, state)`` instead of
``reset``, then goes on with the next turn. A class that says ``resumable = True``
must define both (load_env refuses it otherwise). An environment that is not
resumable restarts the episode from ``reset`` when it is taken over (counted:
``episodes_restarted``).

``step`` is gym's ``step(action)`` with the action being the model's turn: the
environment parses its tool calls from the turn's text (read only: the actor keeps
the sampled ids) and answers with the observation text, which the actor encodes
and appends between the template's boundary ids (pipeline/envs/template.py). Every
value crossing the contract is plain data (strings, numbers, lists of dicts), so
an HTTP adapter to an OpenEnv-style server can implement the same four methods
beside the in-process ones.

The problems come from the environment class too: ``Env.tasks(settings, seed)``
returns an object with ``sample() -> Problem`` (pipeline/tasks.py), the ``task``
an episode's ``reset`` is given.

Shipped: ``calc`` (pipeline/envs/calc.py: arithmetic with a calculator tool, an AST
whitelist evaluator) and ``pyexec`` (pipeline/envs/pyexec.py: python code run in a
separate ``python -I -S`` process under rlimits and a wall-clock limit).
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass
from typing import Any

from pipeline.envs.tools import ToolBox, ToolLimits

BUILTIN = {
    "calc": "pipeline.envs.calc:CalcEnv",
    "pyexec": "pipeline.envs.pyexec:PyExecEnv",
}


@dataclass
class Turn:
    """One model turn, as the environment reads it."""

    text: str  # the turn's sampled text (decoded for reading; the ids stay as sampled)
    ended: str  # "stop": on one of the env's stop strings (a tool call); "eos"; "length"
    index: int = 0  # 0 for the first turn


@dataclass
class Step:
    """What the environment answers a turn with."""

    observation: str | None = None  # the next observation turn's text; None when done
    reward: float = 0.0  # the turn's reward (an episode's reward: the sum over its turns)
    done: bool = False
    outcome: str = ""  # pipeline.messages.TOOL_OUTCOMES: "" no tool call, "ok", a failure
    infra: bool = False  # the tool's infrastructure failed (not the model's fault)


def not_resumable(env) -> str:
    return (
        f"{type(env).__name__} is not resumable: its episodes restart after a takeover; "
        "set resumable = True and define state() and restore() to resume them"
    )


class Environment(abc.ABC):
    """The base of in-process environments: the contract's defaults. ``tasks``, ``reset``
    and ``step`` are abstract: a subclass without one is refused by :func:`load_env`."""

    stop: tuple[str, ...] = ()  # strings that end a turn with a tool call (kept in its ids)
    observation_role = "user"  # the chat role observations are rendered as
    resumable = False

    def __init__(self, settings: dict[str, Any], tools: ToolBox):
        self.settings, self.tools = dict(settings), tools

    @classmethod
    @abc.abstractmethod
    def tasks(cls, settings: dict[str, Any], seed: int):
        """The problems the actor draws from (an iterator of plain data)."""

    @abc.abstractmethod
    async def reset(self, problem) -> list[dict]:
        """The opening messages of an episode on ``problem``."""

    @abc.abstractmethod
    async def step(self, turn: Turn) -> Step:
        """The answer to one model turn."""

    async def close(self) -> None:
        """Release what the episode holds (processes, connections); nothing by default."""
        return None

    def state(self) -> Any:
        """A resumable environment's state after a step, as plain data (dicts, lists,
        strings, numbers): what :meth:`restore` needs to answer the next turn. Called
        only when ``resumable`` is True, and load_env refuses a class that says so
        without overriding both."""
        raise TypeError(not_resumable(self))

    async def restore(self, problem, state: Any) -> None:
        """Take up an episode on ``problem`` where :meth:`state` left it (instead of
        ``reset``: the episode's messages so far are already in its ids)."""
        raise TypeError(not_resumable(self))


def load_env(spec: str) -> type:
    """The environment class ``spec`` names: ``calc``, ``pyexec`` or ``module:Class``."""
    path = BUILTIN.get(spec, spec)
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(
            f"task.env={spec!r} names no environment: give calc, pyexec or module:Class "
            "(a class with async reset(problem) and step(turn), e.g. pipeline.envs.calc:CalcEnv)"
        )
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"task.env={spec!r}: cannot load {path}: {e}") from None
    missing = [m for m in ("reset", "step", "tasks") if not callable(getattr(cls, m, None))]
    missing += sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise ValueError(
            f"task.env={spec!r}: {path} does not define {', '.join(missing)}() "
            "(the contract in pipeline/envs/__init__.py)"
        )
    if getattr(cls, "resumable", False):
        undefined = [
            m
            for m in ("state", "restore")
            if getattr(cls, m, None) is getattr(Environment, m)
            or not callable(getattr(cls, m, None))
        ]
        if undefined:
            raise ValueError(
                f"task.env={spec!r}: {path} says resumable = True but does not define "
                f"{', '.join(undefined)}(): define them (state() -> plain data, async "
                "restore(problem, state)) or leave resumable False (its episodes then "
                "restart when their actor dies)"
            )
    return cls


__all__ = ["Environment", "Step", "ToolBox", "ToolLimits", "Turn", "load_env"]
