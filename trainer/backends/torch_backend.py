"""The ``torch`` backend: AdamW on fp32 master weights, any number of ranks.

bf16 (``trainer.dtype=bfloat16``) runs the forward under autocast while the
parameters and the optimizer stay fp32; publishing casts to bf16. With
several ranks every rank holds the whole model and the gradients are summed
with one all-reduce per step (the loss is already divided by the step's
global token count).

With ``model.lora`` the model is the base wrapped in a peft adapter: the optimizer
holds the adapter parameters only, checkpoints are peft adapter folders, and
publishing sends the adapter (pipeline/lora.py).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipeline import lora
from pipeline.config import pool_dtype
from pipeline.models import DTYPES, load_model
from trainer.backends.base import OptimizerLR, adamw, all_ranks_finite
from trainer.ranks import Ranks

OPTIMIZER_FILE = "optimizer.pt"


class TorchBackend(OptimizerLR):
    def __init__(self, cfg, ranks: Ranks, model_path: str, resume_from: str | None):
        t = cfg.trainer
        self.ranks, self.grad_clip = ranks, t.grad_clip
        self.device = torch.device(t.device)
        self.dtype = DTYPES[pool_dtype(cfg, "trainer")]
        self.autocast_dtype = None if self.dtype == torch.float32 else self.dtype
        self.lora = lora.settings(cfg.model.lora)  # set: the base frozen, the adapter trains
        if resume_from:
            lora.check_resume(resume_from, self.lora, None)
        base = model_path if self.lora or not resume_from else resume_from
        self.model, self.tokenizer = load_model(base, "float32", t.device)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        if self.lora:
            self.base_identity = lora.base_identity(cfg.model.name, model_path)
            self.model = lora.apply_lora(self.model, self.lora, cfg.run.seed).eval()
            if resume_from:
                lora.check_resume(resume_from, self.lora, self.base_identity)
                lora.load_adapter_weights(self.model, resume_from)
        self.params = lora.trainable_parameters(self.model)  # everything without model.lora
        self.optimizer = adamw(self.params, t)
        if resume_from:
            path = os.path.join(resume_from, OPTIMIZER_FILE)
            state = torch.load(path, weights_only=True, map_location=self.device)  # no pickle
            self.optimizer.load_state_dict(state)

    def step(self, micro, loss_fn) -> tuple[float, list[float] | None, bool]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        stats, loss_finite = None, True
        for mb in micro:
            loss, s = loss_fn(self.model, mb)
            loss.backward()
            loss_finite &= bool(torch.isfinite(loss.detach()))
            stats = s if stats is None else [a + b for a, b in zip(stats, s, strict=True)]
        if self.ranks.world_size > 1:
            self._all_reduce_grads()  # a non-finite gradient on any rank reaches every rank
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        applied = all_ranks_finite(self.ranks, loss_finite and bool(torch.isfinite(norm)))
        if applied:
            self.optimizer.step()
        else:  # weights and moments stay as they were; the trainer records the step
            self.optimizer.zero_grad(set_to_none=False)
        self.model.eval()
        return float(norm), stats, applied

    def _all_reduce_grads(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)  # the default group: nccl on CUDA, gloo on the CPU
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(reduced)

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        if not self.ranks.is_main:
            return None
        if self.lora:  # the adapter alone, under peft's state-dict names
            return lora.adapter_tensors(self.model, self.dtype)
        return {n: p.detach().to(self.dtype) for n, p in self.model.named_parameters()}

    def save(self, path: str) -> None:
        if not self.ranks.is_main:  # every rank holds the same weights and moments
            return
        if self.lora:  # a peft adapter folder and the base model's identity
            lora.save_adapter(self.model, path, self.base_identity)
        else:
            self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        torch.save(self.optimizer.state_dict(), os.path.join(path, OPTIMIZER_FILE))
