"""Keep Routing on the actor (sampling.keep_routing, issue 32): the hf engine records the
experts every fed-forward token went to, the publish path packs them (prompt rows once
per group when identical) and dead-letters a group too big to publish; a dense model or
episodes are refused in one line. On the tiny-moe model (8 experts, top-2, 2 layers)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from actor import publish as publish_mod
from actor.batch import generate_step
from actor.engines.hf import HFEngine
from pipeline import models, routing
from pipeline.config import Config, validate
from pipeline.config.sampling import DENSE_MODELS
from pipeline.messages import RolloutGroup, decode, unpack_i32
from pipeline.models import load_model, materialize_model
from pipeline.run.accounting import dead_letters
from pipeline.streams import Names
from pipeline.tasks import RewardErrors, make_task
from pipeline.telemetry import Window
from tests.config_builders import compose_config
from tests.episode_builders import actor_pool

TEXTS = ["What is 2 + 3?", "Hi", "A much longer prompt than the others, 12 + 30 = ?"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The tiny-moe model and tokenizer, loaded once for the module (float32)."""
    return load_model(materialize_model("tiny-moe", str(tmp_path_factory.mktemp("models"))))


def _engine(moe, **kw) -> HFEngine:
    model, tok = moe
    args = dict(temperature=1.0, top_p=1.0, top_k=0, seed=3, keep_routing=True) | kw
    return HFEngine(model, tok, **args)


def _teacher_forced(model, ids: list[int]) -> np.ndarray:
    """Routes of one unpadded forward over ``ids``: [len(ids), layers, k], sorted."""
    with routing.capture(model) as calls, torch.no_grad():
        model(torch.tensor([ids]))
    return routing.stack_forward(calls[0], 1)[0]


def _check_against_forward(model, prompts, outs) -> None:
    for p, o in zip(prompts, outs, strict=True):
        assert o.routes.shape == (len(p) + len(o.tokens) - 1, 2, 2), (len(p), len(o.tokens))
        assert o.routes.dtype == np.uint8 and o.routes_exact
        want = _teacher_forced(model, p + o.tokens[:-1])
        assert int((want != o.routes).sum()) == 0  # float32: not one id differs


def test_hf_engine_routes_equal_a_teacher_forced_forward(moe):
    """Prompts of three lengths in one left-padded batch: each row's routes (prefill right
    of its padding, then one row per decode step) are those of a forward over its own
    prompt + completion; the rows of a sequence cut early by a stop string (its later
    steps fed padding) or by should_stop end where its tokens end."""
    model, tok = moe
    engine = _engine(moe)
    engine.stop_ids = set()  # every sequence to the limit, or its stop string
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    outs = engine.generate(prompts, max_new_tokens=12)
    assert {len(o.tokens) for o in outs} == {12}
    _check_against_forward(model, prompts, outs)

    engine.stop_strings = ("e", "a", "o")  # the character tokenizer: rows stop at different steps
    outs = engine.generate(prompts * 2, max_new_tokens=12)
    assert len({len(o.tokens) for o in outs}) > 1, [len(o.tokens) for o in outs]
    _check_against_forward(model, prompts * 2, outs)

    engine.stop_strings, calls = (), iter(range(100))
    outs = engine.generate(prompts, max_new_tokens=12, should_stop=lambda: next(calls) >= 4)
    assert {len(o.tokens) for o in outs} == {5}
    _check_against_forward(model, prompts, outs)

    assert _engine(moe, keep_routing=False).generate(prompts, 4)[0].routes is None


def test_a_dense_model_or_episodes_with_keep_routing_are_refused_in_one_line(tmp_path):
    model, tok = load_model(materialize_model("tiny", str(tmp_path)))
    with pytest.raises(ValueError) as e:
        HFEngine(model, tok, temperature=1.0, top_p=1.0, top_k=0, keep_routing=True)
    assert "\n" not in str(e.value) and "sampling.keep_routing=false" in str(e.value)
    # the config check knows the built-in dense models without loading them
    assert set(DENSE_MODELS) == {
        models.TINY_MODEL,
        models.TINY_TEACHER,
        models.DEFAULT_MODEL,
        models.SMOLLM2_HUB_ID,
    }
    folder = materialize_model("tiny", str(tmp_path))
    for overrides, words in (
        (["+exp=tiny"], "model.name=tiny is dense"),
        (["+exp=tiny", f"model.name={folder}"], "is dense"),
        (["+exp=calc", "model=tiny_moe"], "task.kind=env"),
    ):
        cfg = compose_config([*overrides, "sampling.keep_routing=true"])
        with pytest.raises(ValueError) as e:
            validate(cfg)
        line = str(e.value)
        assert "\n" not in line and words in line and "sampling.keep_routing=false" in line
    validate(compose_config(["+exp=tiny_moe", "sampling.keep_routing=true"]))
    vllm = ["+exp=tiny_moe", "sampling.keep_routing=true", "actor.engine=vllm"]
    cfg = compose_config(vllm)
    assert cfg.sampling.keep_routing and cfg.run.name == "tiny_moe"


