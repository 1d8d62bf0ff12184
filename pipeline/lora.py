"""LoRA adapters (``model.lora``): train, checkpoint and publish the adapter only.

With ``model.lora.rank`` > 0 (:func:`settings`; rank 0 or null: full fine-tuning),
every pool wraps the same base model (``model.name``) in a peft LoRA model built by
:func:`apply_lora` with the same seed, so the actors' adapter at version 0 equals the
trainer's. The trainer's optimizer sees only the adapter
parameters (the base weights are frozen and stay bit-identical); its checkpoints are
standard peft adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``,
loadable with ``PeftModel.from_pretrained(base, folder)``) plus ``base_model.json``,
the identity of the base model the adapter was trained on (:func:`base_identity`);
a restart on another base model is refused (:func:`check_resume`).

Publishing sends :func:`adapter_tensors` (peft state-dict names, the adapter name
removed) through the ordinary transfer, announced with ``kind="lora"``; an engine
installs them into the tensors :func:`adapter_parameters` names.

The reference log-probs (``preprocessor`` scorer ``reference``) come from the base model
folder, which is exactly the model the adapter is applied to: the preprocessor never
holds the adapter, so no second copy of the base weights exists in any process.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

ADAPTER_NAME = "default"
IDENTITY_FILE = "base_model.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KIND_FULL, KIND_LORA = "full", "lora"


class KindMismatch(ValueError):
    """A published version of the other kind (full weights vs a LoRA adapter): this
    actor can never take it, so retrying is useless (the weight receiver stops the actor)."""


def check_kind(published: str, version: int, takes: str, engine: str) -> None:
    """Refuse version ``version`` of kind ``published`` in an engine that takes ``takes``
    (every engine's one kind check: the hf engine, the vllm client and its worker)."""
    if published == takes:
        return
    if published == KIND_LORA:
        why = (
            f"is a LoRA adapter (kind='lora') but {engine} was started without model.lora "
            f"and takes {takes!r} weights"
        )
    else:
        why = (
            f"holds {published!r} weights but {engine} was started with model.lora and "
            f"takes {takes!r} adapters only"
        )
    raise KindMismatch(
        f"version {version} {why}; give every pool the same model.lora settings as the "
        "trainer's (rank 0 or null for full fine-tuning)"
    )


# ---------------------------------------------------------------- config


def settings(lora: Any) -> Any | None:
    """``model.lora`` when it asks for an adapter; None (full fine-tuning) for null or rank 0."""
    return None if lora is None or lora.rank == 0 else lora


def validate_lora(lora: Any) -> None:
    """``model.lora`` values that need no model (the module names are checked at wrap)."""
    if lora is not None and (not isinstance(lora.rank, int) or lora.rank < 0):
        raise ValueError(
            f"model.lora.rank={lora.rank!r} must be a positive integer (e.g. 16), "
            "or 0 for full fine-tuning"
        )
    if settings(lora) is None:
        return
    if lora.alpha <= 0:
        raise ValueError(f"model.lora.alpha={lora.alpha!r} must be > 0 (e.g. twice the rank)")
    if not 0 <= lora.dropout < 1:
        raise ValueError(f"model.lora.dropout={lora.dropout!r} must be in [0, 1)")
    targets = list(lora.target_modules or [])
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(
            f"model.lora.target_modules={targets!r} must be a non-empty list of linear "
            "module names, e.g. [q_proj,v_proj]"
        )


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The leaf names of the model's linear modules (what target_modules may name)."""
    kinds: tuple[type, ...] = (torch.nn.Linear,)
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2 style projections

        kinds += (Conv1D,)
    except ImportError:
        pass
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, kinds)})


def peft_config(lora: Any, model: torch.nn.Module):
    """The peft LoraConfig for ``model.lora``; ValueError for module names the model lacks."""
    from peft import LoraConfig

    validate_lora(lora)
    assert settings(lora) is not None, "model.lora asks for full fine-tuning"
    available = linear_module_names(model)
    unknown = [t for t in lora.target_modules if t not in available]
    if unknown:
        raise ValueError(
            f"model.lora.target_modules names {unknown}, which this model has no linear "
            f"module called; its linear modules are {available}"
        )
    return LoraConfig(
        r=int(lora.rank),
        lora_alpha=float(lora.alpha),
        lora_dropout=float(lora.dropout),
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: torch.nn.Module, lora: Any, seed: int = 0):
    """Wrap ``model`` in a peft LoRA model: base weights frozen, adapter trainable.

    The adapter is initialised from ``seed`` alone (the global RNG is left as it was), so
    every pool that wraps the same base with the same seed holds the same adapter.
    """
    from peft import get_peft_model

    config = peft_config(lora, model)
    device = next(model.parameters()).device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, config, adapter_name=ADAPTER_NAME)
    return wrapped


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config")


