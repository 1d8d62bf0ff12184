"""The ``deepspeed`` backend: a DeepSpeed engine with ZeRO stage 0-3.

On the CPU it runs over gloo with the client ``torch.optim.AdamW``, fused
(``base.adamw``; DeepSpeed's own Adam would need a compiler) and with the
shared-memory comm op switched off (it would g++-build for a minute or two). bf16
keeps fp32 master weights inside the engine. Gradient accumulation is unmanaged:
every ``backward`` adds to the gradients and ``step`` is the boundary, however many
micro-batches a step has. DeepSpeed averages gradients over ranks, so each rank's loss is
multiplied by the world size to keep the token-mean over all ranks.

Checkpoints: ``engine.save_checkpoint`` (every rank writes its shards into the
same folder) plus an HF copy of the gathered weights for people and tools.
With ``model.lora``: the engine wraps the peft model, the optimizer holds the
adapter only, the DeepSpeed checkpoint leaves the frozen base out, and the HF
copy is a peft adapter folder with the base model's identity (pipeline/lora.py).

With ``trainer.expert_parallel`` N > 1 (ZeRO-3): DeepSpeed AutoEP replaces each MoE
block with an ``AutoEPMoELayer`` whose rank holds experts/N of the experts and sends
tokens to their experts' ranks (all-to-all; gloo on the CPU). ``full_parameters``
gathers the experts back from the expert group under the HF names (see ``autoep_*``).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from pipeline import lora, routing
from pipeline.config import pool_dtype
from pipeline.models import DTYPES, load_model
from trainer.backends.base import OptimizerLR, adamw, all_ranks_finite
from trainer.ranks import Ranks

TAG = "deepspeed"


def import_deepspeed(device: str):
    """Import DeepSpeed for ``device`` without its JIT-built shared-memory comm op."""
    if not device.startswith("cuda"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:
        raise ValueError(
            f"trainer.backend=deepspeed needs the deepspeed package ({e}); run `make setup`"
        ) from None
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed calls collectives torch has renamed; one warning per call floods the log
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.", category=FutureWarning)
    return deepspeed


def ds_config(t, dtype: str) -> dict:
    zero = {"stage": t.zero_stage, "overlap_comm": False}
    if t.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bfloat16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


# --- expert parallelism (DeepSpeed AutoEP) ---------------------------------------------

AUTOEP_PRESETS = {"qwen3_moe": "qwen3_moe"}  # HF model_type -> AutoEP preset, HF names checked


def autoep_config(t, hf_config) -> dict | None:
    """The ``expert_parallel`` section for ``trainer.expert_parallel`` (None when 1), or
    ValueError saying why this model cannot take it."""
    ep = t.expert_parallel
    if ep == 1:
        return None
    kind = getattr(hf_config, "model_type", "?")
    if kind not in AUTOEP_PRESETS:
        raise ValueError(
            f"trainer.expert_parallel={ep}: the model is {kind!r}; this trainer runs DeepSpeed "
            f"AutoEP for {sorted(AUTOEP_PRESETS)} (the models whose expert weights it maps "
            "back to HF names for publishing); set trainer.expert_parallel=1"
        )
    experts = int(getattr(hf_config, "num_experts", 0))
    if experts % ep:
        raise ValueError(
            f"trainer.expert_parallel={ep} must divide the model's {experts} experts per layer"
        )
    return {
        "enabled": True,
        "autoep_size": ep,
        "preset_model": AUTOEP_PRESETS[kind],
    }


@contextlib.contextmanager
def autoep_transformers_registry():
    """Let DeepSpeed 0.19.8's AutoEP read transformers 5's output-capture registry.

    AutoEP re-points HF's ``router_logits`` recorders at its router and calls
    ``_CAN_RECORD_REGISTRY.get(key, default)`` / ``registry[key] = ...`` with class-name
    strings; transformers 5.24's ``_CanRecordRegistry.get`` takes a model only (TypeError:
    "get() takes 2 positional arguments but 3 were given") and its ``__setitem__`` keys on
    the value's class. For the length of ``deepspeed.initialize`` the registry also
    accepts string keys as a plain dict; model lookups are unchanged."""
    from transformers.utils import output_capturing

    registry = output_capturing._CAN_RECORD_REGISTRY
    original = type(registry)

    class StringKeys(original):
        def get(self, key, default=None):
            return dict.get(self, key, default) if isinstance(key, str) else original.get(self, key)

        def __setitem__(self, key, value):
            if isinstance(key, str):
                dict.__setitem__(self, key, value)
            else:
                original.__setitem__(self, key, value)

    registry.__class__ = StringKeys
    try:
        yield
    finally:
        registry.__class__ = original


def autoep_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``AutoEPMoELayer`` modules AutoEP put in place of the MoE blocks, in order."""
    return [m for m in module.modules() if getattr(m, "_is_autoep_layer", False)]


