"""Group-relative advantages, the no-signal filter and token-budget packing."""

import numpy as np

from preprocessor.shaping import group_advantages, has_signal, pack, pack_whole_groups


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


def _first_step(entries: list[list[tuple[int, int]]], samples_per_step: int) -> list:
    """The (group, sample) pairs a trainer step takes: entries in order until a step's
    worth (trainer/batches.py collect)."""
    taken: list = []
    for e in entries:
        if len(taken) >= samples_per_step:
            break
        taken += e
    return taken


def test_whole_groups_keep_a_groups_long_samples_in_its_step():
    # three groups of four, each with one long answer; budget for about four rows
    lengths = [[10, 12, 11, 60], [9, 10, 58, 12], [11, 62, 10, 9]]
    by_sample = pack([n for g in lengths for n in g], token_budget=250)
    flat = [(g, i) for g in range(3) for i in range(4)]
    old = _first_step([[flat[k] for k in b] for b in by_sample], samples_per_step=6)
    # packing samples by length: the step takes short samples of every group and leaves
    # their long ones for a later step (one version older there: the first to be stale)
    assert {g for g, _ in old} == {0, 1, 2} and all(lengths[g][i] < 20 for g, i in old)
    whole = pack_whole_groups(lengths, token_budget=250)
    assert sorted(p for b in whole for p in b) == flat  # every sample exactly once
    for b in whole:
        for g in {g for g, _ in b}:
            assert sorted(i for gg, i in b if gg == g) == [0, 1, 2, 3]  # never a part
        assert len(b) * max(lengths[g][i] for g, i in b) <= 250
    taken = _first_step(whole, samples_per_step=6)
    for g in {g for g, _ in taken}:
        assert sum(gg == g for gg, _ in taken) == 4


def test_a_group_over_the_budget_gets_micro_batches_of_its_own():
    whole = pack_whole_groups([[10, 10], [100, 90, 80], [12, 11]], token_budget=120)
    big = [b for b in whole if any(g == 1 for g, _ in b)]
    assert all(all(g == 1 for g, _ in b) for b in big)
    assert sorted(i for b in big for _, i in b) == [0, 1, 2]
