"""The preprocessor's scorers as configured by ``preprocessor.scorers``: the config
errors a user sees, teacher rewards, the model PRM, and what reaches the trainer."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from actor.engines.hf import HFEngine
from pipeline.config import Config, load_config, validate
from pipeline.logprobs import completion_logprobs, pad_sequences
from pipeline.messages import (
    SCHEMA_VERSION,
    RolloutGroup,
    pack_i32,
    unpack_f32,
    unpack_i32,
)
from pipeline.models import load_model, materialize_model
from preprocessor.main import score_groups
from preprocessor.scorers import ScoredGroup, build_scorers
from preprocessor.scoring import group_logprobs, pack_groups

PROMPTS = ["What is 2 + 3?", "Hi"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture
def cfg(cache, monkeypatch):
    monkeypatch.setenv("NONSTOP_CACHE", cache)
    cfg = OmegaConf.structured(Config)
    cfg.model.name = "tiny"
    cfg.model.path = materialize_model("tiny", cache)
    return cfg


def rollouts(path, temperature=0.7, top_p=1.0, top_k=0, keep_mask=False, rewards=(1, 0, 1, 0)):
    """Two real groups of 4 completions sampled by the tiny model."""
    model, tok = load_model(path)
    engine = HFEngine(model, tok, temperature, top_p, top_k, seed=3, keep_sampling_mask=keep_mask)
    groups = []
    for gi, text in enumerate(PROMPTS):
        prompt = tok(text)["input_ids"]
        outs = engine.generate([prompt] * 4, max_new_tokens=12)
        samples = [c.to_sample(k, r) for k, (c, r) in enumerate(zip(outs, rewards, strict=True))]
        groups.append(
            RolloutGroup(
                schema=SCHEMA_VERSION,
                group_id=f"g{gi}",
                actor="actor-0",
                problem_id=f"p{gi}",
                prompt_ids=pack_i32(prompt),
                samples=samples,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
            )
        )
    return groups


def test_unknown_scorer_is_a_value_error_naming_the_key_and_the_choices(cfg):
    cfg.preprocessor.scorers = ["reference", "critic"]
    for check in (validate, build_scorers):
        with pytest.raises(ValueError, match="preprocessor.scorers") as err:
            check(cfg)
        assert "'critic'" in str(err.value)
        assert "reference, prm, teacher" in str(err.value)


def test_scorer_settings_errors_name_their_key(cfg, tmp_path):
    cfg.preprocessor.scorers = ["teacher"]
    with pytest.raises(ValueError, match="preprocessor.teacher.model"):
        validate(cfg)
    cfg.preprocessor.teacher.model = "tiny-teacher"
    cfg.preprocessor.scorers = ["prm", "teacher"]
    cfg.preprocessor.prm.weight = 0.6
    with pytest.raises(ValueError, match="preprocessor.prm.weight"):
        validate(cfg)
    cfg.preprocessor.scorers = ["prm", "prm"]
    with pytest.raises(ValueError, match="twice"):
        validate(cfg)
    cfg.preprocessor.scorers = ["prm"]
    cfg.preprocessor.prm.kind = "model"
    with pytest.raises(ValueError, match="preprocessor.prm.model"):
        validate(cfg)
    cfg.preprocessor.prm.model = "tiny"
    cfg.preprocessor.prm.good_token = "good"  # five characters: five tiny tokens
    with pytest.raises(ValueError, match="preprocessor.prm.good_token"):
        build_scorers(cfg)
    old = tmp_path / "old.yaml"
    old.write_text("preprocessor:\n  reference: false\n")
    with pytest.raises(ValueError, match=r"preprocessor.scorers: \[reference\]"):
        load_config(str(old))


def test_teacher_rewards_are_the_negative_log_ratio(cfg):
    cfg.preprocessor.scorers = ["teacher"]
    cfg.preprocessor.teacher.model = "tiny-teacher"
    cfg.preprocessor.teacher.weight = 1.0
    groups = rollouts(cfg.model.path, rewards=(1, 1, 1, 1))  # outcomes tie: no outcome signal
    [teacher] = build_scorers(cfg)
    kept, dropped, counts = score_groups([teacher], groups, drop_no_signal=True)
    assert len(kept) == 2 and not dropped and counts["teacher_scored_groups"] == 2

    t_model, _ = load_model(materialize_model("tiny-teacher"))
    for g in kept:
        prompts = [unpack_i32(g.prompt_ids)] * len(g.samples)
        ids, attn, comp = pad_sequences(prompts, [s.tokens() for s in g.samples])
        with torch.no_grad():
            t_lp = completion_logprobs(t_model, ids, attn, comp, g.temperature)
        for row, s in enumerate(g.samples):
            expected = t_lp[row][comp[row]].numpy() - unpack_f32(s.logprobs)
            got = unpack_f32(s.token_advantages)  # weight 1: the advantage is the reward
            np.testing.assert_allclose(got, expected, atol=1e-5)
            assert s.advantage == 0.0


def test_teacher_identical_to_student_gives_zero_reward(cfg):
    cfg.preprocessor.scorers = ["teacher"]
    cfg.preprocessor.teacher.model = "tiny"  # the student itself: log-ratio 0
    groups = rollouts(cfg.model.path)
    [teacher] = build_scorers(cfg)
    for per_group in teacher.rewards([ScoredGroup(g) for g in groups]):
        for r in per_group:
            np.testing.assert_allclose(r, 0.0, atol=2e-4)


def test_reference_and_model_prm_fill_their_fields(cfg):
    cfg.preprocessor.scorers = ["reference", "prm"]
    cfg.preprocessor.prm.kind = "model"
    cfg.preprocessor.prm.model = "tiny"
    cfg.preprocessor.prm.delimiter = " "  # the random model writes few newlines
    cfg.preprocessor.prm.weight = 0.5
    groups = rollouts(cfg.model.path, top_p=0.9, top_k=20, keep_mask=True)
    scorers = build_scorers(cfg)
    prm = scorers[1]
    kept, _, counts = score_groups(scorers, groups, drop_no_signal=True)
    assert counts["prm_scored_groups"] == 2 and counts["prm_scored_steps"] > 0
    assert counts["reference_scored_groups"] == 2
    model, _ = load_model(cfg.model.path)
    for g in kept:
        # reference = the initial policy (here the actor itself) at the rollout's
        # temperature, never truncated: finite where the actor's top-p/top-k gave -inf
        prompts = [unpack_i32(g.prompt_ids)] * len(g.samples)
        ids, attn, comp = pad_sequences(prompts, [s.tokens() for s in g.samples])
        with torch.no_grad():
            full = completion_logprobs(model, ids, attn, comp, g.temperature)
        for row, s in enumerate(g.samples):
            ref = unpack_f32(s.ref_logprobs)
            np.testing.assert_allclose(ref, full[row][comp[row]].numpy(), atol=2e-4)
            # the actor renormalised over its kept support: never below the untruncated
            assert (ref <= unpack_f32(s.logprobs) + 2e-4).all()
            assert len(unpack_f32(s.token_advantages)) == len(s.tokens())
    # every step scored by hand on the whole sequence: p(+) / (p(+) + p(-)) at its tag
    g = kept[0]
    prompt = prm.prompt(unpack_i32(g.prompt_ids))
    built = [prm.build(s.tokens()) for s in g.samples]
    [scores] = prm.step_scores([prompt], [built])
    assert sum(len(x) for x in scores) == sum(len(b[1]) for b in built) > 0
    for (body, positions, _), got in zip(built, scores, strict=True):
        if not positions:
            continue
        with torch.no_grad():
            logits = prm.model(input_ids=torch.tensor([prompt + body])).logits[0]
        read = logits[[len(prompt) + p for p in positions]][:, [prm.good, prm.bad]]
        expected = torch.softmax(read, -1)[:, 0].numpy()
        assert ((got > 0) & (got < 1)).all()
        np.testing.assert_allclose(got, expected, atol=2e-5)


@pytest.mark.parametrize("budget", [4096, 60], ids=["one-pass", "a-pass-per-group"])
@pytest.mark.parametrize("masked", [False, True], ids=["truncated", "recorded-mask"])
def test_shared_prompt_forward_equals_a_full_forward(cfg, budget, masked):
    groups = rollouts(cfg.model.path, top_p=0.9, top_k=20, keep_mask=masked)
    model, tok = load_model(cfg.model.path)
    shared = group_logprobs(model, groups, budget, tok.pad_token_id)
    for g, lps in zip(groups, shared, strict=True):
        prompts = [unpack_i32(g.prompt_ids)] * len(g.samples)
        ids, attn, comp = pad_sequences(prompts, [s.tokens() for s in g.samples])
        masks = [s.sampling_mask() for s in g.samples]
        with torch.no_grad():
            full = completion_logprobs(
                model, ids, attn, comp, g.temperature, g.top_p, g.top_k, masks=masks
            )
        for row, lp in enumerate(lps):
            np.testing.assert_allclose(lp, full[row][comp[row]].numpy(), atol=2e-5)


def test_group_packing_respects_the_budget():
    shapes = [(30, [10, 12, 9, 11]), (5, [40, 2]), (30, [1, 1, 1, 1]), (200, [300])]
    parts = pack_groups(shapes, budget=150)
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3]
    for p in parts:
        cost = len(p) * max(shapes[i][0] for i in p)
        cost += sum(len(shapes[i][1]) for i in p) * max(max(shapes[i][1]) for i in p)
        assert cost <= 150 or len(p) == 1


def test_model_prm_keeps_within_its_context(cfg):
    cfg.preprocessor.scorers = ["prm"]
    cfg.preprocessor.prm.kind = "model"
    cfg.preprocessor.prm.model = "tiny"
    cfg.preprocessor.prm.delimiter = " "
    groups = rollouts(cfg.model.path)
    [prm] = build_scorers(cfg)
    prm.max_len = 24  # shorter than prompt + completion: the prompt's start goes first
    prompt, fitted = prm.fit(
        prm.prompt(unpack_i32(groups[0].prompt_ids)),
        [prm.build(s.tokens()) for s in groups[0].samples],
    )
    assert all(len(prompt) + len(body) <= 24 for body, _, _ in fitted)
    assert all(p < len(body) for body, positions, _ in fitted for p in positions)
    counts = prm.score([ScoredGroup(g) for g in groups])
    assert counts["prm_scored_groups"] >= 1


def test_reference_logprobs_stay_finite_outside_the_references_own_top_k(cfg):
    """Tokens the actor sampled (here among all) that the reference's own top_k=1 would
    cut get a finite reference log-prob: it is never truncated (-inf made the KL inf)."""
    cfg.preprocessor.scorers = ["reference"]
    groups = rollouts(cfg.model.path)
    for g in groups:
        g.top_k = 1
    [reference] = build_scorers(cfg)
    reference.score([ScoredGroup(g) for g in groups])
    refs = np.concatenate([unpack_f32(s.ref_logprobs) for g in groups for s in g.samples])
    assert np.isfinite(refs).all()
    assert (refs < -1e-3).mean() > 0.5  # most sampled tokens were not the reference's top 1
