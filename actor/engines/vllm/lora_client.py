"""LoRA adapters in the vLLM engine (``model.lora`` with ``actor.engine=vllm``).

The vLLM engine (actor/engines/vllm/client.py) calls, when ``model.lora`` is set:

- :func:`engine_kwargs` for ``vllm.LLM(..., **engine_kwargs(lora))``: LoRA on, one
  adapter slot, ``max_lora_rank`` the smallest rank vLLM allows that holds ours;
- :func:`initial_adapter` once at start: writes the version-0 adapter (the same seeded
  init as the trainer's, pipeline/lora.py) as a peft folder and returns the
  ``LoRARequest`` every generate call carries (one name, one int id, for the run);
- in the engine-core process (the worker extension, ``self`` = vLLM's Worker),
  :class:`AdapterSwap`: ``stage`` turns a received version (the announcement's
  buckets, peft names) into a vLLM ``LoRAModel`` on the CPU while the engine keeps
  generating; ``swap`` runs under the per-forward-pass lock and rewrites the adapter's
  GPU slot in place (``remove_adapter`` + ``add_adapter`` + ``activate_adapter`` on the
  LoRA model manager: ``set_lora`` copies into the preallocated stacked LoRA tensors,
  so pointers, and CUDA graphs, stay valid). If vLLM fails half-way through that, the
  previous adapter (the LoRAModel the manager held) is put back and the version stays
  staged for a retry; without that the next step would reload version 0 from the
  requests' folder while the stamps said otherwise. If putting it back fails too
  (``AdapterLost``), every later step raises: vLLM's engine dies with that message and
  the actor is restarted with a fresh engine, rather than generating from an unknown
  adapter.

What a sequence in flight sees at an adapter swap: every request carries the same
``lora_int_id``, and the swap rewrites that id's slot between two forward passes (the
lock spans ``execute_model`` to ``sample_tokens``). So a running sequence continues on
the new adapter from its next step on; the KV cache of its earlier tokens, computed
with the old adapter, is kept (exactly as with full weights). Its tokens are stamped
with the version of the step that sampled them (the worker's per-step versions), so a
sequence can span versions, and the trainer's importance weights correct for it.
vLLM's own ``LoRARequest(load_inplace=True)`` is not used: it reloads when a request
is scheduled, which the per-forward lock does not order.

Wiring: the engine passes ``{"dir", "request"}`` to the worker's ``nonstop_install``,
which builds the AdapterSwap; ``kind="lora"`` versions are received and checked like full
ones, then staged and swapped in worker/adapter_swap.py (worker/extension.py). Tested against
fakes of vLLM's LoRA managers and LoRARequest (tests/test_vllm_lora.py), on real vLLM
0.32's CPU build (tests/test_vllm_lora_real.py), and on vLLM 0.24 on a GPU by the
``gpu``-marked tests (written and not yet run).
"""

from __future__ import annotations

from typing import Any

import torch

from actor.engines.vllm.worker.adapter_swap import ADAPTER_ID, ADAPTER_NAME
from pipeline import lora as lora_lib

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks (0.24, 0.32)


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for allowed in VLLM_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(
        f"model.lora.rank={rank} is above vLLM's largest max_lora_rank {VLLM_RANKS[-1]}; "
        "use a smaller rank with actor.engine=vllm"
    )


def engine_kwargs(lora: Any) -> dict:
    """Keyword arguments for ``vllm.LLM`` when ``model.lora`` is set (else ``{}``)."""
    if lora_lib.settings(lora) is None:
        return {}
    return {
        "enable_lora": True,
        "max_loras": 1,  # one slot: every request uses the run's adapter
        "max_cpu_loras": 2,  # the live adapter and the one being staged
        "max_lora_rank": max_lora_rank(int(lora.rank)),
    }


def initial_adapter(model_path: str, lora: Any, seed: int, folder: str, request_cls=None):
    """Write the version-0 adapter of the base model at ``model_path`` into ``folder``
    (built on a CPU copy); return the ``LoRARequest`` every generate call carries.
    ``request_cls``: vLLM's LoRARequest unless given (imported only then)."""
    write_initial_adapter(model_path, lora, seed, folder)
    if request_cls is None:
        from vllm.lora.request import LoRARequest as request_cls
    return request_cls(ADAPTER_NAME, ADAPTER_ID, folder)


def write_initial_adapter(model_path: str, lora: Any, seed: int, folder: str) -> str:
    """The trainer's version-0 adapter (same seed) as a peft folder vLLM can load."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    wrapped = lora_lib.apply_lora(base, lora, seed)
    wrapped.save_pretrained(folder, safe_serialization=True)
    return folder
