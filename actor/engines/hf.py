"""The ``hf`` inference engine: batched sampling on a transformers model.

Every forward pass runs under ``self.lock`` and reads the policy version at
that moment, so each sampled token is tagged with the version that produced
it. :meth:`swap` installs new weights under the same lock, between two
forward passes: sequences in flight keep their KV cache and continue on the
new weights. The log-prob recorded for each token is taken under the
distribution actually sampled from (temperature, then top-k/top-p). The
sampling loop stays on the model's device: per-token results are gathered
as tensors and turned into lists once per generate() call.

With ``keep_routing`` (sampling.keep_routing, MoE models) a forward hook on every router
(pipeline/routing.py's ``capture``) records the experts each fed-forward token went to:
the prefill gives the prompt's rows (its left padding gives none), each decode step one
row per sequence; :meth:`_routes` lays them out ``[prompt + completion - 1, layers, k]``
per sequence, cut where its tokens are cut (EOS, a stop string, should_stop).

A peft LoRA model (``model.lora``, pipeline/lora.py) swaps its adapter alone:
the announcements say ``kind="lora"`` and name the adapter's tensors, staged
and swapped under the same lock as full weights; the base never changes.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time

import numpy as np
import torch
from transformers import DynamicCache

from actor.engines.base import Completion, Engine, EngineStats
from pipeline import lora, routing
from pipeline.logprobs import sampling_logprobs
from pipeline.messages import BucketSpec, WeightAnnouncement
from pipeline.transfer import BucketSource


class HFEngine(Engine):
    name = "hf"

    def __init__(
        self,
        model,
        tokenizer,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int = 0,
        keep_sampling_mask: bool = False,
        keep_routing: bool = False,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        truncating = top_p < 1.0 or 0 < top_k < model.config.vocab_size
        self.keep_sampling_mask = keep_sampling_mask and truncating
        # sampling.keep_routing: the route layout (a dense model: ValueError naming the fix)
        self.route_layout = routing.layout_of(model) if keep_routing else None
        self.lock = threading.Condition()
        self.version: int | None = 0
        self.stats = EngineStats()
        self.kind = lora.KIND_LORA if lora.is_lora(model) else lora.KIND_FULL
        # what a new version replaces: the adapter only, or every weight
        adapter = self.kind == lora.KIND_LORA
        self._params = lora.adapter_parameters(model) if adapter else dict(model.named_parameters())
        self.device = next(iter(self._params.values())).device
        self.stop_ids = self._stop_ids(tokenizer)
        # strings that end a row too (an environment's tool-call closing tags, set by
        # actor/episodes.py): the row stops at the token that completes one, read from
        # the decoded tail of its sampled ids; not EOS (``finished`` stays False)
        self.stop_strings: tuple[str, ...] = ()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._active: list[torch.Tensor] | None = None  # staging buffers that are the weights
        self._spare: list[torch.Tensor] | None = None  # released buffers, reused as staging
        self._staged: tuple | None = None  # (version, layout, buffers) received, not yet live

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

    def _staging(self, layout: list[BucketSpec], dtype: torch.dtype) -> list[torch.Tensor]:
        spare = self._spare
        if (
            spare
            and [b.numel() for b in spare] == [b.numel for b in layout]
            and spare[0].dtype == dtype
        ):
            return spare
        return [torch.empty(b.numel, dtype=dtype, device=self.device) for b in layout]

    def _check_kind(self, ann: WeightAnnouncement) -> None:
        lora.check_kind(ann.kind, ann.version, self.kind, "this actor's hf engine")

    def stage(self, ann: WeightAnnouncement, source: BucketSource, deadline: float) -> None:
        self._check_kind(ann)
        self._staged = None
        buffers = self._staging(ann.buckets, getattr(torch, ann.dtype))
        for i, buf in enumerate(buffers):
            source.fetch(i, buf, deadline)
        self._staged = (ann.version, ann.buckets, buffers)

    def swap(self, version: int) -> None:
        """Install the staged buffers; the buffers they replace become the next staging."""
        if self._staged is None or self._staged[0] != version:
            raise RuntimeError(f"version {version} is not staged; stage() it first")
        _, layout, buckets = self._staged
        self._staged = None
        views = list(self._views(layout, buckets))
        pointer = all(v.dtype == p.dtype and v.device == p.device for p, v in views)
        with self.lock:
            t0 = time.perf_counter()  # the swap's cost: time holding the lock
            for param, v in views:
                if pointer:
                    param.data = v  # pointer swap: the staging copy becomes the weights
                else:
                    param.data.copy_(v)
            self._set_version(version)
            self.stats.add_swap(t0, version, "staged")
        if pointer:
            self._spare, self._active = self._active, buckets
        else:
            self._spare = buckets

    def update_in_place(
        self, ann: WeightAnnouncement, source: BucketSource, deadline: float
    ) -> None:
        self._check_kind(ann)
        dtype = getattr(torch, ann.dtype)
        scratch = torch.empty(max(b.numel for b in ann.buckets), dtype=dtype, device=self.device)
        with self.lock:
            t0 = time.perf_counter()  # generation is paused from here to the release
            installed = None
            self._set_version(None)  # from here until success, the weights are partial
            try:
                for i, spec in enumerate(ann.buckets):
                    bucket = scratch[: spec.numel]
                    source.fetch(i, bucket, deadline)
                    for p in spec.params:
                        param = self._params[p.name].data
                        param.copy_(bucket[p.offset : p.offset + param.numel()].view_as(param))
                self._set_version(ann.version)
                installed = ann.version
            finally:
                self.stats.add_swap(t0, installed, "in-place")

    def _set_version(self, version: int | None) -> None:
        """Caller holds the lock. None marks the weights partial: no forward pass runs."""
        self.version = version
        if version is not None:
            self.stats.new_version()
            self.lock.notify_all()

    def _forward(self, **inputs) -> tuple[torch.Tensor, int]:
        with self.lock:
            while self.version is None:  # a failed in-place transfer: wait for a whole version
                self.lock.wait(1.0)
            start = time.perf_counter()
            logits = self.model(**inputs, use_cache=True).logits[:, -1, :]
            version = self.version
            self.stats.timeline.append((start, time.perf_counter()))
        self.stats.forward_passes += 1
        return logits, version

    # -- sampling ------------------------------------------------------------
    def _prompt_batch(self, prompts: list[list[int]]):
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # once per prompt, on the host
            ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, should_stop=lambda: False
    ) -> list[Completion]:
        batch = len(prompts)
        ids, mask = self._prompt_batch(prompts)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        stop = torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=self.device)
        cache = DynamicCache()
        alive = torch.ones(batch, dtype=torch.bool, device=self.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # token, lp, live
        versions: list[int] = []
        kept: list[list] = []
        self.stats.breaks.append(time.perf_counter())  # no gap is measured across calls
        with self._recording() as calls:  # keep_routing: each forward pass's expert ids
            logits, version = self._forward(
                input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache
            )
            for _ in range(max_new_tokens):
                logp = sampling_logprobs(logits, self.temperature, self.top_p, self.top_k)
                token = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
                steps.append((token, logp.gather(-1, token[:, None]).squeeze(-1), alive.clone()))
                versions.append(version)
                if self.keep_sampling_mask:
                    kept.append(self._kept_ids(logp))
                stopped = alive & torch.isin(token, stop)
                finished |= stopped
                alive &= ~stopped
                if self.stop_strings:
                    alive &= ~self._at_stop_string(steps)
                if not bool(alive.any()) or should_stop():  # one host sync per token step
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
        outs = self._completions(steps, versions, kept, finished)
        if calls is not None:
            for out, rows in zip(outs, self._routes(calls, prompts, outs), strict=True):
                out.routes = rows
        return outs

    @contextlib.contextmanager
    def _recording(self):
        """keep_routing: per forward pass, each MoE layer's ``[tokens, k]`` expert ids
        (None without keep_routing), kept on the model's device until :meth:`_routes`
        (pipeline/routing.py ``capture``: one transfer per generate)."""
        if self.route_layout is None:
            yield None
            return
        with routing.capture(self.model, on_device=True) as calls:
            yield calls

    def _routes(self, calls, prompts, outs) -> list[np.ndarray]:
        """Per sequence, its routes ``[len(prompt) + len(tokens) - 1, layers, k]``: the
        prefill's rows right of the left padding, then the first ``len(tokens) - 1``
        decode steps' (its later steps, if any, fed padding or a token it does not keep)."""
        batch, width = len(prompts), max(len(p) for p in prompts)
        # every pass's ids as [batch, seq, layers, k], the passes end to end: column
        # width + s is decode step s; one transfer to the host
        ids = torch.cat(
            [torch.stack(c, dim=1).view(batch, -1, len(c), c[0].shape[-1]) for c in calls], 1
        )
        ids = np.sort(ids.cpu().numpy(), axis=-1).astype(self.route_layout.dtype)
        routes = []
        for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
            fed = max(len(out.tokens) - 1, 0)  # the last token is never fed forward
            routes.append(ids[i, width - len(p) : width + fed])
        return routes

    def _at_stop_string(self, steps) -> torch.Tensor:
        """Per row, whether the text of its last sampled ids holds a stop string (only the
        tail is decoded: a stop string spans at most ``len(s)`` ids, each id at least one
        character; a row stops at the first id that completes one, so an earlier one
        was never in its tail)."""
        longest = max(len(s) for s in self.stop_strings)
        tail = torch.stack([t for t, _, _ in steps[-longest:]], dim=1).tolist()
        live = torch.stack([a for _, _, a in steps[-longest:]], dim=1).tolist()
        hit = []
        for row, alive in zip(tail, live, strict=True):
            text = self.tokenizer.decode([t for t, a in zip(row, alive, strict=True) if a])
            hit.append(any(s in text for s in self.stop_strings))
        return torch.tensor(hit, dtype=torch.bool, device=self.device)

    def _completions(self, steps, versions, kept, finished) -> list[Completion]:
        """Per row, its tokens up to where it stopped: one transfer to the host."""
        if not steps:
            return [Completion([], [], [], False) for _ in range(len(finished))]
        tokens = torch.stack([s[0] for s in steps], 1).tolist()
        logprobs = torch.stack([s[1] for s in steps], 1).float().tolist()
        lengths = torch.stack([s[2] for s in steps], 1).sum(1).tolist()
        done = finished.tolist()
        self.stats.tokens += sum(lengths)
        return [
            Completion(
                tokens[i][:n],
                logprobs[i][:n],
                versions[:n],
                done[i],
                [kept[t][i] for t in range(n)] if kept else [],
            )
            for i, n in enumerate(lengths)
        ]

    @staticmethod
    def _kept_ids(logp: torch.Tensor) -> list:
        """Per row, the int32 vocabulary ids top-k/top-p left finite (host arrays)."""
        rows, ids = torch.isfinite(logp).nonzero(as_tuple=True)
        counts = torch.bincount(rows, minlength=logp.shape[0]).tolist()
        return [part.numpy() for part in torch.split(ids.to(torch.int32).cpu(), counts)]
