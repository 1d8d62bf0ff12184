"""Actor engines (``actor.engine``): the interface in base.py, ``hf`` in hf.py."""

from __future__ import annotations

import importlib.util

from actor.engines.base import Completion, Engine, EngineStats, SwapRecord

ENGINES = ("hf", "vllm")
VLLM_MISSING = (
    "actor.engine=vllm needs vLLM 0.24.0, which is not installed: on a CUDA host run "
    "pip install -e '.[gpu]' (it pulls a CUDA torch; never on the CPU machines), "
    "or use actor.engine=hf"
)
VLLM_NOT_BUILT = (
    "actor.engine=vllm is not implemented yet (the vLLM worker extension with the "
    "per-forward-pass lock is issue 12); use actor.engine=hf"
)


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
