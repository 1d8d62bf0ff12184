"""Where each Hugging Face tensor goes in a vLLM model's own parameters.

vLLM fuses some projections and shards others under tensor parallelism::

    HF name                          vLLM parameter (rows along dim 0)
    ...self_attn.{q,k,v}_proj.W  ->  ...self_attn.qkv_proj.W     [q | k | v]
    ...mlp.{gate,up}_proj.W      ->  ...mlp.gate_up_proj.W       [gate | up]
    ...o_proj.W, ...down_proj.W  ->  same name, columns split across TP ranks
    embed_tokens.W, lm_head.W    ->  same name, vocab rows split, padded to 64
    ...mlp.experts.gate_up_proj  ->  ...mlp.experts[.routed_experts].w13_weight
                                     [E, gate | up, hidden] (transformers 5 names)
    ...mlp.experts.down_proj     ->  ...mlp.experts[.routed_experts].w2_weight
    ...mlp.gate.W (the router)   ->  same name

A :class:`Plan` lists, per HF name, the pieces to copy: a slice of the HF
tensor and the region of one vLLM parameter it lands in. It is built once
from the two name -> shape tables and checked both ways: every HF tensor is
used (tied ``lm_head`` and rotary buffers excepted) and every vLLM parameter
is fully covered apart from vocabulary padding rows, so a model the rules do
not fit fails at install with the names involved, never with silently stale
weights. Pure shape arithmetic: no vLLM import, testable on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FUSED = {  # vLLM fused parameter part -> (HF part, position in the fused rows)
    ".qkv_proj.": ((".q_proj.", 0), (".k_proj.", 1), (".v_proj.", 2)),
    ".gate_up_proj.": ((".gate_proj.", 0), (".up_proj.", 1)),
}
ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")  # input dim split across TP ranks
VOCAB = ("embed_tokens.weight", "lm_head.weight")
IGNORED = ("rotary_emb.inv_freq",)
# MoE experts: vLLM's fused expert weights -> transformers 5's fused expert tensors, same
# shape [experts, rows, cols] (the per-expert names of older checkpoints are not mapped:
# trainers publish named_parameters(), which transformers 5 fuses)
EXPERTS = {
    "w13_weight": "gate_up_proj",  # [E, 2 * intermediate, hidden], gate rows first
    "w2_weight": "down_proj",  # [E, hidden, intermediate]
}


def experts_source(vllm_name: str) -> str | None:
    """The HF name of a vLLM fused-expert parameter, or None for any other."""
    head, _, leaf = vllm_name.rpartition(".")
    if leaf not in EXPERTS or ".experts" not in head:
        return None
    head = head.removesuffix(".routed_experts")  # vLLM 0.32's MoERunner wraps RoutedExperts
    return f"{head}.{EXPERTS[leaf]}"


@dataclass(frozen=True)
class Piece:
    """Copy ``hf[src]`` into ``vllm_param[dst_row : dst_row + rows]`` (columns as sliced)."""

    vllm_name: str
    src_dim: int  # the HF dim sliced for this TP rank (0 or 1)
    src_start: int
    src_len: int
    dst_row: int


@dataclass
class Plan:
    pieces: dict[str, list[Piece]]  # HF name -> pieces
    skipped: list[str]  # HF names deliberately not copied (tied lm_head, rotary buffers)

    def scatter(self, hf_name: str, tensor: torch.Tensor, dest: dict[str, torch.Tensor]) -> None:
        """Copy one HF tensor into the vLLM-layout tensors ``dest`` (e.g. staging views)."""
        for p in self.pieces.get(hf_name, ()):
            src = tensor.narrow(p.src_dim, p.src_start, p.src_len)
            rows = src.shape[0]
            dest[p.vllm_name].narrow(0, p.dst_row, rows).copy_(src)


def _shard(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if n % size:
        raise ValueError(
            f"{what}: {n} does not split evenly across tensor_parallel_size={size}; "
            "use a tensor parallel size that divides it"
        )
    part = n // size
    return rank * part, part


def _vocab_shard(rows: int, local_rows: int, rank: int) -> tuple[int, int]:
    """vLLM pads the vocabulary and gives each rank ``local_rows`` consecutive rows."""
    start = rank * local_rows
    return start, max(0, min(rows, start + local_rows) - start)


def _fused_source(vllm_name: str) -> tuple[str, tuple] | None:
    for fused, parts in FUSED.items():
        if fused in vllm_name:
            return fused, parts
    return None


def build_plan(
    vllm_shapes: dict[str, tuple[int, ...]],
    hf_shapes: dict[str, tuple[int, ...]],
    tp_rank: int = 0,
    tp_size: int = 1,
) -> Plan:
    """The pieces that put every HF tensor into this TP rank's vLLM parameters."""
    pieces: dict[str, list[Piece]] = {}
    covered: dict[str, int] = {}
    for vname, vshape in vllm_shapes.items():
        fused = _fused_source(vname)
        if fused:
            row = 0
            for hf_part, _pos in fused[1]:
                hname = vname.replace(fused[0], hf_part)
                if hname not in hf_shapes:
                    raise ValueError(
                        f"vLLM parameter {vname} needs {hname}, which the trainer lacks"
                    )
                start, n = _shard(hf_shapes[hname][0], tp_rank, tp_size, hname)
                pieces.setdefault(hname, []).append(Piece(vname, 0, start, n, row))
                row += n
            covered[vname] = row
        elif (hname := experts_source(vname)) is not None:
            if tp_size > 1:
                raise ValueError(
                    f"vLLM parameter {vname}: mixture-of-experts weights under "
                    f"tensor_parallel_size={tp_size} are not mapped; use "
                    "actor.vllm.tensor_parallel_size=1 for a MoE model"
                )
            if hname not in hf_shapes:
                raise ValueError(f"vLLM parameter {vname} needs {hname}, which the trainer lacks")
            if tuple(hf_shapes[hname]) != tuple(vshape):
                raise ValueError(
                    f"vLLM parameter {vname} {tuple(vshape)} and the trainer's {hname} "
                    f"{tuple(hf_shapes[hname])} differ; is it the same model config?"
                )
            pieces.setdefault(hname, []).append(Piece(vname, 0, 0, vshape[0], 0))
            covered[vname] = vshape[0]
        elif vname.endswith(VOCAB):
            hname = _hf_vocab_name(vname, hf_shapes)
            start, n = _vocab_shard(hf_shapes[hname][0], vshape[0], tp_rank)
            pieces.setdefault(hname, []).append(Piece(vname, 0, start, n, 0))
            covered[vname] = vshape[0]  # padding rows past the vocabulary stay as installed
        elif vname in hf_shapes:
            hshape = hf_shapes[vname]
            dim = 1 if vname.endswith(ROW_PARALLEL) and tp_size > 1 else 0
            if len(hshape) == 1 or (dim == 0 and tp_size > 1 and hshape == tuple(vshape)):
                start, n = 0, hshape[0]  # replicated (norms) or unsplit
                dim = 0
            else:
                start, n = _shard(hshape[dim], tp_rank, tp_size, vname)
            pieces.setdefault(vname, []).append(Piece(vname, dim, start, n, 0))
            covered[vname] = n if dim == 0 else vshape[0]
        else:
            raise ValueError(
                f"vLLM parameter {vname} has no source among the trainer's tensors; "
                "this model family is not mapped (actor/engines/vllm/worker/layout.py "
                "FUSED/ROW_PARALLEL)"
            )
        _check_rows(vname, vshape, covered[vname], pieces, hf_shapes)
    skipped = [h for h in hf_shapes if h not in pieces]
    unexplained = [h for h in skipped if not _may_skip(h, vllm_shapes)]
    if unexplained:
        raise ValueError(
            f"trainer tensors with no place in the vLLM model: {unexplained[:5]}"
            f"{' ...' if len(unexplained) > 5 else ''}; is it the same architecture?"
        )
    return Plan(pieces, skipped)


