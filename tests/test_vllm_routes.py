"""The worker's route bookkeeping (actor/engines/vllm/worker/routes.py) on scheduler
outputs shaped like vLLM 0.32's V1 ones, without vLLM: what real vLLM cannot be made to
do on demand here (a preemption recomputed across a swap, a layer that did not capture,
a prefix-cache hit). The capture itself, the split by request and the placement by
position on real vLLM: tests/test_vllm_moe.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from actor.engines.vllm.worker.routes import StepRoutes

LAYERS, K = 2, 2


class Router:
    top_k = K

    def set_capture_fn(self, fn):
        self.fn = fn


class Runner(torch.nn.Module):
    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id, self.router = layer_id, Router()


def model():
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([Runner(0), Runner(1)])
    return m


def output(new=(), cached=(), finished=()):
    """A scheduler output: ``new`` = [(id, computed, n)], ``cached`` = [(id, computed, n)]."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], num_computed_tokens=[c for _, c, _ in cached]
        ),
        num_scheduled_tokens={r: n for r, _, n in (*new, *cached)},
        total_num_scheduled_tokens=sum(n for *_, n in (*new, *cached)),
        finished_req_ids=set(finished),
    )


def step(routes: StepRoutes, m, so, order, version, ids, skip_layer=None):
    """One forward: each layer's router captures ``ids`` ([tokens, k]) + the layer."""
    routes.begin(so)
    for col, runner in enumerate(m.layers):
        if col != skip_layer:
            runner.router.fn(torch.as_tensor(ids) + col)
    routes.end(so, order, version)


def rows_of(got: dict) -> np.ndarray:
    return np.frombuffer(got["rows"], dtype=np.uint8).reshape(got["shape"])


def test_rows_split_by_request_and_placed_by_position():
    """Two requests in one step (runner order b, a), chunked prefill of a, then decodes:
    each request's rows land at its own positions."""
    m = model()
    r = StepRoutes(m, 64, 8)
    step(r, m, output(new=[("a-12345678", 0, 3), ("b-12345678", 0, 2)]),
         ["b-12345678", "a-12345678"], 0, [[0, 1], [0, 2], [1, 2], [1, 3], [2, 3]])  # fmt: skip
    step(r, m, output(cached=[("a-12345678", 3, 2), ("b-12345678", 2, 1)]),
         ["a-12345678", "b-12345678"], 0, [[3, 4], [4, 5], [5, 6]])  # fmt: skip
    got = r.take(["a", "b"])
    a, b = rows_of(got["a"]), rows_of(got["b"])
    assert a.shape == (5, LAYERS, K) and b.shape == (3, LAYERS, K)
    assert a[:, 0].tolist() == [[1, 2], [1, 3], [2, 3], [3, 4], [4, 5]]
    assert b[:, 0].tolist() == [[0, 1], [0, 2], [5, 6]]
    assert a[:, 1].tolist() == [[2, 3], [2, 4], [3, 4], [4, 5], [5, 6]]  # layer 1: + 1
    assert got["a"]["exact"] and got["b"]["exact"]


@pytest.mark.parametrize(
    "version, ids, exact",
    [(0, [[0, 1], [0, 2]], True), (1, [[0, 1], [0, 2]], False), (0, [[0, 1], [6, 7]], False)],
)
def test_a_recompute_is_exact_only_when_nothing_changed(version, ids, exact):
    """Preempted and recomputed from position 0: exact when the recompute ran on the same
    version and routed the same; across a swap (or routed otherwise) inexact."""
    m = model()
    r = StepRoutes(m, 64, 8)
    step(r, m, output(new=[("a-12345678", 0, 2)]), ["a-12345678"], 0, [[0, 1], [0, 2]])
    step(r, m, output(cached=[("a-12345678", 0, 2)]), ["a-12345678"], version, ids)
    assert r.take(["a"])["a"]["exact"] is exact


def test_missing_rows_or_a_missed_layer_are_inexact():
    m = model()
    r = StepRoutes(m, 64, 8)
    # a prefix-cache hit: the first 2 positions never computed
    step(r, m, output(new=[("a-12345678", 2, 1)]), ["a-12345678"], 0, [[0, 1]])
    step(r, m, output(new=[("b-12345678", 0, 1)]), ["b-12345678"], 0, [[0, 1]], skip_layer=1)
    got = r.take(["a", "b"])
    assert got["a"]["shape"][0] == 3 and not got["a"]["exact"]
    assert not got["b"]["exact"]


def test_finished_requests_are_handed_over_once():
    """Taken before vLLM says it finished (the client's usual order): dropped at finish;
    finished first: kept until taken."""
    m = model()
    r = StepRoutes(m, 64, 8)
    step(r, m, output(new=[("a-12345678", 0, 1), ("b-12345678", 0, 1)]),
         ["a-12345678", "b-12345678"], 0, [[0, 1], [1, 2]])  # fmt: skip
    assert "a" in r.take(["a"])
    r.end(output(finished=["a-12345678", "b-12345678"]), [], 0)
    assert r.take(["a"]) == {}
    assert rows_of(r.take(["b"])["b"])[:, 0].tolist() == [[1, 2]]
    assert r.sizes() == {"running": 0, "taken": 0, "finished": 0, "errors": 0}


def test_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="sampling.keep_routing=false"):
        StepRoutes(torch.nn.Linear(2, 2), 64, 8)
