"""LoRA adapters in the vLLM engine-core process (``model.lora`` with ``actor.engine=vllm``):
:class:`AdapterSwap` stages a received version as a vLLM ``LoRAModel`` while the engine
generates and swaps it into the adapter's slot under the per-forward-pass lock. The
client side (engine arguments, the version-0 adapter) is actor/engines/vllm/lora_client.py;
the whole story is in that module's docstring.
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

ADAPTER_NAME = "nonstop"
ADAPTER_ID = 1  # one adapter for the whole run, rewritten in place at each version


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
        """Build the vLLM LoRAModel of ``tensors`` (CPU, vLLM's own loader and checks)
        and merge its packed modules, all outside the lock."""
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
        # vLLM's add_adapter merges q/k/v (gate/up) into its packed modules and pins the
        # tensors (on CUDA); done here, outside the lock, that work leaves add_adapter
        # under the lock nothing to merge (a merged model is merged again as is)
        self.manager._adapter_manager._create_merged_loras_inplace(model)
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
