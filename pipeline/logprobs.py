"""Log-probs that mean the same thing in the actor, preprocessor and trainer:
the distribution sampled from (temperature, then top-k, then top-p).

With ``sampling.keep_sampling_mask`` the actor records, per token, the vocabulary
ids top-k/top-p kept; :func:`completion_logprobs` then renormalises over that
recorded support instead of recomputing the truncation from its own logits.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch


def sampling_logprobs(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Log-softmax of the transformed logits; truncated entries get -inf."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs >= top_p  # the top token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def support_from_masks(
    masks: list, predicts: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, positions, vocab] bool support (True: allowed) and [batch] rows that have one.

    ``masks[row]`` is None or a list with one array of kept ids per completion token;
    ``predicts`` [batch, positions] marks the logit positions that predict completion
    tokens, in order: each gets its token's recorded support.
    """
    support = torch.ones((*predicts.shape, vocab), dtype=torch.bool)
    has = torch.tensor([m is not None for m in masks], dtype=torch.bool)
    for row, kept in enumerate(masks):
        if kept is None:
            continue
        positions = torch.nonzero(predicts[row]).flatten()
        assert len(positions) == len(kept), "one kept-id array per completion token"
        counts = torch.tensor([len(k) for k in kept])
        ids = torch.from_numpy(np.concatenate(kept).astype(np.int64))
        support[row, positions] = False
        support[row, positions.repeat_interleave(counts), ids] = True
    return support, has


def masked_logprobs(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    masks: list | None,
    predicts: torch.Tensor,
) -> torch.Tensor:
    """:func:`sampling_logprobs`, except that rows with a recorded sampling mask are
    renormalised over it (``predicts``: see :func:`support_from_masks`)."""
    if masks is None or all(m is None for m in masks):
        return sampling_logprobs(logits, temperature, top_p, top_k)
    support, has = support_from_masks(masks, predicts, logits.shape[-1])
    scaled = (logits.float() / temperature).masked_fill(~support, float("-inf"))
    logp = torch.log_softmax(scaled, dim=-1)
    if not has.all():
        recomputed = sampling_logprobs(logits, temperature, top_p, top_k)
        logp = torch.where(has[:, None, None], logp, recomputed)
    return logp


def pad_sequences(prompts: list[np.ndarray], completions: list[np.ndarray], pad_id: int = 0):
    """Right-padded prompt+completion ids, attention mask and completion mask."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(lengths), width), dtype=torch.long)
    comp = torch.zeros((len(lengths), width), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, : lengths[i]] = torch.from_numpy(np.concatenate([p, c]).astype(np.int64))
        attn[i, : lengths[i]] = 1
        comp[i, len(p) : lengths[i]] = True
    return ids, attn, comp


def completion_logprobs(
    model,
    ids: torch.Tensor,
    attn: torch.Tensor,
    comp: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    masks: list | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[batch, width] log-probs of each token given its prefix; 0 outside completions.

    Position t holds log p(ids[t] | ids[:t]); differentiable when grad is enabled.
    ``masks`` (one entry per row, None or per-token kept ids): rows with a recorded
    sampling mask are renormalised over it, the others truncated by top-k/top-p.
    ``autocast_dtype``: the model's forward (only) under autocast to that dtype.

    The vocabulary projection and the log-softmax run only from the position before
    the batch's first completion token (``logits_to_keep``): prompt positions predict
    nothing that is scored, and at SmolLM2's 49k vocabulary they were most of the
    trainer's forward and backward for a 32-token completion after a 60-token prompt.
    """
    first = first_completion_column(comp)
    keep = ids.shape[1] - first + 1  # positions first-1 .. width-1
    # a model whose forward cannot slice: the projection at every position, sliced after
    kwargs = {"logits_to_keep": keep} if takes_logits_to_keep(model) else {}
    on = autocast_dtype is not None
    with torch.autocast(ids.device.type, dtype=autocast_dtype, enabled=on):
        logits = model(input_ids=ids, attention_mask=attn, **kwargs).logits
    logits = logits[:, -keep:-1, :]  # position first-1+j predicts ids[:, first+j]
    logp = masked_logprobs(logits, temperature, top_p, top_k, masks, comp[:, first:])
    token_lp = logp.gather(-1, ids[:, first:, None]).squeeze(-1)
    return torch.nn.functional.pad(token_lp, (first, 0)).masked_fill(~comp, 0.0)


def first_completion_column(comp: torch.Tensor) -> int:
    """The first column holding a completion token in any row (at least 1: column 0
    has no prefix to predict it from); 1 where no row has one."""
    cols = torch.nonzero(comp.any(dim=0))
    return max(int(cols[0]), 1) if len(cols) else 1


def takes_logits_to_keep(model) -> bool:
    """Whether the causal LM under ``model`` (a DeepSpeed engine's ``module``, a peft
    model's base) takes ``logits_to_keep`` (every transformers causal LM of the
    families we map does; a remote-code model may not)."""
    return "logits_to_keep" in inspect.signature(type(inner_model(model)).forward).parameters


def inner_model(model):
    """The transformers model under a DeepSpeed engine (``module``) or a peft model."""
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner
