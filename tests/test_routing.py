"""Keep Routing in the trainer and the preprocessor (pipeline/routing.py replay) on the
real tiny MoE models in fp32: replaying a model's own routes changes nothing, bit for
bit; foreign routes change the output and are counted; the router still gets the
gradient of its own softmax gathered at the replayed ids; positions without routes
(padding, the last completion id) route live; gradient checkpointing recomputes the
same routes; a TrainBatch with routes trains through collate and reports the metrics;
the preprocessor joins a group's prompt routes and can replay them in the reference;
ZeRO-3 on two gloo ranks matches the torch backend with routes replayed. The wire
checks of routes are in tests/test_messages.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipeline import routing
from pipeline.config import Config
from pipeline.messages import (
    SCHEMA_VERSION,
    RolloutGroup,
    TrainBatch,
    pack_f32,
    pack_i32,
)
from pipeline.models import load_model, materialize_model
from tests.trainer_builders import sample
from trainer.collate import collate

B, T = 2, 12


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return materialize_model("tiny-moe", str(tmp_path_factory.mktemp("moe")))


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory):
    return materialize_model("tiny-olmoe", str(tmp_path_factory.mktemp("olmoe")))


@pytest.fixture(scope="module")
def models(moe_dir, olmoe_dir):
    """One fp32 copy of each tiny MoE model for the module (tests leave no gradients)."""
    return {
        name: load_model(path, "float32", "cpu")[0]
        for name, path in (("qwen3_moe", moe_dir), ("olmoe", olmoe_dir))
    }


def own_routes(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, T, layers, k] the model's own top-k ids for ``ids``."""
    with torch.no_grad(), routing.capture(model) as calls:
        model(input_ids=ids)
    return torch.from_numpy(routing.stack_forward(calls[0], ids.shape[0])).long()


def foreign_routes(layout: routing.RouteLayout, shape, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    order = np.argsort(rng.random((*shape, layout.layers, layout.experts)), axis=-1)
    return torch.from_numpy(np.sort(order[..., : layout.k], axis=-1)).long()


def forward_backward(model, ids, routes=None, valid=None):
    """(logits, {name: grad}) of sum(logits * fixed weights); replayed when routes given."""
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(-1, 1, model.config.vocab_size)

    def run():
        logits = model(input_ids=ids).logits
        (logits * weights).sum().backward()
        return logits.detach()

    if routes is None:
        logits = run()
        stats = None
    else:
        with routing.replay(model, routes, valid) as r:
            logits = run()
        stats = r.stats()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits, grads, stats


def ids_of(model, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 90, (B, T), generator=g)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_replaying_the_models_own_routes_is_bit_identical(models, family):
    model = models[family].train()
    ids = ids_of(model)
    base, base_grads, _ = forward_backward(model, ids)
    routes = own_routes(model, ids)
    got, grads, stats = forward_backward(model, ids, routes, torch.ones(B, T, dtype=torch.bool))
    assert torch.equal(got, base)
    assert base_grads.keys() == grads.keys()
    for name, g in base_grads.items():
        assert torch.equal(grads[name], g), name
    layout = routing.layout_of(model)
    assert stats == routing.RouteStats(0, B * T * layout.layers, 0, B * T)
    model.eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_foreign_routes_change_the_output_and_count_as_mismatch(models, family):
    model = models[family].train()
    ids = ids_of(model)
    base, _, _ = forward_backward(model, ids)
    layout = routing.layout_of(model)
    routes = foreign_routes(layout, (B, T))
    valid = torch.ones(B, T, dtype=torch.bool)
    got, grads, stats = forward_backward(model, ids, routes, valid)
    assert (got - base).abs().max() > 1e-3
    live = own_routes(model, ids)
    differ = (live != routes).any(dim=-1)  # [B, T, layers]
    assert stats.pairs_differ == int(differ.sum()) > 0
    assert stats.tokens_differ == int(differ.any(dim=-1).sum())
    assert stats.mismatch == pytest.approx(float(differ.float().mean()))
    for router_name in [n for n in grads if n.endswith("gate.weight")]:
        assert grads[router_name].abs().sum() > 0, router_name  # the router learns
    model.eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_router_gradient_is_that_of_its_softmax_gathered_at_the_replayed_ids(models, family):
    router = routing.moe_routers(models[family])[0]
    n, k = 10, router.top_k
    x = torch.randn(n, router.hidden_dim, generator=torch.Generator().manual_seed(3))
    layout = routing.RouteLayout(1, k, router.num_experts)
    ids = foreign_routes(layout, (1, n), seed=4)  # [1, n, 1, k]
    valid = torch.ones(1, n, dtype=torch.bool)
    valid[0, -3:] = False  # these route live
    c = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    with routing.replay(router, ids, valid):
        _, scores, used = router(x)
    (scores * c).sum().backward()
    got = router.weight.grad.clone()
    router.weight.grad = None

    w = router.weight.detach().clone().requires_grad_(True)
    probs = torch.softmax(x @ w.T, dim=-1)
    live = torch.topk(probs, k, dim=-1).indices
    want_ids = torch.where(valid[0, :, None], ids[0, :, 0], live)
    top = probs.gather(-1, want_ids)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    (top * c).sum().backward()
    assert torch.equal(used, want_ids)
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, w.grad, rtol=1e-6, atol=1e-7)