def autoep_full_parameters(engine, is_main: bool, dtype: torch.dtype) -> dict | None:
    """Every parameter under its HF name (all ranks call it; rank 0 gets the dict).

    ZeRO-3 shards non-expert parameters over the ranks and each expert parameter over its
    expert-data group; AutoEP holds experts ``[r * E/N, (r + 1) * E/N)`` on expert rank r
    as ``w1`` (gate), ``w3`` (up), ``w2`` (down). Gathered and concatenated over the expert
    group they are HF's ``gate_up_proj = cat(w1, w3)`` and ``down_proj = w2``; the router is
    HF's ``gate``. (DeepSpeed's own consolidated export refuses AutoEP under ZeRO-3.)"""
    import deepspeed
    import torch.distributed as dist

    owner = {}
    for layer in autoep_layers(engine.module):
        for p in layer.experts.parameters():
            owner[id(p)] = layer
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            t = p.detach().to(dtype).clone()
        layer = owner.get(id(p))
        if layer is not None:  # this rank's experts -> all of them, in expert-rank order
            parts = [torch.empty_like(t) for _ in range(layer.ep_size)]
            dist.all_gather(parts, t.contiguous(), group=layer.ep_group)
            prefix, w = name.rsplit(".", 1)
            experts.setdefault(prefix, {})[w] = torch.cat(parts)
        elif is_main:
            out[name.replace(".router.gate.weight", ".gate.weight")] = t
    if not is_main:
        return None
    for prefix, w in experts.items():
        out[f"{prefix}.gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1)
        out[f"{prefix}.down_proj"] = w["w2"]
    return out


class DeepSpeedBackend(OptimizerLR):
    def __init__(self, cfg, ranks: Ranks, model_path: str, resume_from: str | None):
        t = cfg.trainer
        deepspeed = import_deepspeed(t.device)
        deepspeed.init_distributed(dist_backend="nccl" if t.device.startswith("cuda") else "gloo")
        self.ranks, self.stage = ranks, t.zero_stage
        self.device = torch.device(t.device)
        self.dtype = DTYPES[pool_dtype(cfg, "trainer")]
        self.autocast_dtype = None  # the engine holds the module in the compute dtype
        model, self.tokenizer = load_model(model_path, "float32", "cpu")
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.lora = lora.settings(cfg.model.lora)  # set: the base frozen, the adapter trains
        if self.lora:
            self.base_identity = lora.base_identity(cfg.model.name, model_path)
            model = lora.apply_lora(model, self.lora, cfg.run.seed)
        if resume_from:  # refuse another kind, adapter shape or base model, saying why
            lora.check_resume(resume_from, self.lora, getattr(self, "base_identity", None))
        if self.stage == 3 and routing.is_moe(model):
            # an expert loop runs only the experts some token was routed to, so the ranks
            # would gather different parameters: ZeRO-3 fetches each MoE block whole
            # (DeepSpeed 0.19 does so itself for Mixtral and Qwen-MoE blocks, not OLMoE's)
            deepspeed.utils.set_z3_leaf_modules(model, routing.moe_blocks(model))
        trainable = lora.trainable_parameters(model)  # every parameter without model.lora
        optimizer = adamw(trainable, t)  # fused: under ZeRO it steps one flat partition
        config = ds_config(t, pool_dtype(cfg, "trainer"))
        expert_parallel = autoep_config(t, model.config)
        if expert_parallel and self.lora:
            raise ValueError(
                "trainer.expert_parallel with model.lora is not supported (AutoEP replaces the "
                "expert modules the adapter would wrap); set one of them off"
            )
        self.autoep = expert_parallel is not None
        if self.autoep:
            config["expert_parallel"] = expert_parallel
        with autoep_transformers_registry() if self.autoep else contextlib.nullcontext():
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=optimizer, config=config
            )
        self.hf_config = model.config
        if resume_from:
            path, _ = self.engine.load_checkpoint(
                resume_from,
                tag=TAG,
                load_module_strict=not self.lora,  # a LoRA checkpoint leaves the base out
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
            )
            if path is None:
                raise ValueError(f"{resume_from} holds no DeepSpeed checkpoint (tag {TAG!r})")

    def step(self, micro, loss_fn) -> tuple[float, list[float] | None, bool]:
        """One step; not applied when the loss or the gradient is not finite.

        ZeRO-1/2/3 discard such a step themselves (their overflow check finds a
        non-finite gradient norm, whatever the dtype) and ``was_step_applied`` says so;
        stage 0 has no such check, so the gradients are checked here and the engine's
        step is not called. A non-finite loss whose step DeepSpeed applied anyway stops
        the trainer (RuntimeError) before anything is published."""
        self.engine.train()
        stats, loss_finite = None, True
        world = float(self.ranks.world_size)
        for mb in micro:
            loss, s = loss_fn(self.engine, mb)
            loss_finite &= bool(torch.isfinite(loss.detach()))
            self.engine.backward(loss * world, scale_wrt_gas=False)
            stats = s if stats is None else [a + b for a, b in zip(stats, s, strict=True)]
        if self.stage == 0:
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            finite = loss_finite and all(bool(torch.isfinite(g).all()) for g in grads)
            applied = all_ranks_finite(self.ranks, finite)
            if applied:
                self.engine.step()
            else:
                self.engine.zero_grad()
        else:
            loss_finite = all_ranks_finite(self.ranks, loss_finite)
            self.engine.step()
            applied = bool(self.engine.was_step_applied())
            if applied and not loss_finite:
                raise RuntimeError(
                    "DeepSpeed applied a step whose loss was not finite (its overflow check "
                    "saw a finite gradient); the weights may be corrupt and nothing was "
                    "published: restart from the last checkpoint"
                )
        self.engine.eval()
        norm = self.engine.get_global_grad_norm() if applied else float("nan")
        return float(norm) if norm is not None else float("nan"), stats, applied

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        """Every rank calls this; under ZeRO-3 it gathers the partitioned parameters."""
        if self.lora:
            return self._adapter(self.dtype)
        if self.autoep:
            return autoep_full_parameters(self.engine, self.ranks.is_main, self.dtype)
        names = [n for n, _ in self.engine.module.named_parameters()]
        if self.stage == 3:
            sd = self.engine._zero3_consolidated_16bit_state_dict()
            if not self.ranks.is_main:
                return None
            return {n: sd[n].to(self.dtype) for n in names}
        if not self.ranks.is_main:
            return None
        return {n: p.detach().to(self.dtype) for n, p in self.engine.module.named_parameters()}

    def _adapter(self, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """The adapter under peft's state-dict names (ZeRO-3: gathered, adapter only)."""
        params = lora.adapter_parameters(self.engine.module)
        if self.stage != 3:
            return lora.adapter_tensors(self.engine.module, dtype) if self.ranks.is_main else None
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            if not self.ranks.is_main:
                return None
            return {n: p.detach().to(dtype).clone() for n, p in params.items()}

    def save(self, path: str) -> None:
        self.engine.save_checkpoint(
            path, tag=TAG, save_latest=False, exclude_frozen_parameters=bool(self.lora)
        )
        if self.lora:
            self._save_adapter(path)
            return
        params = self.full_parameters()
        if params is not None:
            self.engine.module.save_pretrained(
                path, state_dict=dict(params), safe_serialization=True
            )
            self.tokenizer.save_pretrained(path)

    def _save_adapter(self, path: str) -> None:
        """Rank 0 writes the peft adapter folder (fp32 adapter, gathered under ZeRO-3)."""
        adapter = self._adapter(torch.float32)
        if adapter is not None:
            lora.save_adapter(self.engine.module, path, self.base_identity, adapter)
            self.tokenizer.save_pretrained(path)
