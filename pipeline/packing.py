"""A micro-batch as one row per distinct prompt: the prompt once, then its completions.

::

    row A   prompt A | A's completion 1 | A's completion 2 | ... | (pad to the longest row)
    row B   prompt B | B's completion 1 | ...
    mask    a completion token sees its prompt and its own earlier tokens; a prompt token
            its prompt's earlier tokens; nothing across completions (a pad sees itself)
    ids     each completion's positions continue its prompt's (position ids 0, 1, ...)

A group's G completions share one prompt: in the padded layout the prompt goes through
forward and backward G times and every row is padded to the longest. Packed, the prompt
is computed once (its keys and values serve every completion under the mask, and the
backward sums their gradients into it, as the padded layout's G copies did), and the
only padding left is between whole groups (the preprocessor packs groups of similar
length together). One row per prompt rather than one row for the whole micro-batch:
attention costs the square of a row's length, and a single row would spend it on pairs
the mask forbids. The log-probs are the padded layout's up to floating-point summation
order (tests/test_packing.py); the vocabulary projection runs only at the positions that
predict a scored token.

Needs an attention that takes a custom [rows, 1, L, L] mask: transformers' ``sdpa`` (a
bool mask) or ``eager`` (an additive one); :func:`packs` says whether a model has one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.logprobs import inner_model, masked_logprobs, takes_logits_to_keep

MASKED_ATTENTION = ("sdpa", "eager")


@dataclass
class Packed:
    ids: torch.Tensor  # [prompts, L] long, right-padded
    positions: torch.Tensor  # [prompts, L] long, each sequence's own position ids
    allowed: torch.Tensor  # [prompts, 1, L, L] bool, True where query (row) may see key
    keep: torch.Tensor  # [prompts, L] bool: the positions whose logits are needed
    predict: torch.Tensor  # [N] long: for scored token n, its predicting position's index
    #                        among keep's True positions (row-major)
    targets: torch.Tensor  # [N] long: the scored tokens, rows in order, left to right
    rows: torch.Tensor  # [N] long: each scored token's row in the padded layout
    cols: torch.Tensor  # [N] long: its column there


def pack(
    prompts: list[np.ndarray], completions: list[np.ndarray], comp: np.ndarray, device
) -> Packed | None:
    """The packed layout of rows of prompt + completion; ``comp`` [rows, width] is the
    padded layout's loss mask (prompt then completion per row, left-aligned). Rows whose
    prompts are equal share one packed row. None where a prompt is empty (its completion's
    first token has no prefix to be predicted from)."""
    if any(len(p) == 0 for p in prompts):
        return None
    packed: dict[bytes, list] = {}  # prompt bytes -> [(ids, branch) pieces]
    where, targets, rows, cols = [], [], [], []  # where: (packed row, position)
    for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        key = np.asarray(p, dtype=np.int64).tobytes()
        pieces = packed.setdefault(key, [(np.asarray(p), -1)])
        at = sum(len(x) for x, _ in pieces)
        row = list(packed).index(key)
        # completion token j is predicted from the token before it: the prompt's last for
        # j = 0, else completion token j - 1
        before = np.concatenate([[len(p) - 1], at + np.arange(len(c) - 1)])
        scored = np.nonzero(comp[r, len(p) : len(p) + len(c)])[0]
        where += [(row, int(q)) for q in before[scored]]
        targets += [np.asarray(c)[scored]]
        rows += [np.full(len(scored), r)]
        cols += [len(p) + scored]
        pieces.append((np.asarray(c), r))
    width = max(sum(len(x) for x, _ in pieces) for pieces in packed.values())
    n = len(packed)
    ids = np.zeros((n, width), dtype=np.int64)
    positions = np.zeros((n, width), dtype=np.int64)
    branch = np.full((n, width), -2)  # -2 padding, -1 prompt, r row r's completion
    for i, pieces in enumerate(packed.values()):
        at, prompt = 0, len(pieces[0][0])
        for x, b in pieces:
            ids[i, at : at + len(x)] = x
            positions[i, at : at + len(x)] = np.arange(len(x)) + (prompt if b >= 0 else 0)
            branch[i, at : at + len(x)] = b
            at += len(x)
    q, k = branch[:, :, None], branch[:, None, :]
    causal = np.tril(np.ones((width, width), dtype=bool))
    allowed = causal & (k != -2) & ((k == -1) | (k == q))
    # a pad sees itself: a query that may see no key is NaN in some attention kernels
    allowed |= np.eye(width, dtype=bool) & (q == -2)
    keep = np.zeros((n, width), dtype=bool)
    flat = np.array([r * width + c for r, c in where], dtype=np.int64)
    keep.flat[flat] = True
    kept = np.flatnonzero(keep)  # row-major, as hidden_states[keep] orders them

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    return Packed(
        ids=put(ids),
        positions=put(positions),
        allowed=put(allowed[:, None]),
        keep=put(keep),
        predict=put(np.searchsorted(kept, flat)),
        targets=put(np.concatenate(targets).astype(np.int64)),
        rows=put(np.concatenate(rows).astype(np.int64)),
        cols=put(np.concatenate(cols).astype(np.int64)),
    )


def packs(model) -> bool:
    """Whether ``model`` (a DeepSpeed engine's module, a peft model's base) runs an
    attention that takes the packed layout's custom mask."""
    config = getattr(inner_model(model), "config", None)
    return getattr(config, "_attn_implementation", None) in MASKED_ATTENTION