def moe_batch(model, rng, lengths=((5, 7), (3, 4)), routes: str = "own", version: int = 0):
    """A TrainBatch of random tokens with routes (``own``: the model's, else random),
    the actor's log-probs the model's own (on-policy)."""
    layout = routing.layout_of(model)
    prompts, samples = [], []
    for i, (p, c) in enumerate(lengths):
        prompts.append(rng.integers(10, 90, p))
        s = sample(i, c, version, 1.0 if i % 2 else -1.0, rng)
        seq = torch.from_numpy(np.concatenate([prompts[-1], s.tokens()]).astype(np.int64))
        if routes == "own":
            rows = own_routes(model, seq[None, :-1])[0].numpy()
        else:
            rows = foreign_routes(layout, (1, p + c - 1), seed=i)[0].numpy()
        s.routes = layout.pack(rows)
        with torch.no_grad():
            logits = model(input_ids=seq[None]).logits[0].log_softmax(-1)
        s.logprobs = pack_f32(logits[p - 1 : -1].gather(-1, seq[p:, None])[:, 0].numpy())
        samples.append(s)
    batch = TrainBatch(
        schema=SCHEMA_VERSION,
        batch_id="b",
        group_ids=["g"] * len(samples),
        prompt_ids=[pack_i32(p) for p in prompts],
        samples=samples,
        temperature=1.0,
        route_layout=layout.as_list(),
    )
    batch.check(model.config.vocab_size)
    return batch


def test_collate_lays_routes_out_and_padding_routes_live(models):
    model = models["qwen3_moe"].train()
    b = moe_batch(model, np.random.default_rng(0), routes="foreign")
    mb = collate(b, 0, torch.device("cpu"))
    total = torch.tensor([5 + 7, 3 + 4])
    assert mb.routes.shape == (2, 12, 2, 2) and mb.routes.dtype == torch.long
    want_valid = torch.arange(12)[None, :] < (total - 1)[:, None]
    assert torch.equal(mb.routes_valid, want_valid)  # no padding, no last completion id
    layout = routing.layout_of(model)
    assert torch.equal(
        mb.routes[1, :6], torch.from_numpy(layout.unpack(b.samples[1].routes)).long()
    )
    assert torch.equal(mb.versions[mb.comp], torch.zeros(int(mb.comp.sum()), dtype=torch.long))
    # whatever the routes hold where they are not valid, nothing changes
    spoiled = mb.routes.clone()
    spoiled[~mb.routes_valid] = torch.tensor([6, 7])
    with torch.no_grad():
        with routing.replay(model, mb.routes, mb.routes_valid) as r:
            a = model(input_ids=mb.ids, attention_mask=mb.attn).logits
        n = r.stats().tokens
        with routing.replay(model, spoiled, mb.routes_valid) as r:
            c = model(input_ids=mb.ids, attention_mask=mb.attn).logits
    assert torch.equal(a, c)
    assert n == r.stats().tokens == int(want_valid.sum())
    model.eval()


def test_gradient_checkpointing_recomputes_the_same_routes(moe_dir):
    model = load_model(moe_dir, "float32", "cpu")[0].train()
    ids = ids_of(model)
    layout = routing.layout_of(model)
    routes, valid = foreign_routes(layout, (B, T)), torch.ones(B, T, dtype=torch.bool)
    plain, plain_grads, plain_stats = forward_backward(model, ids, routes, valid)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    ckpt, ckpt_grads, ckpt_stats = forward_backward(model, ids, routes, valid)
    live, live_grads, _ = forward_backward(model, ids)
    assert torch.equal(ckpt, plain)
    assert ckpt_stats == plain_stats and plain_stats.pairs_differ > 0  # not counted twice
    for name, g in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], g, rtol=0, atol=0, msg=name)
    assert not torch.equal(
        live_grads["model.layers.0.mlp.gate.weight"], plain_grads["model.layers.0.mlp.gate.weight"]
    )


