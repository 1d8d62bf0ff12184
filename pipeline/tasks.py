"""The math task: problems, prompts and the reward.

- `ArithmeticTask`: built-in generator of arithmetic problems, by difficulty (1-5).
- `FileTask`: user problems from JSONL or parquet rows with `question` and `answer`
  (GSM8K style: an answer holding ``#### N`` has the reference answer N).
- `build_prompt_ids`: system prompt + question through the model's chat template.
- `score`: 1.0 when the completion's final number (or its last ``\\boxed{}``) equals the
  reference answer under `math_verify`, else 0.0, with the error's name when checking
  raised; `RewardErrors` counts those per reason and logs them (rate-limited).
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
import zlib
from pathlib import Path

import msgspec

DEFAULT_DIFFICULTY = 2
DEFAULT_SYSTEM_PROMPT = "You are a calculator. Reply with only the final number."
QUESTION_TEMPLATE = "What is {expr}?"
TASK_KINDS = ("arithmetic", "file")
MAX_DIFFICULTY = 5
MAX_ANSWER_CHARS = 100  # longer "answers" are garbage; they also bound math_verify's work
HELDOUT_SHARE = 5  # one arithmetic expression in 5 is held out of training, for evaluation

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"(?:(?<![\w)])-)?\d+(?:,\d{3})*(?:\.\d+)?")
_BOXED = "\\boxed{"


class Problem(msgspec.Struct, frozen=True):
    """One problem: a stable id, the question text and the reference answer."""

    id: str
    question: str
    answer: str


# ---------------------------------------------------------------- arithmetic


def _plus_minus(rng: random.Random, low: int, high: int) -> tuple[str, int]:
    """`a + b` or `a - b` (a >= b) with operands in [low, high]."""
    a, b = rng.randint(low, high), rng.randint(low, high)
    if rng.random() < 0.5:
        return f"{a} + {b}", a + b
    return f"{max(a, b)} - {min(a, b)}", abs(a - b)


def _expression(rng: random.Random, difficulty: int) -> tuple[str, int]:
    """An arithmetic expression and its value, a non-negative integer."""
    if difficulty == 1:  # single-digit addition
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"{a} + {b}", a + b
    if difficulty == 2:  # single-digit addition or subtraction
        return _plus_minus(rng, 0, 9)
    if difficulty == 3:  # one-digit times up to 19
        a, b = rng.randint(2, 9), rng.randint(2, 19)
        return f"{a} * {b}", a * b
    if difficulty == 4:  # two-digit addition or subtraction
        return _plus_minus(rng, 10, 99)
    while True:  # 5: three two-digit operands, left to right
        expr, value = _plus_minus(rng, 10, 99)
        c = rng.randint(10, 99)
        if rng.random() < 0.5:
            return f"{expr} + {c}", value + c
        if value >= c:
            return f"{expr} - {c}", value - c


class ArithmeticTask:
    """Generated arithmetic problems, difficulty 1 (easiest) to 5.

    1: a + b, single digits.    2: a + b or a - b, single digits, result >= 0.
    3: a * b, 2..9 times 2..19.  4: a +/- b, two digits.  5: a +/- b +/- c, two digits.
    Levels are ordered by SmolLM2-135M-Instruct's measured accuracy (see pipeline/measure_task.py).
    """

    def __init__(
        self, difficulty: int = DEFAULT_DIFFICULTY, seed: int = 0, template: str = QUESTION_TEMPLATE
    ):
        if "{expr}" not in template:
            raise ValueError(f"question template {template!r} must contain {{expr}}")
        if not 1 <= difficulty <= MAX_DIFFICULTY:
            raise ValueError(f"difficulty must be 1..{MAX_DIFFICULTY}, got {difficulty}")
        self.difficulty = difficulty
        self.seed = seed
        self.template = template
        self._rng = random.Random(seed)
        self._count = 0

    def _problem(self, pid: str, expr: str, value: int) -> Problem:
        return Problem(id=pid, question=self.template.format(expr=expr), answer=str(value))

    def sample(self) -> Problem:
        """The next training problem of this task's deterministic sequence (never held out)."""
        self._count += 1
        while True:
            expr, value = _expression(self._rng, self.difficulty)
            if not is_heldout(expr):
                pid = f"arith-d{self.difficulty}-s{self.seed}-{self._count}"
                return self._problem(pid, expr, value)

    def heldout(self, n: int) -> list[Problem]:
        """The evaluation set: up to n distinct held-out problems, the same on every call
        and for every seed; fewer when the level has fewer (difficulty 2 has about 30)."""
        rng = random.Random(f"heldout-{self.difficulty}")
        seen: dict[str, int] = {}
        for _ in range(1000 + 200 * n):
            expr, value = _expression(rng, self.difficulty)
            if is_heldout(expr):
                seen.setdefault(expr, value)
                if len(seen) == n:
                    break
        return [
            self._problem(f"heldout-d{self.difficulty}-{i}", expr, value)
            for i, (expr, value) in enumerate(seen.items())
        ]


def is_heldout(expr: str) -> bool:
    """Whether an arithmetic expression belongs to the held-out split (training never
    draws it): a fixed hash of the expression text, the same in every process."""
    return zlib.crc32(expr.encode()) % HELDOUT_SHARE == 0


# ---------------------------------------------------------------- user files


def _reference_answer(raw: object) -> str:
    text = str(raw).strip()
    if "####" in text:  # GSM8K: worked solution, then "#### 42"
        text = text.rsplit("####", 1)[1].strip()
    return text.replace(",", "")


