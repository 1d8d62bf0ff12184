"""Actor engines (``actor.engine``): the interface in base.py, ``hf`` in hf.py,
``vllm`` in vllm.py (built from the config by ``actor.engines.vllm.from_config``: it
takes a model folder, not a loaded model)."""

from __future__ import annotations

import importlib.util

from actor.engines.base import Completion, Engine, EngineStats, SwapRecord
from pipeline.config import VLLM_MISSING

ENGINES = ("hf", "vllm")


def make_engine(kind: str, model, tokenizer, **sampling) -> Engine:
    """The engine named by ``actor.engine``; ``sampling``: the HFEngine keywords."""
    if kind == "hf":
        from actor.engines.hf import HFEngine

        return HFEngine(model, tokenizer, **sampling)
    if kind == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(VLLM_MISSING)
        raise ValueError(
            "actor.engine=vllm is built from the config (a model folder, not a loaded "
            "model): use actor.engines.vllm.from_config(cfg, model_path, tokenizer, seed)"
        )
    raise ValueError(f"actor.engine={kind!r} is not an engine; use one of {ENGINES}")


__all__ = ["ENGINES", "Completion", "Engine", "EngineStats", "SwapRecord", "make_engine"]
