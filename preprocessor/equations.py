"""The rule-based arithmetic verifier: does each equation a step states hold?

::

    reads   the text of one reasoning step
    writes  one verdict per equation it states ("3 + 4 = 7" True, "12 - 5 = 8" False),
            and the step's reward: 1.0 all hold, 0.0 one fails, None no equation

An equation is a run of numbers, operators (+ - * / x × ÷ ·), parentheses and
"=" (or the word "equals") inside the text; words end a run, so "we get
6 + 6 = 12, done" states one equation. A chain "2 + 3 = 5 = 10 / 2" states
two. The side left of the first "=" is the longest tail of the run that parses,
the side right of the last "=" the longest head. Values are exact fractions;
a stated decimal (e.g. "10 / 3 = 3.33") holds when the exact value rounds to it.
Nothing is evaluated with ``eval``: a small recursive-descent parser reads the
tokens, and over-long numbers or runs are skipped, never computed.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_DIGITS = 30  # a longer number is not arithmetic a step states; skip it
MAX_RUN = 64  # tokens in one run

_NORMALISE = [
    (re.compile(r"\\times|\\cdot|[×·∗]"), "*"),
    (re.compile(r"\\div|÷"), "/"),
    (re.compile(r"[−–]"), "-"),  # unicode minus and en dash
    (re.compile(r"\\[()\[\]]|\$|\\,|\\!"), " "),  # LaTeX math delimiters, currency signs
    (re.compile(r"\bis\s+equal\s+to\b|\bequals\b", re.IGNORECASE), "="),
    (re.compile(r"(?<=[\d)])(\s*)[xX](\s*)(?=[\d(])"), r"\1*\2"),  # 3 x 4
]
_TOKEN = re.compile(
    r"(?P<num>\d+(?:,\d{3})*(?:\.\d+)?)|(?P<op>[-+*/])|(?P<lp>\()|(?P<rp>\))|(?P<eq>=)"
    r"|(?P<ws>[ \t]+)|(?P<other>.)",
    re.DOTALL,
)


def _tokens(text: str) -> list[list[tuple[str, str]]]:
    """Runs of (kind, value) arithmetic tokens; anything else separates runs.

    A "-" glued to the number or "(" after it, where no operand precedes it, is a
    sign ("-3 + 5", "= -3", "-(2 + 3)"); any other "-" is an operator.
    """
    for pattern, repl in _NORMALISE:
        text = pattern.sub(repl, text)
    runs: list[list[tuple[str, str]]] = [[]]
    last_end = -1  # where the previous token (not counting spaces) ended
    for m in _TOKEN.finditer(text):
        kind, value = m.lastgroup, m.group()
        if kind == "ws":
            continue
        glued, last_end = m.start() == last_end, m.end()
        if kind == "other" or (kind == "num" and len(value) > MAX_DIGITS):
            runs.append([])
            continue
        run = runs[-1]
        if kind == "num":
            value = value.replace(",", "")
        sign = glued and run and run[-1] == ("op", "-") and kind in ("num", "lp")
        if sign and (len(run) == 1 or run[-2][0] in ("op", "lp", "eq")):
            if kind == "num":
                run[-1] = ("num", "-" + value)
                continue
            run[-1] = ("neg", "-")
        run.append((kind, value))
    return [r for r in runs if any(k == "eq" for k, _ in r) and len(r) <= MAX_RUN]


class _Parser:
    """expr := term (+|- term)*; term := factor (*|/ factor)*; factor := -? NUM | -? ( expr )"""

    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.i = tokens, 0

    def parse(self) -> Fraction | None:
        try:
            value = self._expr()
        except (IndexError, ZeroDivisionError, ValueError):
            return None
        return value if self.i == len(self.tokens) else None

    def _peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _expr(self) -> Fraction:
        value = self._term()
        while (tok := self._peek()) and tok[1] in "+-" and tok[0] == "op":
            self.i += 1
            rhs = self._term()
            value = value + rhs if tok[1] == "+" else value - rhs
        return value

    def _term(self) -> Fraction:
        value = self._factor()
        while (tok := self._peek()) and tok[0] == "op" and tok[1] in "*/":
            self.i += 1
            rhs = self._factor()
            value = value * rhs if tok[1] == "*" else value / rhs
        return value

    def _factor(self) -> Fraction:
        kind, text = self.tokens[self.i]
        self.i += 1
        if kind in ("op", "neg") and text == "-":
            return -self._factor()
        if kind == "num":
            return Fraction(text)
        if kind == "lp":
            value = self._expr()
            if self.tokens[self.i][0] != "rp":
                raise ValueError("unclosed parenthesis")
            self.i += 1
            return value
        raise ValueError(f"unexpected {text!r}")


def _value(tokens: list[tuple[str, str]]) -> Fraction | None:
    return _Parser(tokens).parse() if tokens else None


def _longest(tokens: list[tuple[str, str]], tail: bool) -> list[tuple[str, str]] | None:
    """The longest tail (or head) of ``tokens`` that parses and is a whole operand.

    A side cut next to an operator ("total + 1 = 2": the run starts at "+") lost part
    of its expression to the words around it: no side, so no verdict.
    """
    for cut in range(len(tokens)):
        part = tokens[cut:] if tail else tokens[: len(tokens) - cut]
        beside = tokens[cut - 1] if tail and cut else None
        if not tail and cut:
            beside = tokens[len(tokens) - cut]
        edge = part[0] if tail else part[-1]
        if (beside and beside[0] == "op") or edge[0] == "op":
            continue
        if _value(part) is not None:
            return part
    return None


def _equal(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> bool:
    va, vb = _value(a), _value(b)
    if va == vb:
        return True
    for stated, exact in ((a, vb), (b, va)):  # "10 / 3 = 3.33": rounding to what is stated
        if len(stated) == 1 and "." in stated[0][1]:
            places = len(stated[0][1].split(".")[1])
            if abs(exact - Fraction(stated[0][1])) <= Fraction(1, 2 * 10**places):
                return True
    return False


def check_equations(text: str) -> list[bool]:
    """One verdict per equation the text states, in order."""
    verdicts = []
    for run in _tokens(text):
        parts: list[list[tuple[str, str]]] = [[]]
        for tok in run:
            if tok[0] == "eq":
                parts.append([])
            else:
                parts[-1].append(tok)
        sides = []
        for k, part in enumerate(parts):
            if k == 0:
                side = _longest(part, tail=True)
            elif k == len(parts) - 1:
                side = _longest(part, tail=False)
            else:
                side = part if _value(part) is not None else None
            sides.append(side)
        for left, right in zip(sides, sides[1:], strict=False):
            if left is not None and right is not None:
                verdicts.append(_equal(left, right))
    return verdicts


def step_reward(text: str) -> float | None:
    """1.0 when every equation of the step holds, 0.0 when one fails, None without any."""
    verdicts = check_equations(text)
    if not verdicts:
        return None
    return 1.0 if all(verdicts) else 0.0