def packed_logprobs(
    model,
    packed: Packed,
    shape: tuple[int, int],
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    masks: list | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`pipeline.logprobs.completion_logprobs` of the padded layout ``shape`` [rows,
    width] (0 outside the scored tokens), computed on the packed one: one forward of the
    packed rows, the vocabulary projection at the positions that predict a scored token.
    ``masks``: one entry per row, None or per scored token the kept ids."""
    inner = inner_model(model)
    mask = packed.allowed
    if inner.config._attn_implementation == "eager":  # eager adds the mask to the scores
        dtype = autocast_dtype or next(inner.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    # a model whose forward cannot slice: the projection at every position, selected after
    kwargs = {"logits_to_keep": packed.keep} if takes_logits_to_keep(model) else {}
    on = autocast_dtype is not None
    with torch.autocast(packed.ids.device.type, dtype=autocast_dtype, enabled=on):
        logits = model(
            input_ids=packed.ids, position_ids=packed.positions, attention_mask=mask, **kwargs
        ).logits
    # [kept positions, vocab]: transformers flattens a bool logits_to_keep row-major
    logits = logits.reshape(-1, logits.shape[-1]) if kwargs else logits[packed.keep]
    predict = packed.predict
    per_token = None
    if masks is not None:  # one row per scored token, each with its own recorded support
        logits, predict = logits[predict], torch.arange(len(predict), device=logits.device)
        per_token = _per_token_masks(masks, packed.rows)
    one = torch.ones((len(logits), 1), dtype=torch.bool, device=logits.device)
    logp = masked_logprobs(logits[:, None, :], temperature, top_p, top_k, per_token, one)
    token_lp = logp[:, 0, :][predict, packed.targets]
    out = torch.zeros(shape, dtype=token_lp.dtype, device=token_lp.device)
    return out.index_put((packed.rows, packed.cols), token_lp)


def _per_token_masks(masks: list, rows: torch.Tensor) -> list:
    """Row masks (None or one kept-id array per scored token, in order) as one entry per
    scored token (``rows``: each one's row, rows in order)."""
    nth: dict[int, int] = {}
    out = []
    for r in rows.tolist():
        j = nth[r] = nth.get(r, -1) + 1
        out.append(None if masks[r] is None else [masks[r][j]])
    return out