def test_a_step_with_routes_replays_them_and_reports_the_metrics(moe_dir):
    from trainer.backends.torch_backend import TorchBackend
    from trainer.ranks import Ranks
    from trainer.step import train_step

    cfg = OmegaConf.structured(Config)
    cfg.trainer.lr, cfg.trainer.route_probe_every = 1e-3, 2
    one = Ranks(0, 1, 0, None)
    backend = TorchBackend(cfg, one, moe_dir, None)
    own = moe_batch(backend.model, np.random.default_rng(1), routes="own", version=4)
    mb_tokens = sum(s.n_sampled() for s in own.samples)
    m = train_step(backend, one, [own], 1, own, cfg.trainer, 0, mb_tokens, version=4)
    assert m["route_mismatch"] == m["route_mismatch_tokens"] == 0.0
    assert m["kl_actor_replayed"] == pytest.approx(0.0, abs=1e-6)  # on-policy, own routes
    assert m["kl_actor_free"] == pytest.approx(0.0, abs=1e-6)  # version 4: a probe step
    foreign = moe_batch(backend.model, np.random.default_rng(2), routes="foreign", version=5)
    m = train_step(backend, one, [foreign], 1, foreign, cfg.trainer, 0, mb_tokens, version=5)
    assert 0 < m["route_mismatch"] <= m["route_mismatch_tokens"] <= 1
    assert m["kl_actor_replayed"] > 0 and "kl_actor_free" not in m  # 5: no probe
    stale = moe_batch(backend.model, np.random.default_rng(3), routes="foreign", version=5)
    m = train_step(backend, one, [stale], 1, stale, cfg.trainer, 0, mb_tokens, version=6)
    assert "kl_actor_replayed" not in m and "kl_actor_free" not in m  # no current tokens
    plain = sample(0, 5, 0, 1.0, np.random.default_rng(4))
    dense_batch = TrainBatch(
        schema=SCHEMA_VERSION,
        batch_id="p",
        group_ids=["p"],
        prompt_ids=[pack_i32([11, 12, 13])],
        samples=[plain],
        temperature=1.0,
    )
    m = train_step(backend, one, [dense_batch], 1, dense_batch, cfg.trainer, 0, 5, version=6)
    assert "route_mismatch" not in m  # no routes, no routing metrics
    mixed = [foreign, dense_batch]  # routes, then none: the second routes live
    m = train_step(backend, one, mixed, 2, foreign, cfg.trainer, 0, mb_tokens + 5, version=7)
    assert m["applied"] and m["route_mismatch"] > 0
    assert all(not r._forward_hooks for r in routing.moe_routers(backend.model))  # closed


def test_keep_routing_on_a_dense_model_is_refused_at_trainer_start(tiny, moe_dir):
    from trainer.main import check_keep_routing

    cfg = OmegaConf.structured(Config)
    check_keep_routing(cfg, tiny)  # off: nothing to check
    cfg.sampling.keep_routing = True
    check_keep_routing(cfg, moe_dir)
    with pytest.raises(ValueError, match="dense model.*sampling.keep_routing=false") as e:
        check_keep_routing(cfg, tiny)
    assert "\n" not in str(e.value)


def test_route_settings_are_validated():
    from pipeline.config.preprocessor import validate_preprocessor
    from pipeline.config.trainer import validate_trainer

    cfg = OmegaConf.structured(Config)
    cfg.trainer.route_probe_every = -1
    with pytest.raises(ValueError, match="route_probe_every=-1 must be >= 0"):
        validate_trainer(cfg)
    cfg.trainer.route_probe_every = 0
    validate_trainer(cfg)
    cfg.preprocessor.reference.replay_routes = True
    with pytest.raises(ValueError, match="sampling.keep_routing=true, which is off"):
        validate_preprocessor(cfg)
    cfg.sampling.keep_routing = True
    validate_preprocessor(cfg)