def _pool(rclient, tmp_path, **sampling):
    cfg = OmegaConf.structured(Config)
    cfg.model.name = "tiny-moe"
    cfg.task.group_size = 3
    cfg.sampling.max_new_tokens = 10
    cfg.sampling.prompts_per_batch = 2
    cfg.sampling.keep_routing = True
    for k, v in sampling.items():
        cfg.sampling[k] = v
    return actor_pool(cfg, rclient, Names("test", "moe"), str(tmp_path / "metrics.jsonl"))


def _groups(rclient, names) -> list[RolloutGroup]:
    return [decode(f[b"data"], RolloutGroup) for _, f in rclient.xrange(names.rollouts)]


def _check_groups(model, groups: list[RolloutGroup]) -> None:
    """Each group: tiny-moe's layout, its prompt's rows once, each sample's completion
    rows (one fewer than its ids), together those of a teacher-forced forward."""
    layout = routing.RouteLayout(2, 2, 8)
    for g in groups:
        assert g.route_layout == layout.as_list()
        prompt = unpack_i32(g.prompt_ids).tolist()
        head = layout.unpack(g.prompt_routes)
        assert head.shape == (len(prompt), 2, 2)
        for s in g.samples:
            tokens = s.tokens().tolist()
            rows = layout.unpack(s.routes)
            assert rows.shape == (len(tokens) - 1, 2, 2) and s.routes_exact
            whole = np.concatenate([head, rows])
            assert (whole == _teacher_forced(model, prompt + tokens[:-1])).all()


def test_published_groups_carry_consistent_routes(moe, rclient, tmp_path):
    """Through the actor's batch loop (actor/batch.py generate_step) to a real Redis:
    every group decodes with the model's layout, its prompt's rows once (identical in
    every sample of a group) and each sample's completion rows, together those of a
    teacher-forced forward."""
    model, tok = moe
    pool = _pool(rclient, tmp_path)
    engine = _engine(moe)
    task = make_task("arithmetic", 1, "", 0)
    assert generate_step(pool, engine, task, tok, Window(), RewardErrors()) == 2
    groups = _groups(rclient, pool.names)
    assert len(groups) == 2
    _check_groups(model, groups)


def test_prompt_rows_stay_per_sample_when_they_differ(moe, rclient, tmp_path):
    model, tok = moe
    pool = _pool(rclient, tmp_path)
    outs = _engine(moe).generate([tok("Hi")["input_ids"]] * 2, 6)
    outs[1].routes = outs[1].routes.copy()
    outs[1].routes[0] = (outs[1].routes[0] + 1) % 8  # another routing of the prompt's first id
    prompt = tok("Hi")["input_ids"]
    problem = make_task("arithmetic", 1, "", 0).sample()
    layout = routing.layout_of(model).as_list()  # a list, as the vllm engine gives it
    publish_mod.publish_group(pool, tok, problem, prompt, outs, Window(), RewardErrors(), layout)
    (g,) = _groups(rclient, pool.names)
    assert g.prompt_routes == b"" and g.route_layout == [2, 2, 8]
    for s, o in zip(g.samples, outs, strict=True):
        rows = routing.RouteLayout(2, 2, 8).unpack(s.routes)
        assert rows.shape[0] == len(prompt) + len(o.tokens) - 1
        assert (rows == np.sort(o.routes, axis=-1)).all()


