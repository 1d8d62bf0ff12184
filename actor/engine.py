"""The ``hf`` inference engine: batched sampling on a transformers model.

Every forward pass runs under ``self.lock`` and reads the policy version at
that moment, so each sampled token is tagged with the version that produced
it. :meth:`swap` installs new weights under the same lock, between two
forward passes: sequences in flight keep their KV cache and continue on the
new weights. The log-prob recorded for each token is taken under the
distribution actually sampled from (temperature, then top-k/top-p).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from pipeline.logprobs import sampling_logprobs
from pipeline.messages import BucketSpec


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool


@dataclass
class EngineStats:
    swaps: int = 0
    swap_ms: list[float] = field(default_factory=list)
    forward_passes: int = 0
    tokens: int = 0


class HFEngine:
    def __init__(
        self, model, tokenizer, temperature: float, top_p: float, top_k: int, seed: int = 0
    ):
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.lock = threading.Lock()
        self.version = 0
        self.stats = EngineStats()
        self.stop_ids = self._stop_ids(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.generator = torch.Generator().manual_seed(seed)
        self._active: list[torch.Tensor] | None = None
        self._params = dict(model.named_parameters())

    @staticmethod
    def _stop_ids(tokenizer) -> set[int]:
        ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
            ids.add(im_end)
        return ids

    # -- weights -------------------------------------------------------------
    def swap(self, version: int, layout: list[BucketSpec], buckets: list[torch.Tensor]):
        """Install ``buckets`` as the weights; return the buffers released for reuse."""
        views = []
        for spec, flat in zip(layout, buckets, strict=True):
            for p in spec.params:
                n = math.prod(p.shape)
                views.append((self._params[p.name], flat[p.offset : p.offset + n].view(p.shape)))
        same_dtype = all(v.dtype == param.dtype for param, v in views)
        t0 = time.perf_counter()
        with self.lock:
            for param, v in views:
                if same_dtype:
                    param.data = v
                else:
                    param.data.copy_(v)
            self.version = version
        self.stats.swap_ms.append(1000 * (time.perf_counter() - t0))
        self.stats.swaps += 1
        if not same_dtype:
            return buckets
        released, self._active = self._active, buckets
        return released

    def _forward(self, **inputs) -> tuple[torch.Tensor, int]:
        with self.lock:
            logits = self.model(**inputs, use_cache=True).logits[:, -1, :]
            version = self.version
        self.stats.forward_passes += 1
        return logits, version

    # -- sampling ------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, should_stop=lambda: False
    ) -> list[Completion]:
        batch = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = [Completion([], [], [], False) for _ in prompts]
        alive = torch.ones(batch, dtype=torch.bool)
        logits, version = self._forward(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache
        )
        for _ in range(max_new_tokens):
            logp = sampling_logprobs(logits, self.temperature, self.top_p, self.top_k)
            token = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
            token_lp = logp.gather(-1, token[:, None]).squeeze(-1)
            rows = torch.nonzero(alive).flatten().tolist()
            self.stats.tokens += len(rows)
            for i in rows:
                t = int(token[i])
                out[i].tokens.append(t)
                out[i].logprobs.append(float(token_lp[i]))
                out[i].versions.append(version)
                if t in self.stop_ids:
                    out[i].finished = True
                    alive[i] = False
            if not alive.any() or should_stop():
                break
            token = torch.where(alive, token, torch.full_like(token, self.pad_id))
            mask = torch.cat([mask, alive[:, None].long()], dim=1)
            positions = positions[:, -1:] + 1
            logits, version = self._forward(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
            )
        return out
