"""Actor engines (``actor.engine``): the interface in base.py, ``hf`` in hf.py, ``vllm``
in vllm/ (client.py). :func:`make_engine` builds either from the composed config."""

from __future__ import annotations

import importlib.util
from typing import Any

from actor.engines.base import Completion, Engine, EngineStats, SwapRecord
from pipeline.config import VLLM_MISSING

ENGINES = ("hf", "vllm")
FROM_FOLDER = object()  # make_engine(tokenizer=...): the model folder's own tokenizer


def make_engine(cfg: Any, path: str, seed: int, tokenizer: Any = FROM_FOLDER) -> Engine:
    """The engine ``cfg.actor.engine`` names, for the model folder ``path``, sampling with
    ``seed`` (this pool's). ``hf`` loads the model here (``actor.device``, the pool's
    dtype; ``model.lora``: wrapped with the trainer's version-0 adapter, the run's seed);
    ``vllm`` hands the folder to vLLM, which loads it in its engine-core process.
    ``tokenizer``: the folder's unless given (None: token ids only, no stop tokens; vllm
    only). The engine's ``tokenizer`` attribute is the one it uses. ``sampling.keep_routing``:
    the engine records every token's experts and says their layout in ``route_layout``
    (a RouteLayout, or the [layers, k, experts] list the vllm worker reports; a dense
    model is refused, naming the fix)."""
    from pipeline.config import pool_dtype

    kind = cfg.actor.engine
    e = cfg.sampling
    if kind == "hf":
        from actor.engines.hf import HFEngine
        from pipeline import lora
        from pipeline.models import load_model

        if tokenizer is not FROM_FOLDER:
            raise ValueError("actor.engine=hf uses its model folder's tokenizer; pass none")
        model, tok = load_model(path, pool_dtype(cfg, "actor"), cfg.actor.device)
        if lora.settings(cfg.model.lora):  # the trainer's initial adapter (same seed)
            model = lora.apply_lora(model, cfg.model.lora, cfg.run.seed).eval()
        return HFEngine(
            model,
            tok,
            temperature=e.temperature,
            top_p=e.top_p,
            top_k=e.top_k,
            seed=seed,
            keep_sampling_mask=e.keep_sampling_mask,
            keep_routing=e.keep_routing,
        )
    if kind == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(VLLM_MISSING)
        from actor.engines.vllm.client import from_config

        if tokenizer is FROM_FOLDER:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
        engine = from_config(cfg, path, tokenizer, seed)  # sampling.keep_routing: its own
        if e.keep_routing and engine.route_layout is None:
            engine.close()
            raise ValueError(
                "sampling.keep_routing=true: this build's vllm engine records no routes; "
                "use actor.engine=hf or set sampling.keep_routing=false"
            )
        return engine
    raise ValueError(f"actor.engine={kind!r} is not an engine; use one of {ENGINES}")


__all__ = ["ENGINES", "Completion", "Engine", "EngineStats", "SwapRecord", "make_engine"]
