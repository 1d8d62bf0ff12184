"""``sampling`` (the ``sampling`` config group, conf/sampling/): how the actor samples
and batches, for every engine. ``actor.engine`` picks the engine (hf | vllm) and
``actor.vllm`` holds the vLLM engine's own settings (pipeline/config/actor.py). This
section was called ``engine`` before; pipeline/config/load.py refuses that name with
the new key."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config.checks import check_positive
from pipeline.config.checks import get as _get


@dataclass
class SamplingConfig:
    """Sampling and batching, for every engine (``actor.engine`` picks the engine)."""

    max_new_tokens: int = 32
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    prompts_per_batch: int = 4  # groups generated together in one batch
    # receive new weights into a staging copy while generating (true), or under the
    # forward lock straight into the weights (false: no second copy, generation pauses;
    # hf only: actor.engine=vllm always stages)
    weight_staging: bool = True
    # with top_p < 1 or top_k > 0: record each token's kept vocabulary ids, so the
    # trainer renormalises over the same support instead of recomputing it (hf only)
    keep_sampling_mask: bool = False
    # mixture-of-experts models (Keep Routing): record the experts every token was routed
    # to at every MoE layer (prompt included) and force them in the trainer's forward
    # (pipeline/routing.py); refused for a dense model and with task.kind=env
    # (validate_keep_routing; +exp=tiny_moe is the tiny MoE run)
    keep_routing: bool = False
    torch_threads: int = 1  # the actor's torch threads


def validate_sampling(cfg: Any) -> None:
    """The ``sampling`` section (what the vllm engine does not do:
    pipeline/config/actor.py's ``validate_vllm``)."""
    check_positive(cfg, "sampling.max_new_tokens", "sampling.prompts_per_batch")
    s = cfg.sampling
    if s.temperature <= 0:
        raise ValueError("sampling.temperature must be > 0 (sampling is required for RL)")
    if not 0 < s.top_p <= 1:
        raise ValueError("sampling.top_p must be in (0, 1]")
    if s.keep_routing:
        validate_keep_routing(cfg)


# model.name values pipeline/models.py builds or fetches that have no experts
DENSE_MODELS = (
    "tiny",
    "tiny-teacher",
    "smollm2-135m-instruct",
    "HuggingFaceTB/SmolLM2-135M-Instruct",
)


def validate_keep_routing(cfg: Any) -> None:
    """sampling.keep_routing: one-turn tasks only, and a MoE model where this can tell
    without loading it (a built-in name, or a local folder's config.json); the engine
    refuses any other dense model when it loads it (pipeline/routing.py's layout_of)."""
    kind = _get(cfg, "task.kind")
    if kind == "env":
        raise ValueError(
            "sampling.keep_routing=true is not supported with task.kind=env (multi-turn "
            "episodes record no routes yet): use a one-turn task (task.kind=arithmetic or "
            "file) or set sampling.keep_routing=false"
        )
    name = str(_get(cfg, "model.name") or "")
    if name in DENSE_MODELS or _dense_folder(name):
        raise ValueError(
            f"sampling.keep_routing=true needs a mixture-of-experts model; model.name={name} "
            "is dense: use a MoE model (model=tiny_moe) or set sampling.keep_routing=false"
        )


def _dense_folder(name: str) -> bool:
    """Whether ``name`` is a local model folder whose config.json names no experts."""
    config = Path(name).expanduser() / "config.json"
    if not name or not config.is_file():
        return False
    try:
        hf = json.loads(config.read_text())
    except (OSError, ValueError):
        return False  # the model loader says what is wrong with it
    text = hf.get("text_config", hf)  # multimodal configs nest the language model's
    return not any(text.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