# ---------------------------------------------------------------- names and tensors


def _wire_name(param_name: str) -> str:
    """``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight`` (peft's key)."""
    return param_name.replace(f".{ADAPTER_NAME}.", ".")


def adapter_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The adapter's parameters under their peft state-dict names (what is published)."""
    params = {
        _wire_name(n): p
        for n, p in model.named_parameters()
        if f".{ADAPTER_NAME}." in n and ".lora_" in n
    }
    assert params, "the model holds no LoRA adapter"
    return params


def adapter_tensors(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter for publishing: detached views (no copy) unless cast to ``dtype``."""
    return {
        n: p.detach() if dtype is None else p.detach().to(dtype)
        for n, p in adapter_parameters(model).items()
    }


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ---------------------------------------------------------------- base identity


def base_identity(name: str, path: str) -> dict:
    """Who the base model is: the configured name, its hub revision where the folder is a
    hub snapshot, and a sha256 over its weight files (names and bytes, in name order)."""
    folder = Path(path)
    digest = hashlib.sha256()
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise ValueError(f"base model folder {path} holds no *.safetensors or *.bin weights")
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
    revision = folder.name if folder.parent.name == "snapshots" else ""
    return {"name": name, "revision": revision, "weights_sha256": digest.hexdigest()}


def save_adapter(model, folder: str, identity: dict, adapter: dict | None = None) -> None:
    """Write the peft adapter folder and the base model's identity. ``adapter``: the
    tensors under peft's names, where the live ones are partitioned (ZeRO-3)."""
    state = None
    if adapter is not None:  # peft filters a state dict keyed by parameter names
        full = {_wire_name(n): n for n, _ in model.named_parameters()}
        state = {full[n]: t for n, t in adapter.items()}
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    with open(os.path.join(folder, IDENTITY_FILE), "w") as f:
        json.dump(identity, f, indent=2)


def check_resume(path: str, lora: Any, identity: dict | None) -> None:
    """Refuse a checkpoint of another kind, adapter shape or base model, saying why."""
    has_adapter = os.path.isfile(os.path.join(path, ADAPTER_CONFIG))
    if lora is None:
        if has_adapter:
            raise ValueError(
                f"checkpoint {path} holds a LoRA adapter but model.lora is off (rank 0 or "
                "null); resume with the run's model.lora settings, or start a fresh run_dir "
                "for full fine-tuning"
            )
        return
    if not has_adapter:
        raise ValueError(
            f"checkpoint {path} holds full weights but model.lora is set; resume with "
            "model.lora=null, or start a fresh run_dir to train an adapter"
        )
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        saved = json.load(f)
    ours = {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": sorted(lora.target_modules)}
    theirs = {
        "r": saved.get("r"),
        "lora_alpha": saved.get("lora_alpha"),
        "target_modules": sorted(saved.get("target_modules") or []),
    }
    if ours != theirs:
        raise ValueError(
            f"checkpoint {path} holds an adapter with {theirs} but model.lora asks for "
            f"{ours}; resume with the checkpoint's settings or start a fresh run_dir"
        )
    with open(os.path.join(path, IDENTITY_FILE)) as f:
        saved_base = json.load(f)
    if identity is not None and saved_base != identity:
        raise ValueError(
            f"checkpoint {path} was trained on base model {saved_base} but this run's base "
            f"model is {identity}; an adapter only fits the base it was trained on: set "
            "model.name to that base, or start a fresh run_dir"
        )


def load_adapter_weights(model, path: str) -> None:
    """Set the adapter from a checkpoint's adapter_model.safetensors, every tensor exactly."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    expected = set(adapter_parameters(model))
    if set(state) != expected:
        raise ValueError(
            f"checkpoint {path}: adapter tensors {sorted(set(state) ^ expected)[:4]} do not "
            "match this model's adapter; resume with the checkpoint's model.lora settings"
        )
    set_peft_model_state_dict(model, state, adapter_name=ADAPTER_NAME)