def _hf_vocab_name(vname: str, hf_shapes: dict) -> str:
    if vname in hf_shapes:
        return vname
    tied = "model.embed_tokens.weight"  # vLLM keeps an untied lm_head for a tied HF model
    if vname.endswith("lm_head.weight") and tied in hf_shapes:
        return tied
    raise ValueError(f"vLLM parameter {vname} has no source among the trainer's tensors")


def _may_skip(hf_name: str, vllm_shapes: dict) -> bool:
    if any(s in hf_name for s in IGNORED):
        return True
    return hf_name.endswith("lm_head.weight") and not any(
        v.endswith("lm_head.weight") for v in vllm_shapes
    )  # tied: vLLM reads the embedding


def _check_rows(vname, vshape, rows, pieces, hf_shapes) -> None:
    if rows > vshape[0]:
        raise ValueError(
            f"vLLM parameter {vname} has {vshape[0]} rows but its sources give {rows}; "
            "the trainer's model config differs from the engine's"
        )
    fused = _fused_source(vname)
    if fused is None and not vname.endswith(VOCAB) and rows != vshape[0]:
        raise ValueError(f"vLLM parameter {vname} {tuple(vshape)}: sources cover {rows} rows")
    if fused is not None and rows != vshape[0]:
        raise ValueError(
            f"vLLM parameter {vname} has {vshape[0]} rows, its parts {rows}: "
            "grouped-query heads replicated across TP ranks are not mapped"
        )
