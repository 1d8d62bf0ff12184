"""sampling.keep_sampling_mask: the actor records the top-k/top-p support of every
token, and the trainer's log-probs of the same tokens, renormalised over it, agree
with the actor's; plus the per-token advantages the trainer takes from the wire."""

import msgspec
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from actor.engines.hf import HFEngine
from pipeline.config import Config
from pipeline.logprobs import (
    completion_logprobs,
    masked_logprobs,
    pad_sequences,
    takes_logits_to_keep,
)
from pipeline.messages import (
    SCHEMA_VERSION,
    BadEntry,
    Sample,
    TrainBatch,
    decode,
    encode,
    pack_f32,
    pack_i32,
    rle_encode,
    unpack_f32,
)
from pipeline.models import load_model, materialize_model
from trainer.backends.torch_backend import TorchBackend
from trainer.collate import collate
from trainer.ranks import Ranks
from trainer.step import train_step

PROMPTS = ["What is 2 + 3?", "Hi", "A much longer prompt than the others, 12 + 30 = ?"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return materialize_model("tiny", str(tmp_path_factory.mktemp("m")))


def _sample_batch(path, **sampling):
    model, tok = load_model(path)
    engine = HFEngine(model, tok, seed=5, keep_sampling_mask=True, **sampling)
    engine.stop_ids = set()
    prompts = [tok(t)["input_ids"] for t in PROMPTS]
    outs = engine.generate(prompts, max_new_tokens=16)
    samples = [o.to_sample(k, k % 2) for k, o in enumerate(outs)]
    batch = TrainBatch(
        schema=SCHEMA_VERSION,
        batch_id="b",
        group_ids=["g"] * len(samples),
        prompt_ids=[pack_i32(p) for p in prompts],
        samples=samples,
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        top_k=sampling["top_k"],
    )
    return model, decode(encode(batch), TrainBatch)  # as the trainer reads it


def _trainer_logprobs(model, batch, masks):
    prompts = [np.frombuffer(p, "<i4") for p in batch.prompt_ids]
    ids, attn, comp = pad_sequences(prompts, [s.tokens() for s in batch.samples])
    with torch.no_grad():
        lp = completion_logprobs(
            model, ids, attn, comp, batch.temperature, batch.top_p, batch.top_k, masks=masks
        )
    return lp, comp


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.7, top_p=0.8, top_k=20),
        dict(temperature=1.0, top_p=0.5, top_k=0),
        dict(temperature=0.9, top_p=1.0, top_k=5),
    ],
    ids=["top-p-and-top-k", "top-p", "top-k"],
)
def test_trainer_and_actor_logprobs_agree_with_the_mask(tiny, sampling):
    model, batch = _sample_batch(tiny, **sampling)
    masks = [s.sampling_mask() for s in batch.samples]
    vocab = model.config.vocab_size
    for s, kept in zip(batch.samples, masks, strict=True):
        assert kept is not None and len(kept) == len(s.tokens())
        for token, ids in zip(s.tokens(), kept, strict=True):
            assert token in ids and 0 < len(ids) < vocab
            if sampling["top_k"]:
                assert len(ids) <= sampling["top_k"]
    lp, comp = _trainer_logprobs(model, batch, masks)
    for row, s in enumerate(batch.samples):
        torch.testing.assert_close(
            lp[row][comp[row]],
            torch.from_numpy(unpack_f32(s.logprobs).copy()),
            atol=2e-4,
            rtol=1e-4,
        )


def test_mask_renormalises_a_changed_policy_over_the_recorded_support(tiny):
    model, batch = _sample_batch(tiny, temperature=0.7, top_p=0.7, top_k=10)
    with torch.no_grad():  # the trainer's policy has moved since the actor sampled
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    masks = [s.sampling_mask() for s in batch.samples]
    lp, comp = _trainer_logprobs(model, batch, masks)
    prompts = [np.frombuffer(p, "<i4") for p in batch.prompt_ids]
    ids, attn, _ = pad_sequences(prompts, [s.tokens() for s in batch.samples])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1] / batch.temperature
    for row, s in enumerate(batch.samples):
        positions = torch.nonzero(comp[row]).flatten()
        assert torch.isfinite(lp[row][positions]).all()  # every sampled token is in support
        for t, kept, pos in zip(s.tokens(), masks[row], positions.tolist(), strict=True):
            support = torch.from_numpy(kept.astype(np.int64))
            expected = logits[row, pos - 1, t] - torch.logsumexp(logits[row, pos - 1, support], 0)
            torch.testing.assert_close(lp[row, pos], expected, atol=1e-4, rtol=1e-4)


