"""Step-level process rewards: segmentation, the arithmetic verifier, and the
per-token advantages step rewards become (mixed with the outcome advantage)."""

import numpy as np
import pytest

from pipeline.messages import Sample, pack_f32, pack_i32, rle_encode, unpack_f32
from pipeline.models import load_model, materialize_model
from preprocessor.equations import check_equations, step_reward
from preprocessor.prm import ArithmeticPRM, process_advantages, segment
from preprocessor.scoring import ScoredGroup
from preprocessor.shaping import mix_advantages, set_advantages

CORRECT = "We add first.\n3 + 4 = 7\n7 * 2 = 14\n14 - 5 = 9\nThe answer is 9."
WRONG = "We add first.\n3 + 4 = 7\n12 - 5 = 8\n8 + 1 = 9\nThe answer is 9."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_model(materialize_model("tiny", str(tmp_path_factory.mktemp("m"))))[1]


def test_verifier_accepts_correct_and_rejects_wrong_equations():
    assert check_equations("3 + 4 = 7") == [True]
    assert check_equations("12 - 5 = 8") == [False]
    assert check_equations("so 2 * (3 + 4) = 14 and 14 / 4 = 3.5") == [True, True]
    assert check_equations("2 + 3 = 5 = 10 / 2 = 6") == [True, True, False]
    assert check_equations("6 + 4 equals 10, and 3 x 4 = 12") == [True, True]
    assert check_equations("10 / 3 = 3.33") == [True]  # rounded to what is stated
    assert check_equations("10 / 3 = 3.5") == [False]
    assert check_equations("-3 + 5 = 2, 5 - -3 = 8, 1,000 + 2 = 1,002") == [True] * 3
    assert check_equations("The sum 6 + 6 = 12 is well known.") == [True]


def test_verifier_gives_no_verdict_without_a_checkable_equation():
    for text in ("The answer is 9.", "x = 5", "0 + 4 = ?", "", "Step 1: think"):
        assert check_equations(text) == []
        assert step_reward(text) is None
    assert True not in check_equations("12 / 0 = 1")  # never raises, never holds
    assert check_equations("the total - 4 = 3") == []  # its left side lost an operand
    assert check_equations("9" * 40 + " + 1 = 2") == []  # over-long numbers are skipped


def test_step_reward_of_hand_written_derivations():
    correct = [step_reward(line) for line in CORRECT.splitlines()]
    wrong = [step_reward(line) for line in WRONG.splitlines()]
    assert correct == [None, 1.0, 1.0, 1.0, None]
    assert wrong == [None, 1.0, 0.0, 1.0, None]  # "8 + 1 = 9" holds, even after a slip


def test_segment_by_line_and_by_delimiter_maps_steps_to_tokens():
    pieces = ["3 +", " 4 = 7", "\n", "\n", "7 * 2", " = 14", "\r\n", "done"]
    steps = segment(pieces)
    assert [s.text for s in steps] == ["3 + 4 = 7", "7 * 2 = 14", "done"]
    assert [s.last_token for s in steps] == [1, 5, 7]
    steps = segment(["a = 1;", " b", " = 2;", ";", " c"], delimiter=";")
    assert [s.text for s in steps] == ["a = 1", "b = 2", "c"]
    assert [s.last_token for s in steps] == [0, 2, 4]
    with pytest.raises(ValueError, match="delimiter"):
        segment(["x"], delimiter="")


def test_process_advantages_sum_the_normalised_rewards_of_later_steps():
    # sample 0: steps ending at tokens 1 (right) and 3 (right); sample 1: 1 (right), 3 (wrong)
    adv = process_advantages([[(1, 1.0), (3, 1.0)], [(1, 1.0), (3, 0.0)]], [5, 4])
    mean, std = 0.75, np.std([1, 1, 1, 0])
    up, down = (1 - mean) / (std + 1e-6), (0 - mean) / (std + 1e-6)
    np.testing.assert_allclose(adv[0], [2 * up, 2 * up, up, up, 0], rtol=1e-5)
    np.testing.assert_allclose(adv[1], [up + down] * 2 + [down] * 2, rtol=1e-5)
    assert adv[1][3] < 0 < adv[0][3]  # the wrong step's tokens are pushed down
    none = process_advantages([[], []], [3, 2])
    assert all(not a.any() for a in none)


def test_mixing_weight_blends_outcome_and_step_advantages():
    outcome = np.array([1.0, -1.0])
    steps = [np.array([2.0, 0.0, -2.0]), np.array([4.0, 4.0])]
    lengths = [3, 2]
    only_outcome = mix_advantages(outcome, lengths, {"prm": steps}, {"prm": 0.0})
    np.testing.assert_allclose(only_outcome[0], [1, 1, 1])
    only_steps = mix_advantages(outcome, lengths, {"prm": steps}, {"prm": 1.0})
    np.testing.assert_allclose(only_steps[1], [4, 4])
    half = mix_advantages(outcome, lengths, {"prm": steps}, {"prm": 0.25})
    np.testing.assert_allclose(half[0], [0.75 + 0.5, 0.75, 0.75 - 0.5])
    np.testing.assert_allclose(half[1], [-0.75 + 1.0] * 2)


def _sample(tokenizer, index, text, reward):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Sample(
        index=index,
        completion_ids=pack_i32(ids),
        logprobs=pack_f32([-1.0] * len(ids)),
        versions=rle_encode([0] * len(ids)),
        reward=reward,
        finished=True,
    )


def test_arithmetic_prm_turns_a_wrong_step_into_negative_token_advantages(tokenizer):
    from pipeline.messages import SCHEMA_VERSION, RolloutGroup

    samples = [_sample(tokenizer, 0, CORRECT, 1.0), _sample(tokenizer, 1, WRONG, 1.0)]
    group = RolloutGroup(
        schema=SCHEMA_VERSION,
        group_id="g",
        actor="a",
        problem_id="p",
        prompt_ids=pack_i32([3, 4]),
        samples=samples,
        temperature=1.0,
    )
    item = ScoredGroup(group)
    prm = ArithmeticPRM(tokenizer, "line", weight=1.0)
    counts = prm.score([item])
    assert counts == {"prm_scored_groups": 1, "prm_scored_steps": 6}
    # equal outcome rewards: only the step rewards carry signal, and they keep the group
    assert set_advantages(group.samples, item.dense, {"prm": prm.weight})
    right, wrong = (unpack_f32(s.token_advantages) for s in group.samples)
    assert len(right) == len(samples[0].tokens()) and len(wrong) == len(samples[1].tokens())
    slip = WRONG.index("12 - 5 = 8")
    after = WRONG.index("8 + 1 = 9")
    assert wrong[slip] < 0 < right[slip]  # tokens before the wrong step lose credit
    assert wrong[after] == pytest.approx(right[after])  # after it, both derivations agree
    assert right[-1] == wrong[-1] == 0.0  # no scored step ends in the last line
    assert {s.advantage for s in group.samples} == {0.0}  # outcome part: a tie
