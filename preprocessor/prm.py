"""Step-level process rewards: steps, a reward per step, per-token advantages.

::

    reads   each sample's completion (as text, through the policy tokenizer) and,
            for the model PRM, the prompt text
    writes  ScoredGroup.dense["prm"]: per-token process advantages
    counts  prm_scored_groups (groups with at least one scored step), prm_scored_steps

Steps: segmentation works on the concatenated per-token texts, so every character
belongs to exactly one token and a step maps back to tokens without any
re-tokenization. ``delimiter="line"`` splits at line breaks; any other string is a
literal step delimiter. Blank steps are skipped.

Advantages follow DeepSeekMath's process supervision (Shao et al., 2024, sec.
4.1.3): the rewards of every scored step of a group are normalised together, and a
token's advantage is the sum of the normalised rewards of the steps ending at or
after it.

PRMs:

- ``ArithmeticPRM`` (``preprocessor.prm.kind=arithmetic``): a step earns 1.0 when every
  equation it states holds, 0.0 when one does not, and no verdict without equations
  (preprocessor/equations.py). No model: it runs at tokenizer speed.
- ``ModelPRM`` (``kind=model``): any Hugging Face causal LM (``preprocessor.prm.model``)
  reads prompt, then each step followed by ``step_tag``; at the tag's last token the
  step's reward is p(good) / (p(good) + p(bad)) for the one-token strings
  ``good_token`` / ``bad_token`` (Math-Shepherd style). Texts are re-tokenized with
  the PRM's own tokenizer, so it need not share the policy's vocabulary. All samples
  of the groups read together go through budget-sized forward passes.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.messages import unpack_i32
from preprocessor.equations import step_reward
from preprocessor.scoring import ScoredGroup, pack_groups, shared_prompt_forward

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


# ---------------------------------------------------------------- the PRMs

StepRewards = list[tuple[int, float]]  # (last completion token of the step, reward)


def _finish(items: list[ScoredGroup], rewards: list[list[StepRewards]]) -> dict[str, float]:
    """Turn step rewards into each group's dense ``prm`` part; count what was scored."""
    groups = steps = 0
    for it, per_sample in zip(items, rewards, strict=True):
        it.dense["prm"] = process_advantages(per_sample, it.lengths)
        n = sum(len(r) for r in per_sample)
        steps += n
        groups += n > 0
    return {"prm_scored_groups": groups, "prm_scored_steps": steps}


class ArithmeticPRM:
    name, dense = "prm", True

    def __init__(self, policy_tokenizer, delimiter: str, weight: float):
        self.decoder = PieceDecoder(policy_tokenizer)
        self.delimiter, self.weight = delimiter, weight

    def step_rewards(self, completion_ids) -> StepRewards:
        steps = segment(self.decoder.pieces(completion_ids), self.delimiter)
        scored = [(s.last_token, step_reward(s.text)) for s in steps]
        return [(last, r) for last, r in scored if r is not None]

    def score(self, items: list[ScoredGroup]) -> dict[str, float]:
        rewards = [[self.step_rewards(s.tokens()) for s in it.group.samples] for it in items]
        return _finish(items, rewards)


class ModelPRM:
    name, dense = "prm", True

    def __init__(self, policy_tokenizer, model, tokenizer, prm_cfg: Any, budget: int):
        self.policy_tokenizer, self.decoder = policy_tokenizer, PieceDecoder(policy_tokenizer)
        self.model, self.tokenizer, self.budget = model, tokenizer, budget
        self.delimiter, self.weight = prm_cfg.delimiter, prm_cfg.weight
        self.good = self._one_token(prm_cfg.good_token, "good_token")
        self.bad = self._one_token(prm_cfg.bad_token, "bad_token")
        self.tag = self._encode(prm_cfg.step_tag)
        if not self.tag:
            raise ValueError(
                f"preprocessor.prm.step_tag={prm_cfg.step_tag!r} encodes to no token; "
                "use a visible separator such as a newline"
            )
        self.max_len = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _one_token(self, text: str, key: str) -> int:
        ids = self._encode(text)
        if len(ids) != 1:
            raise ValueError(
                f"preprocessor.prm.{key}={text!r} is {len(ids)} tokens for the PRM's "
                "tokenizer; pick a string that is exactly one token (e.g. '+' or '-')"
            )
        return ids[0]

    def build(self, completion_ids) -> tuple[list[int], list[int], list[int]]:
        """The PRM's input after the prompt: each step followed by the tag; the positions
        read (each tag's last token) and the steps' last policy tokens."""
        body, positions, lasts = [], [], []
        for step in segment(self.decoder.pieces(completion_ids), self.delimiter):
            body += self._encode(step.text) + self.tag
            positions.append(len(body) - 1)
            lasts.append(step.last_token)
        return body, positions, lasts

    def prompt(self, prompt_ids) -> list[int]:
        return self._encode(self.policy_tokenizer.decode(prompt_ids))

    def fit(self, prompt: list[int], built: list[tuple]) -> tuple[list[int], list[tuple]]:
        """Within the PRM's context: drop the start of the prompt, then steps past the end."""
        longest = max(len(body) for body, _, _ in built)
        prompt = prompt[min(max(0, len(prompt) + longest - self.max_len), len(prompt) - 1) :]
        room = self.max_len - len(prompt)
        fitted = []
        for body, positions, lasts in built:
            keep = [(p, last) for p, last in zip(positions, lasts, strict=True) if p < room]
            fitted.append((body[:room], [p for p, _ in keep], [last for _, last in keep]))
        return prompt, fitted

    def step_scores(self, prompts: list[list[int]], built: list[list[tuple]]) -> list[list]:
        """Per group and sample, p(good) / (p(good) + p(bad)) at each read position.

        Groups go through budget-sized passes, each prompt computed once for its group
        (samples without a step are left out of the pass).
        """
        out = [[np.zeros(0, dtype=np.float32) for _ in b] for b in built]
        todo = [
            (g, [k for k, (_, positions, _) in enumerate(b) if positions])
            for g, b in enumerate(built)
        ]
        todo = [(g, ks) for g, ks in todo if ks]
        shapes = [(len(prompts[g]), [len(built[g][k][0]) for k in ks]) for g, ks in todo]
        for part in pack_groups(shapes, self.budget) if todo else []:
            chosen = [todo[j] for j in part]
            logits, _, _ = shared_prompt_forward(
                self.model,
                [prompts[g] for g, _ in chosen],
                [[built[g][k][0] for k in ks] for g, ks in chosen],
                self.pad_id,
            )
            row = 0
            for g, ks in chosen:
                for k in ks:
                    read = torch.tensor(built[g][k][1]) + 1  # logits[j] predicts token j
                    pair = logits[row, read][:, [self.good, self.bad]].float()
                    out[g][k] = pair.softmax(-1)[:, 0].numpy().astype(np.float32)
                    row += 1
        return out

    def score(self, items: list[ScoredGroup]) -> dict[str, float]:
        prompts, built = [], []
        for it in items:
            prompt = self.prompt(unpack_i32(it.group.prompt_ids))
            prompt, fitted = self.fit(prompt, [self.build(s.tokens()) for s in it.group.samples])
            prompts.append(prompt)
            built.append(fitted)
        scores = self.step_scores(prompts, built)
        rewards = [
            [
                list(zip(lasts, p.tolist(), strict=True))
                for (_, _, lasts), p in zip(b, sc, strict=True)
            ]
            for b, sc in zip(built, scores, strict=True)
        ]
        return _finish(items, rewards)
