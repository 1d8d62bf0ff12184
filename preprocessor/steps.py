"""Reasoning steps of a completion and the per-token advantages they earn.

::

    reads   a completion's token ids (and the policy tokenizer, to see their text)
    writes  Step spans (text, the completion token that ends each step);
            per-token process advantages from per-step rewards

Segmentation works on the concatenated per-token texts, so every character
belongs to exactly one token and a step maps back to tokens without any
re-tokenization. ``delimiter="line"`` splits at line breaks; any other string
is a literal step delimiter. Blank steps are skipped.

Process advantages follow DeepSeekMath's process supervision (Shao et al.,
2024, sec. 4.1.3): the rewards of every scored step of a group are normalised
together, and a token's advantage is the sum of the normalised rewards of the
steps ending at or after it.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

import numpy as np

LINE = "line"
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class Step:
    text: str  # the step without its delimiter
    start: int  # character span inside the completion text
    end: int
    last_token: int  # index of the completion token holding the step's last character


class PieceDecoder:
    """Token id -> its text under the policy tokenizer (special tokens give ""), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special = set(tokenizer.all_special_ids)
        self.cache: dict[int, str] = {}

    def pieces(self, ids) -> list[str]:
        ids = [int(t) for t in ids]
        missing = sorted({t for t in ids if t not in self.cache})
        if missing:
            texts = self.tokenizer.batch_decode(
                [[t] for t in missing], clean_up_tokenization_spaces=False
            )
            for t, text in zip(missing, texts, strict=True):
                self.cache[t] = "" if t in self.special else text
        return [self.cache[t] for t in ids]


def _spans(text: str, delimiter: str) -> list[tuple[int, int]]:
    if delimiter == LINE:
        cuts = [(m.start(), m.end()) for m in _LINE_BREAK.finditer(text)]
    else:
        cuts = [(m.start(), m.end()) for m in re.finditer(re.escape(delimiter), text)]
    spans, start = [], 0
    for cut_start, cut_end in cuts:
        spans.append((start, cut_start))
        start = cut_end
    spans.append((start, len(text)))
    return spans


def segment(pieces: list[str], delimiter: str = LINE) -> list[Step]:
    """Split a completion, given as per-token texts, into its non-blank steps."""
    if not delimiter:
        raise ValueError('the step delimiter is empty; use "line" or a non-empty string')
    text = "".join(pieces)
    ends = np.cumsum([len(p) for p in pieces]).tolist()  # token i covers [ends[i-1], ends[i])
    steps = []
    for start, end in _spans(text, delimiter):
        body = text[start:end]
        if not body.strip():
            continue
        last_char = start + len(body.rstrip()) - 1
        last_token = bisect.bisect_right(ends, last_char)
        steps.append(Step(body.strip(), start, end, last_token))
    return steps


def process_advantages(
    step_rewards: list[list[tuple[int, float]]], lengths: list[int], eps: float = 1e-6
) -> list[np.ndarray]:
    """Per-token process advantages of one group.

    ``step_rewards[i]`` holds (last token, reward) of each scored step of sample i
    (steps without a verdict are left out); ``lengths[i]`` is its token count.
    Rewards are normalised over all scored steps of the group; token t gets the sum
    of the normalised rewards of the steps whose last token is at or after t.
    """
    assert len(step_rewards) == len(lengths), "one step list per sample"
    pooled = np.asarray([r for steps in step_rewards for _, r in steps], dtype=np.float64)
    out = [np.zeros(n, dtype=np.float32) for n in lengths]
    if pooled.size == 0:
        return out
    mean, std = pooled.mean(), pooled.std()
    for adv, steps in zip(out, step_rewards, strict=True):
        for last, r in steps:
            assert 0 <= last < len(adv), "a step ends inside its completion"
            adv[: last + 1] += (r - mean) / (std + eps)
    return out
