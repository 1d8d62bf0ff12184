"""Group-relative advantages, the no-signal filter and token-budget packing."""

import numpy as np

from preprocessor.shaping import group_advantages, has_signal, pack


def test_advantages_are_zero_mean_unit_std():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    np.testing.assert_allclose(adv, [1, -1, -1, 1], atol=1e-5)
    adv = group_advantages([0.0, 0.0, 0.0, 1.0])
    assert adv[3] > 0 > adv[0]
    assert abs(adv.sum()) < 1e-9


def test_no_signal_groups_are_detected():
    assert not has_signal([1.0, 1.0, 1.0])
    assert not has_signal([0.0, 0.0])
    assert has_signal([0.0, 1.0])
    np.testing.assert_allclose(group_advantages([1.0, 1.0]), [0.0, 0.0])


def test_pack_respects_budget_and_keeps_every_sample():
    lengths = [10, 50, 20, 30, 40, 5, 60, 25]
    batches = pack(lengths, token_budget=100)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 100


def test_pack_sorts_to_limit_padding():
    lengths = [5, 100, 5, 100]
    batches = pack(lengths, token_budget=200)
    assert sorted(sorted(lengths[i] for i in b) for b in batches) == [[5, 5], [100, 100]]


def test_oversized_sample_gets_its_own_batch():
    batches = pack([300, 10], token_budget=100)
    assert [0] in batches and [1] in batches
