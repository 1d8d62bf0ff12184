"""``calc``: multi-step arithmetic with a calculator tool.

The model writes ``<calc>17*23</calc>`` (``</calc>`` is the turn's stop string),
the environment answers ``<result>391</result>`` as the next observation, and the
episode ends with a turn that does not call the tool: its final number is the
answer (reward 1.0 when it equals the reference, pipeline.tasks.score).

Expressions are evaluated by walking a whitelisted AST (numbers, + - * / // % **,
unary +/-, parentheses), with bounds on the text, the exponent and the size of
every intermediate value; never ``eval``. Settings (``task.env_args``):
``terms`` (numbers per problem, default 3), ``digits`` (per number, default 2),
``system_prompt`` (default :data:`SYSTEM_PROMPT`), ``example`` (default true: a
worked example of the format as chat turns before the question, :data:`EXAMPLE`),
``tool_delay_s`` (seconds each call takes, a number or ``[low, high]``: a slow tool for
the agentic benchmark; default 0).
"""

from __future__ import annotations

import ast
import asyncio
import operator
import random
import re

from pipeline.envs import Environment, Step, Turn
from pipeline.envs.tools import ToolResult, error_text
from pipeline.tasks import Problem, score

SYSTEM_PROMPT = (
    "You can use a calculator. To compute something, write <calc>expression</calc> and "
    "stop; you will be given <result>value</result>. Then reply with the final number."
)
# a worked example, as chat turns before the question (a 135M model follows turns it
# has seen far better than a description of them)
EXAMPLE = [
    {"role": "user", "content": "What is 12 * 34?"},
    {"role": "assistant", "content": "<calc>12 * 34</calc>"},
    {"role": "user", "content": "<result>408</result>"},
    {"role": "assistant", "content": "408"},
    {"role": "user", "content": "What is 83 - 45?"},
    {"role": "assistant", "content": "<calc>83 - 45</calc>"},
    {"role": "user", "content": "<result>38</result>"},
    {"role": "assistant", "content": "38"},
]
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_TAG = re.compile(r"<([A-Za-z_][\w-]*)>(.*?)</\1>", re.S)
KNOWN_TAGS = ("calc", "result", "error")


class CalcError(ValueError):
    """The expression is outside what the calculator evaluates."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``; CalcError (a SyntaxError for text
    that does not parse) for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tree = ast.parse(expression.strip(), mode="eval")
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponent larger than {MAX_EXPONENT}")
        try:
            out = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        if isinstance(out, complex) or abs(out) > MAX_MAGNITUDE:
            raise CalcError("value out of range")
        return out
    raise CalcError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def show(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def calc(expression: str) -> ToolResult:
    """The calculator as a tool: its result, or the failure as an observation."""
    try:
        return ToolResult("ok", f"<result>{show(evaluate(expression))}</result>")
    except SyntaxError:
        return ToolResult("malformed", error_text(f"cannot parse {expression.strip()!r}"))
    except CalcError as e:
        return ToolResult("error", error_text(str(e)))


class CalcTasks:
    """Problems like ``What is 37 * 24 + 158?`` (integer answers)."""

    def __init__(self, terms: int, digits: int, seed: int):
        if terms < 2 or digits < 1:
            raise ValueError("task.env_args for calc: terms >= 2 and digits >= 1")
        self.terms, self.digits, self.rng, self.n = terms, digits, random.Random(seed), 0

    def sample(self) -> Problem:
        hi = 10**self.digits - 1
        nums = [self.rng.randint(2, hi) for _ in range(self.terms)]
        ops = [self.rng.choice(["+", "-", "*"]) for _ in range(self.terms - 1)]
        text = " ".join(x for pair in zip(map(str, nums), ops + [""], strict=True) for x in pair)
        text = text.strip()
        self.n += 1
        return Problem(id=f"calc-{text}", question=f"What is {text}?", answer=show(evaluate(text)))


def arithmetic_tasks(settings, seed: int) -> CalcTasks:
    """The multi-step problems of ``task.env_args`` ``terms`` and ``digits`` (calc, pyexec)."""
    return CalcTasks(int(settings.get("terms", 3)), int(settings.get("digits", 2)), seed)


class CalcEnv(Environment):
    stop = ("</calc>",)
    resumable = True  # its state is its problem (and the tool budget, the actor's)

    @classmethod
    def tasks(cls, settings, seed: int) -> CalcTasks:
        return arithmetic_tasks(settings, seed)

    async def reset(self, problem: Problem) -> list[dict]:
        self.problem = problem
        system = self.settings.get("system_prompt", SYSTEM_PROMPT)
        example = EXAMPLE if self.settings.get("example", True) else []
        question = {"role": "user", "content": problem.question}
        return [{"role": "system", "content": system}, *example, question]

    def state(self) -> dict:
        return {}

    async def restore(self, problem: Problem, state: dict) -> None:
        self.problem = problem

    async def step(self, turn: Turn) -> Step:
        if turn.ended == "stop":  # ended on </calc>: a call
            start = turn.text.rfind("<calc>")
            end = turn.text.rfind("</calc>")
            if start < 0 or start > end:
                bad = ToolResult("malformed", error_text("</calc> without <calc>"))
                return self._answer(self.tools.count(bad))
            expression = turn.text[start + len("<calc>") : end]
            delay = self._delay()

            async def call(_timeout):
                if delay:  # tool_delay_s: a slow tool (benchmarks, tests)
                    await asyncio.sleep(delay)
                return calc(expression)

            return self._answer(await self.tools.run(call))
        unknown = [m.group(1) for m in _TAG.finditer(turn.text) if m.group(1) not in KNOWN_TAGS]
        if unknown and turn.ended == "eos":
            text = error_text(f"unknown tool {unknown[-1]!r}; the tool is <calc>")
            return self._answer(self.tools.count(ToolResult("unknown_tool", text)))
        reward, _error = score(turn.text, self.problem.answer)
        return Step(reward=reward, done=True)

    def _delay(self) -> float:
        """``tool_delay_s``: seconds each call takes, a number or [low, high] (uniform)."""
        d = self.settings.get("tool_delay_s", 0.0)
        if isinstance(d, int | float):
            return float(d)
        low, high = (float(x) for x in d)
        return random.Random(f"{self.problem.id}:{self.tools.calls}:{id(self)}").uniform(low, high)

    @staticmethod
    def _answer(result: ToolResult) -> Step:
        return Step(observation=result.text, outcome=result.outcome, infra=result.infra)
