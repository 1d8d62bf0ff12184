"""LoRA adapters in the vLLM engine (``model.lora`` with ``actor.engine=vllm``).

The vLLM engine (actor/engines/vllm.py) calls, when ``model.lora`` is set:

- :func:`engine_kwargs` for ``vllm.LLM(..., **engine_kwargs(lora))``: LoRA on, one
  adapter slot, ``max_lora_rank`` the smallest rank vLLM 0.24 allows that holds ours;
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
ones, then staged and swapped here (actor/vllm_worker.py). On the CPU everything runs
against fakes of vLLM's LoRA managers and LoRARequest (tests/test_vllm_lora.py); against
real vLLM 0.24 only the ``gpu``-marked tests, written and not yet run.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any

import torch

from pipeline import lora as lora_lib
from pipeline.messages import BucketSpec

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
ADAPTER_NAME = "nonstop"
ADAPTER_ID = 1  # one adapter for the whole run, rewritten in place at each version


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM 0.24 accepts that holds ``rank``."""
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


def adapter_tensors_from_buckets(
    layout: list[BucketSpec], buckets: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Split received flat buckets into the adapter's named tensors (peft names)."""
    out = {}
    for spec, flat in zip(layout, buckets, strict=True):
        for p in spec.params:
            n = math.prod(p.shape)
            out[p.name] = flat[p.offset : p.offset + n].view(p.shape)
    return out


class AdapterSwap:
    """Engine-core side: stage a received adapter on the CPU, swap it in under the lock.

    ``worker``: vLLM's GPU Worker (its ``model_runner.lora_manager`` is the
    WorkerLoRAManager); ``adapter_config``: the initial folder's adapter_config.json
    (rank, alpha, target modules), reused for every version; ``request_cls``: vLLM's
    LoRARequest unless given.
    """

    def __init__(self, worker: Any, adapter_dir: str, request_cls=None):
        if request_cls is None:
            from vllm.lora.request import LoRARequest as request_cls
        self.request_cls = request_cls
        self.manager = worker.model_runner.lora_manager
        with open(os.path.join(adapter_dir, lora_lib.ADAPTER_CONFIG)) as f:
            self.adapter_config = json.load(f)
        self._staged: tuple[int, Any] | None = None
        self._live: Any = None  # the LoRAModel we put in the slot last

    def stage(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Build the vLLM LoRAModel of ``tensors`` (CPU, vLLM's own loader and checks)."""
        from safetensors.torch import save_file

        self._staged = None
        with tempfile.TemporaryDirectory(prefix="nonstop-lora-") as tmp:
            save_file(
                {n: t.detach().cpu().contiguous() for n, t in tensors.items()},
                os.path.join(tmp, lora_lib.ADAPTER_WEIGHTS),
            )
            with open(os.path.join(tmp, lora_lib.ADAPTER_CONFIG), "w") as f:
                json.dump(self.adapter_config, f)
            request = self.request_cls(ADAPTER_NAME, ADAPTER_ID, tmp)
            model = self.manager._load_adapter(request)
        self._staged = (version, model)

    def swap(self, version: int) -> None:
        """Caller holds the per-forward lock: rewrite the adapter's GPU slot in place.
        If vLLM fails half-way, the previous adapter is put back into the slot (the
        version is not applied; it stays staged for a retry); if even that fails,
        :class:`AdapterLost` (the slot's content is unknown: the engine must stop)."""
        if self._staged is None or self._staged[0] != version:
            raise RuntimeError(f"adapter version {version} is not staged; stage() it first")
        model = self._staged[1]
        manager = self.manager._adapter_manager  # LoRAModelManager (LRU variant)
        previous = manager.get_adapter(ADAPTER_ID) or self._live
        try:
            _install(manager, model)
        except Exception as e:
            try:
                if previous is None:  # never loaded: the requests' folder is version 0
                    manager.remove_adapter(ADAPTER_ID)
                else:
                    _install(manager, previous)
            except Exception as again:
                raise AdapterLost(
                    f"adapter version {version} failed in vLLM ({e}) and putting the previous "
                    f"adapter back failed too ({again}); the LoRA slot holds neither"
                ) from again
            raise RuntimeError(
                f"adapter version {version} failed in vLLM ({e}); the previous adapter was "
                "put back and generation goes on with it"
            ) from e
        self._staged, self._live = None, model


class AdapterLost(RuntimeError):
    """The LoRA slot holds neither the old nor the new adapter: nothing may generate."""


def _install(manager: Any, model: Any) -> None:
    manager.remove_adapter(ADAPTER_ID)  # frees the slot, forgets the old weights
    manager.add_adapter(model)  # registers (merges q/k/v into packed modules)
    manager.activate_adapter(ADAPTER_ID)  # set_lora: copies into the same slot