def _read_rows(path: Path) -> list[tuple[int, object]]:
    """(line or row number, row) pairs from a .jsonl/.json-lines or .parquet file."""
    if path.suffix == ".parquet":
        try:
            import pandas as pd
        except ImportError:
            raise ValueError(
                f"reading {path} needs pandas and pyarrow: `pip install pandas pyarrow`"
            ) from None
        try:
            frame = pd.read_parquet(path)
        except ImportError as exc:
            raise ValueError(
                f"reading {path} needs pyarrow: `pip install pyarrow` ({exc})"
            ) from exc
        return [(i + 1, row) for i, row in enumerate(frame.to_dict("records"))]
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    return rows


def load_problems(path: str) -> list[Problem]:
    """Problems from a JSONL or parquet file; ValueError naming file, line and field."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"task file {file} does not exist")
    problems = []
    for lineno, row in _read_rows(file):
        if not isinstance(row, dict):
            raise ValueError(f"{file}:{lineno}: expected a JSON object with question and answer")
        for field in ("question", "answer"):
            if row.get(field) is None or str(row[field]).strip() == "":
                raise ValueError(f"{file}:{lineno}: missing or empty field {field!r}")
        pid = str(row.get("id", f"{file.name}:{lineno}"))
        problems.append(Problem(pid, str(row["question"]), _reference_answer(row["answer"])))
    if not problems:
        raise ValueError(f"task file {file} holds no problems")
    return problems


class FileTask:
    """Problems from a user file, cycled in an order reshuffled (by seed) every pass."""

    def __init__(self, path: str, seed: int = 0):
        self.path = path
        self.problems = load_problems(path)
        self._rng = random.Random(seed)
        self._order: list[int] = []

    def sample(self) -> Problem:
        if not self._order:
            self._order = list(range(len(self.problems)))
            self._rng.shuffle(self._order)
        return self.problems[self._order.pop()]

    def heldout(self, n: int) -> list[Problem]:
        """The first n problems of a fixed shuffle (the file has no separate split)."""
        order = list(range(len(self.problems)))
        random.Random("heldout").shuffle(order)
        return [self.problems[i] for i in order[:n]]


def make_task(
    kind: str, difficulty: int = DEFAULT_DIFFICULTY, path: str | None = None, seed: int = 0
) -> ArithmeticTask | FileTask:
    """Build a task by kind: "arithmetic" (uses difficulty) or "file" (uses path)."""
    if kind == "arithmetic":
        return ArithmeticTask(difficulty, seed)
    if kind == "file":
        if not path:
            raise ValueError('task kind "file" needs a path to a .jsonl or .parquet file')
        return FileTask(path, seed)
    raise ValueError(f"unknown task kind {kind!r}; allowed: {', '.join(TASK_KINDS)}")


# ---------------------------------------------------------------- prompt and reward


def build_prompt_ids(tokenizer, question: str, system_prompt: str | None = None) -> list[int]:
    """Token ids of system prompt + question, ending where the assistant's reply starts."""
    messages = [{"role": "user", "content": question}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def final_answer(completion: str) -> str | None:
    """The content of the last ``\\boxed{...}``, else the last number in the text."""
    start = completion.rfind(_BOXED)
    if start >= 0:
        depth, i = 1, start + len(_BOXED)
        for j in range(i, len(completion)):
            depth += {"{": 1, "}": -1}.get(completion[j], 0)
            if depth == 0:
                return completion[i:j]
    numbers = _NUMBER.findall(completion)
    return numbers[-1].replace(",", "") if numbers else None


def score(completion: str, answer: str) -> tuple[float, str | None]:
    """(reward, error): 1.0 if the completion's final answer equals `answer` (math_verify),
    else 0.0; ``error`` names the exception (its class) when checking raised, in which
    case the reward is 0.0. No answer, or an over-long one, is a plain 0.0, not an error."""
    from math_verify import parse, verify

    try:
        found = final_answer(completion)
        if found is None or len(found) > MAX_ANSWER_CHARS:
            return 0.0, None
        # timeouts off: math_verify's timeouts use SIGALRM, which fails outside the main thread
        gold = parse(answer, parsing_timeout=None)
        pred = parse(found, parsing_timeout=None)
        return (1.0 if gold and pred and verify(gold, pred, timeout_seconds=None) else 0.0), None
    except Exception as exc:  # noqa: BLE001 - counted and logged by the caller (RewardErrors)
        return 0.0, type(exc).__name__


def reward(completion: str, answer: str) -> float:
    """The reward of :func:`score` alone (0.0 on an error; callers that must count
    errors use :func:`score` with :class:`RewardErrors`)."""
    return score(completion, answer)[0]


class RewardErrors:
    """Reward errors per reason (exception class), logged at most once per
    ``log_every_s`` per reason with the count since the last log line."""

    def __init__(self, log_every_s: float = 60.0):
        self.log_every_s = log_every_s
        self.counts: dict[str, int] = {}
        self._unlogged: dict[str, int] = {}
        self._last_log: dict[str, float] = {}

    def add(self, reason: str, completion: str, answer: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._last_log.get(reason, -float("inf")) >= self.log_every_s:
            log.warning(
                "reward raised %s %d time(s) (scored 0.0; last answer %r, completion %r)",
                reason,
                self._unlogged[reason],
                answer[:40],
                completion[:80],
            )
            self._last_log[reason], self._unlogged[reason] = now, 0
