"""The objective (README "The objective"): nothing non-finite reaches a weight, the
loss family against hand-computed values and gradients, metrics that mean what they
say, and settings that refuse nonsense."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipeline.config import Config, validate
from pipeline.messages import BadEntry, decode, encode, pack_f32
from pipeline.streams import publish
from pipeline.telemetry import read_jsonl
from preprocessor.shaping import group_advantages
from tests.trainer_builders import batch, run_step, sample
from trainer.backends.torch_backend import TorchBackend
from trainer.collate import collate
from trainer.loss import policy_loss
from trainer.ranks import Ranks
from trainer.step import (
    StepTotals,
    aggregation_weights,
    constant_divisor,
    token_logprobs,
    train_step,
)

CLIP = dict(clip_low=0.2, clip_high=0.28, is_cap=2.0)


def one(new, actor, adv, ref=None, **kw):
    """policy_loss on one row of tokens; returns (parts, d loss / d new)."""
    new = torch.tensor([new], dtype=torch.float32, requires_grad=True)
    mask = torch.ones_like(new, dtype=torch.bool)
    args = dict(CLIP) | kw
    ref_t = None if ref is None else torch.tensor([ref], dtype=torch.float32)
    parts = policy_loss(new, torch.tensor([actor]), torch.tensor([adv]), mask, ref_lp=ref_t, **args)
    parts.loss.backward()
    return parts, new.grad[0]


# ---------------------------------------------------------------- non-finite paths


@pytest.mark.parametrize("adv", [1.0, -1.0], ids=["A>0 clipped", "A<0 dual clip"])
def test_a_ratio_past_exp_overflow_gives_a_finite_loss_and_no_gradient(adv):
    # log-ratio 100: exp overflows to inf, and the clipped branch's backward was 0 * inf = NaN
    parts, grad = one([100.0], [0.0], [adv])
    assert torch.isfinite(grad).all() and grad.abs().sum() == 0
    expected = -1.28 if adv > 0 else 2.0  # (1 + clip_high) A, or the dual clip is_cap * |A|
    assert float(parts.loss.detach()) == pytest.approx(expected)
    assert parts.bad_rows == []


def test_a_trainer_logprob_of_minus_inf_with_kl_on_is_finite():
    # the trainer's recomputed top-p/top-k left the token out: new = -inf; k3 was inf - inf
    parts, grad = one([-math.inf], [-1.0], [1.0], ref=[-1.0], kl_coef=0.1)
    assert torch.isfinite(parts.loss) and torch.isfinite(grad).all() and grad.abs().sum() == 0
    assert float(parts.loss) == pytest.approx(0.1 * 10.0, abs=1e-6)  # k3 capped at 10
    assert parts.kl_sum == pytest.approx(10.0)


def test_a_reference_logprob_of_minus_inf_is_finite():
    parts, grad = one([-1.0], [-1.0], [0.0], ref=[-math.inf], kl_coef=0.1)
    assert torch.isfinite(parts.loss) and torch.isfinite(grad).all()
    assert parts.kl_sum == pytest.approx(10.0)  # e^-20 + 20 - 1, capped at 10


def test_a_step_on_a_token_outside_the_trainers_top_k_keeps_the_weights_finite(tiny):
    """The whole path on the tiny model: the actor sampled among the top 50, the trainer
    recomputes top_k=1 (a newer policy's support), KL on. The weights stay finite."""
    cfg = OmegaConf.structured(Config)
    cfg.trainer.lr, cfg.trainer.kl_coef = 1e-2, 0.5
    ranks = Ranks(0, 1, 0, None)
    backend = TorchBackend(cfg, ranks, tiny, None)
    rng = np.random.default_rng(0)
    b = batch("g", [sample(0, 8, 0, 1.0, rng), sample(1, 8, 0, -1.0, rng)], rng)
    b.top_k = 1
    for s in b.samples:
        s.ref_logprobs = pack_f32(-rng.uniform(3, 5, 8))
    mb = collate(b, 0, torch.device("cpu"))
    with torch.no_grad():
        lp = token_logprobs(backend.model, mb, None)
    assert torch.isinf(lp[mb.comp]).any()  # the path is really taken
    m = train_step(backend, ranks, [b], 1, b, cfg.trainer, 0, mb.tokens)
    assert m["applied"] and math.isfinite(m["loss"]) and math.isfinite(m["kl"])
    assert all(torch.isfinite(p).all() for p in backend.model.parameters())


def nan_logits(model):
    """A forward hook that makes every logit NaN (a poisoned model or a kernel fault)."""

    def hook(_module, _inputs, out):
        out.logits = out.logits * float("nan")
        return out

    return model.register_forward_hook(hook)


@pytest.mark.timeout(120)
def test_a_non_finite_step_is_not_applied_and_its_samples_are_dead_lettered(make_trainer, rclient):
    trainer = make_trainer(samples_per_step=2)
    names, rng = trainer.pool.names, np.random.default_rng(5)
    before = {n: p.detach().clone() for n, p in trainer.backend.model.named_parameters()}
    handle = nan_logits(trainer.backend.model)
    publish(rclient, names.batches, encode(batch("bad", [sample(0, 5, 0, 1.0, rng)], rng)))
    publish(rclient, names.batches, encode(batch("b2", [sample(0, 5, 0, -1.0, rng)], rng)))
    m = run_step(trainer)
    handle.remove()
    assert trainer.state["version"] == 0 and trainer.state["nonfinite_steps"] == 1
    for n, p in trainer.backend.model.named_parameters():
        assert torch.equal(p, before[n]), n  # weights unchanged
    assert not trainer.backend.optimizer.state  # no moment was written
    assert sorted(m["nonfinite_sample_ids"]) == ["b2/0", "bad/0"]
    dead = rclient.xrange(names.dead)
    assert len(dead) == 2 and all(b"non-finite step at version 0" in d[1][b"reason"] for d in dead)
    assert {decode(d[1][b"data"], type(batch("x", [], rng))).group_ids[0] for d in dead} == {
        "bad",
        "b2",
    }
    records = read_jsonl(f"{trainer.pool.cfg.run_dir}/metrics.jsonl")
    [rec] = [r for r in records if r.get("event") == "nonfinite_step"]
    assert sorted(rec["dead_ids"]) == ["b2/0", "bad/0"] and rec["version"] == 0
    assert not [r for r in records if r.get("event") == "step"]
    assert rclient.hget(trainer.pool.status.key, "nonfinite_steps") == b"1"
    assert int(rclient.get(names.key("samples_retired"))) == 2  # left the pipeline once
    assert rclient.xpending(names.batches, "trainer")["pending"] == 0
    # the next step, with a healthy model, trains and publishes version 1
    ok = batch("ok", [sample(0, 5, 0, 1.0, rng), sample(1, 5, 0, -1.0, rng)], rng)
    publish(rclient, names.batches, encode(ok))
    assert run_step(trainer)["version"] == 1


@pytest.mark.parametrize(
    "field,value",
    [("logprobs", -math.inf), ("ref_logprobs", math.nan), ("token_advantages", math.inf)],
)
def test_a_sample_with_a_non_finite_value_is_refused(field, value):
    s = sample(0, 4, 0, 1.0, np.random.default_rng(0))
    values = [-1.0, -2.0, value, -1.0]
    setattr(s, field, pack_f32(values))
    with pytest.raises(BadEntry, match=f"non-finite {field} value .* at token 2"):
        s.check("sample g/0")
    s = sample(0, 4, 0, 1.0, np.random.default_rng(0))
    s.advantage = math.nan
    with pytest.raises(BadEntry, match="non-finite advantage"):
        s.check("sample g/0")


# ---------------------------------------------------------------- true metrics


def test_clip_frac_counts_the_clips_that_remove_the_gradient():
    up, down = math.log(1.5), math.log(0.5)
    # ratio 1.5 with A>0 and ratio 0.5 with A<0 bind; the other two are outside the range
    # but keep their gradient
    parts, grad = one([up, up, down, down], [0.0] * 4, [1.0, -1.0, -1.0, 1.0])
    assert parts.clipped == 2 and parts.ratio_out == 4
    assert grad[0] == 0 and grad[2] == 0 and grad[1] != 0 and grad[3] != 0


def test_kl_is_measured_with_kl_coef_zero_and_leaves_the_gradient_alone():
    with_ref, g1 = one([0.0], [0.0], [1.0], ref=[math.log(2.0)], kl_coef=0.0)
    without, g2 = one([0.0], [0.0], [1.0])
    assert with_ref.kl_sum == pytest.approx(2 - math.log(2) - 1, abs=1e-6)
    assert torch.equal(g1, g2) and float(with_ref.loss) == float(without.loss)


# ---------------------------------------------------------------- the family, by hand


def test_advantage_std_group_and_none():
    np.testing.assert_allclose(group_advantages([1, 0, 0, 1]), [1, -1, -1, 1], atol=1e-5)
    np.testing.assert_allclose(group_advantages([1, 0, 0, 1], std="none"), [0.5, -0.5, -0.5, 0.5])
    np.testing.assert_allclose(group_advantages([3, 1], std="none"), [1, -1])


@pytest.mark.parametrize(
    "how,expected",
    [
        ("token_mean", [[0.25, 0, 0], [0.25, 0.25, 0.25]]),
        ("seq_mean_token_mean", [[0.5, 0, 0], [1 / 6, 1 / 6, 1 / 6]]),
        ("constant", [[1 / 8, 0, 0], [1 / 8, 1 / 8, 1 / 8]]),  # 2 samples x 4 tokens
    ],
)
def test_loss_aggregation_weights_each_token_by_hand(how, expected):
    comp = torch.tensor([[True, False, False], [True, True, True]])
    mb = SimpleNamespace(comp=comp)
    cfg = SimpleNamespace(loss_aggregation=how)
    w = aggregation_weights(cfg, mb, StepTotals(tokens=4, samples=2, divisor=4))
    new = torch.zeros(2, 3, requires_grad=True)  # on-policy: the gradient is -A w
    parts = policy_loss(new, torch.zeros(2, 3), torch.ones(2, 3), comp, **CLIP, weights=w)
    parts.loss.backward()
    torch.testing.assert_close(new.grad, -torch.tensor(expected))


def test_truncated_is_weights_by_the_capped_ratio_and_never_clips():
    # ratio 3 > cap 2: weight 2, gradient -A * 2 (behaviour_clip would give 0 for A > 0)
    parts, grad = one([math.log(3.0)], [0.0], [1.0], off_policy="truncated_is")
    assert float(parts.loss) == pytest.approx(-2.0) and float(grad[0]) == pytest.approx(-2.0)
    assert parts.clipped == 0 and parts.dual_clipped == 1
    clipped, g_clip = one([math.log(3.0)], [0.0], [1.0])
    assert float(g_clip[0]) == 0 and clipped.clipped == 1
    # ratio 0.5: weight 0.5 either sign
    parts, grad = one([math.log(0.5)], [0.0], [-1.0], off_policy="truncated_is")
    assert float(parts.loss) == pytest.approx(0.5) and float(grad[0]) == pytest.approx(0.5)


def test_k3_gradient_is_that_of_the_forward_kl():
    # pi = 1/2 on a token the reference gives 1: d k3 / d log pi = 1 - ref/pi = -1
    parts, grad = one([0.0], [0.0], [0.0], ref=[math.log(2.0)], kl_coef=0.5)
    assert float(parts.loss) == pytest.approx(0.5 * (2 - math.log(2) - 1), abs=1e-6)
    assert float(grad[0]) == pytest.approx(0.5 * -1.0)


def test_k3_ratio_gradient_is_that_of_the_reverse_kl():
    # r k3 with r = pi/mu = 1: d/d log pi = k3 + (1 - ref/pi) = log(pi/ref) = -log 2
    parts, grad = one(
        [0.0], [0.0], [0.0], ref=[math.log(2.0)], kl_coef=0.5, kl_estimator="k3_ratio"
    )
    assert float(parts.loss) == pytest.approx(0.5 * (2 - math.log(2) - 1), abs=1e-6)
    assert float(grad[0]) == pytest.approx(0.5 * -math.log(2.0), abs=1e-6)
    # off-policy (mu = 2 pi): the same gradient, weighted by r = 1/2
    _, grad = one(
        [0.0], [math.log(2.0)], [0.0], ref=[math.log(2.0)], kl_coef=1.0, kl_estimator="k3_ratio"
    )
    assert float(grad[0]) == pytest.approx(0.5 * -math.log(2.0), abs=1e-6)


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "key,value,says",
    [
        ("is_cap", 0.0, "trainer.is_cap=0.0 must be > 1 + trainer.clip_high"),
        ("is_cap", 1.0, "trainer.is_cap=1.0 must be > 1 + trainer.clip_high"),
        ("clip_low", 1.0, "trainer.clip_low=1.0 must be in [0, 1)"),
        ("clip_low", -0.1, "trainer.clip_low=-0.1 must be in [0, 1)"),
        ("clip_high", -0.5, "trainer.clip_high=-0.5 must be >= 0"),
        ("off_policy", "ppo", "trainer.off_policy='ppo' is not supported"),
        ("loss_aggregation", "sum", "trainer.loss_aggregation='sum' is not supported"),
        ("advantage_std", "batch", "trainer.advantage_std='batch' is not supported"),
        ("kl_estimator", "k2", "trainer.kl_estimator='k2' is not supported"),
    ],
)
def test_objective_settings_refuse_nonsense_naming_the_key(key, value, says):
    cfg = OmegaConf.structured(Config)
    cfg.trainer[key] = value
    with pytest.raises(ValueError) as err:
        validate(cfg)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def test_the_constant_divisor_is_the_generation_budget_of_a_sample_or_an_episode():
    cfg = OmegaConf.structured(Config)
    cfg.sampling.max_new_tokens = 32
    assert constant_divisor(cfg) == 32
    cfg.task.kind, cfg.task.episode.max_turns, cfg.task.episode.max_tokens = "env", 4, 512
    assert constant_divisor(cfg) == 128  # four turns of 32
    cfg.task.episode.max_tokens = 100
    assert constant_divisor(cfg) == 100  # the episode's own budget binds
