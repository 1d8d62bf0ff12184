"""``sampling`` (the ``sampling`` config group, conf/sampling/): how the actor samples
and batches, for every engine. ``actor.engine`` picks the engine (hf | vllm) and
``actor.vllm`` holds the vLLM engine's own settings (pipeline/config/actor.py). This
section was called ``engine`` before; pipeline/config/load.py refuses that name with
the new key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.config.checks import check_positive


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
    # (pipeline/routing.py); refused for a dense model
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
