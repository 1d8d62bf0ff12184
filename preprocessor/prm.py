"""Process reward models: a reward per reasoning step, turned into per-token advantages.

::

    reads   each sample's completion (as text, through the policy tokenizer) and,
            for the model PRM, the prompt text
    writes  ScoredGroup.dense["prm"]: per-token process advantages (preprocessor/steps.py)
    counts  prm_scored_groups (groups with at least one scored step), prm_scored_steps

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

from typing import Any

import numpy as np
import torch

from pipeline.messages import unpack_i32
from preprocessor.equations import step_reward
from preprocessor.scoring import ScoredGroup, samples_of, split_per_group
from preprocessor.shaping import pack
from preprocessor.steps import PieceDecoder, process_advantages, segment

StepRewards = list[tuple[int, float]]  # (last completion token of the step, reward)


def _finish(items: list[ScoredGroup], rewards: list[list[StepRewards]]) -> dict[str, int]:
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

    def score(self, items: list[ScoredGroup]) -> dict[str, int]:
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

    def build(self, prompt_ids, completion_ids) -> tuple[list[int], list[int], list[int]]:
        """PRM input ids, the positions read (one per step), the steps' last policy tokens."""
        ids = self._encode(self.policy_tokenizer.decode(prompt_ids))
        positions, lasts = [], []
        for step in segment(self.decoder.pieces(completion_ids), self.delimiter):
            ids += self._encode(step.text) + self.tag
            positions.append(len(ids) - 1)
            lasts.append(step.last_token)
        cut = max(0, len(ids) - self.max_len)  # too long: drop the start of the prompt
        kept = [(p - cut, last) for p, last in zip(positions, lasts, strict=True) if p >= cut]
        return ids[cut:], [p for p, _ in kept], [last for _, last in kept]

    @torch.inference_mode()
    def step_scores(self, inputs: list[list[int]], positions: list[list[int]]) -> list[np.ndarray]:
        """p(good) / (p(good) + p(bad)) at each read position, in budget-sized passes."""
        out = [np.zeros(0, dtype=np.float32)] * len(inputs)
        todo = [i for i, p in enumerate(positions) if p]
        for part in pack([len(inputs[i]) for i in todo], self.budget):
            rows = [todo[j] for j in part]
            width = max(len(inputs[i]) for i in rows)
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            attn = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, : len(inputs[i])] = torch.tensor(inputs[i])
                attn[r, : len(inputs[i])] = 1
            logits = self.model(input_ids=ids, attention_mask=attn).logits.float()
            for r, i in enumerate(rows):
                pair = logits[r, positions[i]][:, [self.good, self.bad]]
                out[i] = pair.softmax(-1)[:, 0].numpy().astype(np.float32)
        return out

    def score(self, items: list[ScoredGroup]) -> dict[str, int]:
        built = [self.build(unpack_i32(g.prompt_ids), s.tokens()) for g, s in samples_of(items)]
        scores = self.step_scores([b[0] for b in built], [b[1] for b in built])
        flat = [
            list(zip(b[2], p.tolist(), strict=True)) for b, p in zip(built, scores, strict=True)
        ]
        return _finish(items, split_per_group(items, flat))
