"""Trainer backends behind one small interface (:class:`Backend`).

``torch``: plain AdamW, gradients summed over ranks with an all-reduce.
``deepspeed``: a DeepSpeed engine, ZeRO stage ``trainer.zero_stage`` (0-3).
Both train a LoRA adapter alone when ``model.lora`` asks for one (pipeline/lora.py).
The interface and the part both share are in base.py.
:func:`describe` names what runs (the trainer's first log line, summary.json).
"""

from __future__ import annotations

from pipeline.config import pool_dtype
from trainer.backends.base import Backend
from trainer.ranks import Ranks

BACKENDS = ("torch", "deepspeed")


def describe(cfg) -> dict[str, str | int]:
    """What the trainer runs, for its first log line and summary.json (through its status
    hash): backend, ZeRO stage (deepspeed only), world size, dtype and device."""
    t = cfg.trainer
    setup: dict[str, str | int] = {"backend": str(t.backend)}
    if t.backend == "deepspeed":
        setup["zero_stage"] = int(t.zero_stage)
    setup |= {
        "world_size": int(t.world_size),
        "dtype": str(pool_dtype(cfg, "trainer")),
        "device": str(t.device),
    }
    return setup


def describe_line(cfg) -> str:
    """``backend=deepspeed zero_stage=3 world_size=2 dtype=bfloat16 device=cpu``"""
    return " ".join(f"{k}={v}" for k, v in describe(cfg).items())


def make_backend(cfg, ranks: Ranks, model_path: str, resume_from: str | None) -> Backend:
    """The configured backend, with weights and optimizer restored from ``resume_from``."""
    kind = cfg.trainer.backend
    if kind == "torch":
        from trainer.backends.torch_backend import TorchBackend

        return TorchBackend(cfg, ranks, model_path, resume_from)
    if kind == "deepspeed":
        from trainer.backends.deepspeed_backend import DeepSpeedBackend

        return DeepSpeedBackend(cfg, ranks, model_path, resume_from)
    raise ValueError(f"trainer.backend={kind!r} is not supported; use one of {BACKENDS}")
