"""Actor engines (``actor.engine``): the interface in base.py, ``hf`` in hf.py."""

from __future__ import annotations

import importlib.util

from actor.engines.base import Completion, Engine, EngineStats, SwapRecord
from pipeline.config import VLLM_MISSING, VLLM_NOT_BUILT

ENGINES = ("hf", "vllm")


def make_engine(kind: str, model, tokenizer, **sampling) -> Engine:
    """The engine named by ``actor.engine``; ``sampling``: the HFEngine keywords."""
    if kind == "hf":
        from actor.engines.hf import HFEngine

        return HFEngine(model, tokenizer, **sampling)
    if kind == "vllm":
        raise ValueError(
            VLLM_MISSING if importlib.util.find_spec("vllm") is None else VLLM_NOT_BUILT
        )
    raise ValueError(f"actor.engine={kind!r} is not an engine; use one of {ENGINES}")


__all__ = ["ENGINES", "Completion", "Engine", "EngineStats", "SwapRecord", "make_engine"]
