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
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from pipeline.logprobs import sampling_logprobs
from pipeline.messages import BucketSpec, Sample, pack_f32, pack_i32, pack_mask, rle_encode


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool
    kept: list = field(default_factory=list)  # keep_sampling_mask: kept vocab ids per token

    def to_sample(self, index: int, reward: float) -> Sample:
        """The wire form: packed arrays, run-length versions, the mask if recorded."""
        mask_ids, mask_counts = pack_mask(self.kept)  # b"", b"" unless keep_sampling_mask
        return Sample(
            index=index,
            completion_ids=pack_i32(self.tokens),
            logprobs=pack_f32(self.logprobs),
            versions=rle_encode(self.versions),
            reward=float(reward),
            finished=self.finished,
            mask_ids=mask_ids,
            mask_counts=mask_counts,
        )


@dataclass
class EngineStats:
    swaps: int = 0
    swap_ms: list[float] = field(default_factory=list)
    forward_passes: int = 0
    tokens: int = 0
    # (start, end) perf_counter times of recent forward passes, and the times new
    # versions took effect: an update's stall is the gap between the passes around it
    timeline: deque = field(default_factory=lambda: deque(maxlen=4096))
    version_times: deque = field(default_factory=lambda: deque(maxlen=4096))


class HFEngine:
    def __init__(
        self,
        model,
        tokenizer,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int = 0,
        keep_sampling_mask: bool = False,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        truncating = top_p < 1.0 or 0 < top_k < model.config.vocab_size
        self.keep_sampling_mask = keep_sampling_mask and truncating
        self.lock = threading.Condition()
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

    # -- weights (the receiver's SwapTarget) ---------------------------------
    def _views(self, layout: list[BucketSpec], buckets: list[torch.Tensor]):
        for spec, flat in zip(layout, buckets, strict=True):
            for p in spec.params:
                n = math.prod(p.shape)
                yield self._params[p.name], flat[p.offset : p.offset + n].view(p.shape)

    def swap(self, version: int, layout: list[BucketSpec], buckets: list[torch.Tensor]):
        """Install ``buckets`` as the weights; return the buffers released for reuse."""
        views = list(self._views(layout, buckets))
        same_dtype = all(v.dtype == param.dtype for param, v in views)
        with self.lock:
            t0 = time.perf_counter()  # the swap's cost: time holding the lock
            for param, v in views:
                if same_dtype:
                    param.data = v  # pointer swap: the staging copy becomes the weights
                else:
                    param.data.copy_(v)
            self.set_version(version)
            self.stats.swap_ms.append(1000 * (time.perf_counter() - t0))
        self.stats.swaps += 1
        if not same_dtype:
            return buckets
        released, self._active = self._active, buckets
        return released

    def weight_views(self, layout: list[BucketSpec]):
        """Per bucket, (parameter data, offset in the bucket): for in-place receiving."""
        return [[(self._params[p.name].data, p.offset) for p in spec.params] for spec in layout]

    def set_version(self, version: int | None) -> None:
        """Caller holds the lock. None marks the weights partial: no forward pass runs."""
        self.version = version
        if version is not None:
            self.stats.version_times.append(time.perf_counter())
            self.lock.notify_all()

    def _forward(self, **inputs) -> tuple[torch.Tensor, int]:
        with self.lock:
            while self.version is None:  # a failed in-place transfer: wait for a whole version
                self.lock.wait(1.0)
            start = time.perf_counter()
            logits = self.model(**inputs, use_cache=True).logits[:, -1, :]
            version = self.version
        self.stats.forward_passes += 1
        self.stats.timeline.append((start, time.perf_counter()))
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
            kept = self._kept_ids(logp) if self.keep_sampling_mask else None
            for i in rows:
                t = int(token[i])
                out[i].tokens.append(t)
                out[i].logprobs.append(float(token_lp[i]))
                out[i].versions.append(version)
                if kept is not None:
                    out[i].kept.append(kept[i])
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

    @staticmethod
    def _kept_ids(logp: torch.Tensor) -> list:
        """Per row, the int32 vocabulary ids top-k/top-p left finite."""
        rows, ids = torch.isfinite(logp).nonzero(as_tuple=True)
        counts = torch.bincount(rows, minlength=logp.shape[0]).tolist()
        return [part.numpy() for part in torch.split(ids.to(torch.int32), counts)]