def rollout_group(model, rng, shared: bool) -> tuple[RolloutGroup, list[np.ndarray]]:
    """A group of two samples with the model's own routes (``shared``: the prompt's rows
    once in prompt_routes); and each sample's full rows."""
    layout = routing.layout_of(model)
    prompt = rng.integers(10, 90, 5)
    samples, full = [], []
    for i, c in enumerate((4, 6)):
        s = sample(i, c, 0, 1.0 if i else -1.0, rng)
        seq = torch.from_numpy(np.concatenate([prompt, s.tokens()]).astype(np.int64))
        full.append(own_routes(model, seq[None, :-1])[0].numpy())
        s.routes = layout.pack(full[-1][len(prompt) :] if shared else full[-1])
        samples.append(s)
    g = RolloutGroup(
        schema=SCHEMA_VERSION,
        group_id="g",
        actor="a",
        problem_id="p",
        prompt_ids=pack_i32(prompt),
        samples=samples,
        temperature=1.0,
        route_layout=layout.as_list(),
        prompt_routes=layout.pack(full[0][: len(prompt)]) if shared else b"",
    )
    g.check()
    return g, full


def test_the_preprocessor_joins_prompt_routes_into_every_sample(models):
    from preprocessor.main import to_batches

    model = models["qwen3_moe"]
    g, full = rollout_group(model, np.random.default_rng(0), shared=True)
    (b,) = to_batches([g], 4096)
    b.check(model.config.vocab_size)
    layout = routing.layout_of(model)
    assert b.route_layout == layout.as_list()
    for s, want in zip(b.samples, full, strict=True):
        assert np.array_equal(layout.unpack(s.routes), want)
    assert len(g.samples[0].routes) < len(b.samples[0].routes)  # the group is untouched


def test_the_reference_can_replay_the_actors_routes(models):
    from preprocessor.scorers import ReferenceScorer
    from preprocessor.scoring import ScoredGroup

    model = models["qwen3_moe"]
    g, _ = rollout_group(model, np.random.default_rng(1), shared=True)
    own = ReferenceScorer(model, 0, 4096)
    replaying = ReferenceScorer(model, 0, 4096, replay_routes=True)
    own.score([ScoredGroup(g)])
    mine = [np.frombuffer(s.ref_logprobs, "<f4").copy() for s in g.samples]
    counts = replaying.score([ScoredGroup(g)])
    assert counts["reference_replayed_groups"] == 1
    same = [np.frombuffer(s.ref_logprobs, "<f4") for s in g.samples]
    for a, b in zip(mine, same, strict=True):  # its own routes: the same log-probs
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    layout = routing.layout_of(model)
    for i, s in enumerate(g.samples):  # another engine's routes: other log-probs
        s.routes = layout.pack(foreign_routes(layout, (1, len(s.routes) // 4), seed=i)[0])
    replaying.score([ScoredGroup(g)])
    moved = [np.frombuffer(s.ref_logprobs, "<f4") for s in g.samples]
    assert max(float(np.abs(a - b).max()) for a, b in zip(mine, moved, strict=True)) > 1e-4


@pytest.mark.slow
def test_zero3_on_two_ranks_replays_routes_as_the_torch_backend(olmoe_dir, tmp_path):
    """OLMoE: DeepSpeed 0.19 makes the Mixtral and Qwen-MoE blocks ZeRO-3 leaves on its
    own (zero_optimization.leaf_module), not OLMoE's, so this one shows the backend's."""
    moe_dir = olmoe_dir
    pytest.importorskip("deepspeed")
    from tests.deepspeed_builders import STEPS, assert_weights_match, run_ranks

    ref_w, ds_w = tmp_path / "torch.safetensors", tmp_path / "ds.safetensors"
    ref = run_ranks(
        tmp_path / "t.json",
        moe_dir,
        "torch",
        0,
        1,
        "--routes",
        "--weights",
        str(ref_w),
        tmp=tmp_path,
    )
    ds = run_ranks(
        tmp_path / "d.json",
        moe_dir,
        "deepspeed",
        3,
        2,
        "--routes",
        "--weights",
        str(ds_w),
        tmp=tmp_path,
    )
    assert ds["moe_leaves"] == 2  # each sparse MoE block is fetched whole
    assert len(ds["loss"]) == STEPS and all(m > 0.5 for m in ref["route_mismatch"])
    assert ds["route_mismatch"] == pytest.approx(ref["route_mismatch"], abs=1e-6)
    assert ref["kl_actor_free"][0] > 0 and ref["kl_actor_free"][1:] == [None] * (STEPS - 1)
    assert ds["kl_actor_free"][0] == pytest.approx(ref["kl_actor_free"][0], rel=1e-5)
    assert ds["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert ds["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert_weights_match(str(ds_w), str(ref_w), moe_dir)