def test_mask_is_off_by_default_and_only_kept_when_truncating(tiny):
    model, tok = load_model(tiny)
    prompt = [tok("Hi")["input_ids"]]
    off = HFEngine(model, tok, 0.7, 0.8, 20).generate(prompt, 4)[0]
    assert off.kept == []
    plain = HFEngine(model, tok, 0.7, 1.0, 0, keep_sampling_mask=True).generate(prompt, 4)[0]
    assert plain.kept == []  # the full vocabulary: nothing worth recording
    sample = Sample(
        index=0,
        completion_ids=pack_i32(plain.tokens),
        logprobs=pack_f32(plain.logprobs),
        versions=rle_encode(plain.versions),
        reward=0.0,
        finished=False,
    )
    assert sample.sampling_mask() is None
    fields = msgspec.msgpack.decode(encode(sample))
    assert "mask_ids" not in fields and "token_advantages" not in fields  # old payload shape


def test_an_inconsistent_mask_is_a_bad_entry():
    sample = Sample(
        index=0,
        completion_ids=pack_i32([5, 6]),
        logprobs=pack_f32([-1.0, -1.0]),
        versions=rle_encode([0, 0]),
        reward=0.0,
        finished=False,
        mask_ids=pack_i32([5, 6, 7]),
        mask_counts=pack_i32([1]),
    )
    with pytest.raises(BadEntry, match="sampling mask"):
        sample.sampling_mask()


def test_trainer_uses_token_advantages_when_present(tiny):
    model, batch = _sample_batch(tiny, temperature=0.7, top_p=0.8, top_k=20)
    first, second = batch.samples[0], batch.samples[1]
    first.advantage, second.advantage = 0.5, -0.5
    n = len(first.tokens())
    first.token_advantages = pack_f32(np.linspace(-1, 1, n))
    prompts = [np.frombuffer(p, "<i4") for p in batch.prompt_ids]
    _, _, comp = pad_sequences(prompts, [s.tokens() for s in batch.samples])
    mb = collate(batch, 0, torch.device("cpu"))
    assert torch.equal(mb.comp, comp)
    adv = mb.advantages
    np.testing.assert_allclose(adv[0][comp[0]].numpy(), np.linspace(-1, 1, n), atol=1e-6)
    assert (adv[1][comp[1]] == -0.5).all()

    cfg = OmegaConf.structured(Config)  # a whole trainer step
    cfg.trainer.lr = 1e-3
    one = Ranks(0, 1, 0, None)
    backend = TorchBackend(cfg, one, tiny, None)
    metrics = train_step(backend, one, [batch], 1, batch, cfg.trainer, 0, mb.tokens)
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3)  # masked: on-policy ratio 1


class _NoSlicing(torch.nn.Module):
    """A causal LM whose forward takes no ``logits_to_keep`` (as a remote-code model)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


@pytest.mark.parametrize("with_masks", [False, True], ids=["recomputed", "recorded-mask"])
def test_the_projection_at_completion_positions_only_changes_no_logprob(tiny, with_masks):
    """completion_logprobs projects onto the vocabulary only from the position before
    the first completion token (logits_to_keep): every log-prob equals the one computed
    from the logits of every position, for prompts of different lengths, with recorded
    masks or recomputed truncation, and for a model that cannot slice."""
    model, batch = _sample_batch(tiny, temperature=0.8, top_p=0.9, top_k=12)
    masks = [s.sampling_mask() for s in batch.samples] if with_masks else None
    prompts = [np.frombuffer(p, "<i4") for p in batch.prompt_ids]
    ids, attn, comp = pad_sequences(prompts, [s.tokens() for s in batch.samples])
    assert len({len(p) for p in prompts}) == len(prompts)  # the first column differs by row
    assert takes_logits_to_keep(model) and not takes_logits_to_keep(_NoSlicing(model))
    with torch.no_grad():
        sliced = completion_logprobs(model, ids, attn, comp, 0.8, 0.9, 12, masks)
        cannot = completion_logprobs(_NoSlicing(model), ids, attn, comp, 0.8, 0.9, 12, masks)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1, :]
        full = masked_logprobs(logits, 0.8, 0.9, 12, masks, comp[:, 1:])
    want = torch.nn.functional.pad(full.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    want = want.masked_fill(~comp, 0.0)
    assert comp.sum() > 0 and torch.isfinite(want[comp]).all()
    torch.testing.assert_close(sliced, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(cannot, want, rtol=0, atol=1e-5)