def test_a_group_too_big_is_dead_lettered_with_what_to_change(moe, rclient, tmp_path, monkeypatch):
    """Routes count in the group's size: over the limit the group goes to the dead
    letters (no payload, a reason naming the fix), counted produced and retired at once
    (back-pressure balanced); the actor goes on to the next batch."""
    model, tok = moe
    pool, names = _pool(rclient, tmp_path), Names("test", "moe")

    def batch() -> int:  # the same two groups each time (fresh seeds), new group ids
        task = make_task("arithmetic", 1, "", 0)
        return generate_step(pool, _engine(moe), task, tok, Window(), RewardErrors())

    assert batch() == 2
    sizes = [len(f[b"data"]) for _, f in rclient.xrange(names.rollouts)]
    routes = [
        len(g.prompt_routes) + sum(len(s.routes) for s in g.samples)
        for g in _groups(rclient, names)
    ]
    rclient.flushdb()
    # what the groups would weigh without their routes fits; with them it does not
    monkeypatch.setattr(
        publish_mod, "MAX_GROUP_BYTES", max(s - r for s, r in zip(sizes, routes, strict=True)) + 8
    )
    assert min(sizes) > publish_mod.MAX_GROUP_BYTES
    assert batch() == 2
    assert rclient.xlen(names.rollouts) == 0
    dead = [{k.decode(): v for k, v in f.items()} for _, f in rclient.xrange(names.dead)]
    assert len(dead) == 2
    for d in dead:
        reason = d["reason"].decode()
        assert "routes (sampling.keep_routing)" in reason and "keep_routing=false" in reason
        assert d["role"] == b"actor" and d["data"] == b"" and d["group"]
    produced = int(rclient.get(names.samples_produced))
    assert produced == int(rclient.get(names.samples_retired)) == 6
    assert rclient.hget(pool.status.key, "dead_lettered") == b"2"
    assert [len(s) for s in dead_letters(rclient, names)[0]["groups"]] and all(
        d["role"] == "actor" for d in dead_letters(rclient, names)
    )


def test_keep_routing_with_an_engine_that_records_none_stops_the_actor(moe, rclient, tmp_path):
    model, tok = moe
    pool = _pool(rclient, tmp_path)
    engine = _engine(moe, keep_routing=False)  # records nothing, as vllm before its support
    task = make_task("arithmetic", 1, "", 0)
    with pytest.raises(RuntimeError, match="engine recorded no routes"):
        generate_step(pool, engine, task, tok, Window(), RewardErrors())


def test_make_engine_passes_keep_routing_and_refuses_an_engine_that_records_none(
    tmp_path, monkeypatch
):
    """actor.engine=hf records routes in the model's layout; an engine that says no
    ``route_layout`` under keep_routing (a vllm build without it) is closed and refused."""
    from actor.engines import make_engine
    from actor.engines.vllm import client

    cfg = OmegaConf.structured(Config)
    cfg.sampling.keep_routing, cfg.actor.engine = True, "hf"
    path = materialize_model("tiny-moe", str(tmp_path))
    assert make_engine(cfg, path, seed=0).route_layout == routing.RouteLayout(2, 2, 8)

    closed = []

    class NoRoutes:
        route_layout = None

        def close(self):
            closed.append(True)

    monkeypatch.setattr(client, "from_config", lambda *a: NoRoutes())
    cfg.actor.engine = "vllm"
    with pytest.raises(ValueError, match="records no routes.*keep_routing=false"):
        make_engine(cfg, path, seed=0, tokenizer=None)
    assert closed == [True]
    NoRoutes.route_layout = [2, 2, 8]  # as the vllm worker reports it, left as it is
    assert make_engine(cfg, path, seed=0, tokenizer=None).route_layout == [2, 2, 8]
    assert closed == [True]


def test_a_real_actor_process_publishes_groups_whose_routes_replay(
    moe, tmp_path, redis_server, rclient
):
    """``python -m actor`` on tiny-moe with sampling.keep_routing (hf engine): the groups
    of its first batch decode with consistent routes (:func:`_check_groups`)."""
    import os
    import subprocess
    import sys

    from tests.config_builders import PER_BATCH, actor_config
    from tests.launching import ROOT

    path = actor_config(tmp_path, redis_server.url, "model=tiny_moe", "sampling.keep_routing=true")
    cfg = OmegaConf.load(path)
    cfg.model.path = materialize_model("tiny-moe", str(tmp_path / "cache"))
    OmegaConf.save(cfg, path)
    env = dict(
        os.environ,
        NONSTOP_CACHE=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
        NONSTOP_RUN_SECRET="s" * 32,
        NONSTOP_REDIS_URL=redis_server.url,
    )
    names = Names("nonstop", "tiny")
    cmd = [sys.executable, "-m", "actor", "--config", path, "--name", "actor-0"]
    log = open(tmp_path / "actor.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while rclient.xlen(names.rollouts) < PER_BATCH and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "actor.log").read_text()[-2000:]
            time.sleep(0.2)
        groups = _groups(rclient, names)
        assert len(groups) >= PER_BATCH, (tmp_path / "actor.log").read_text()[-2000:]
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    _check_groups(moe[0], groups)
