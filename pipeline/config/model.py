"""``model``: the policy's weights and dtype, and ``model.lora`` (train and publish a
LoRA adapter only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.config.checks import check_choice
from pipeline.config.checks import get as _get


@dataclass
class LoraConfig:
    """``model.lora``: train and publish a LoRA adapter only (pipeline/lora.py).
    ``rank: 0`` (the default) or ``model.lora=null``: full fine-tuning."""

    rank: int = 0
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0
    # leaf names of the model's linear modules that get an adapter
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # a local folder, "tiny", or a hub id
    path: str = ""  # filled by the launcher with the materialized local folder
    dtype: str = "float32"  # the pools' dtype where actor/preprocessor/trainer.dtype is empty
    lora: LoraConfig | None = field(default_factory=LoraConfig)  # rank 0 / null: full FT


def validate_model(cfg: Any) -> None:
    """``model.dtype`` and ``model.lora`` (the values that need no model:
    pipeline/lora.py's ``validate_lora``; the module names are checked at wrap)."""
    check_choice(cfg, "model.dtype", ("float32", "bfloat16", "float16"))
    from pipeline.lora import validate_lora

    validate_lora(_get(cfg, "model.lora"))
