"""The math task: generated problems, user files, prompts and the reward."""

import json

import pytest

from pipeline.models import TINY_MODEL, load_model, materialize_model
from pipeline.tasks import (
    ArithmeticTask,
    FileTask,
    Problem,
    RewardErrors,
    build_prompt_ids,
    make_task,
    reward,
    score,
)


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_arithmetic_answers_are_correct(difficulty):
    task = ArithmeticTask(difficulty, seed=3)
    for _ in range(50):
        problem = task.sample()
        expr = problem.question.removeprefix("What is ").removesuffix("?")
        assert str(eval(expr)) == problem.answer  # noqa: S307
        assert int(problem.answer) >= 0


def test_arithmetic_is_reproducible():
    first, second = ArithmeticTask(2, seed=7), ArithmeticTask(2, seed=7)
    assert [first.sample() for _ in range(20)] == [second.sample() for _ in range(20)]
    assert first.heldout(10) == second.heldout(10) == first.heldout(10)
    assert len({p.id for p in first.heldout(10)}) == 10


def test_make_task_rejects_unknown_kinds_and_levels(tmp_path):
    assert isinstance(make_task("arithmetic", 1, None, 0), ArithmeticTask)
    with pytest.raises(ValueError, match="arithmetic"):
        make_task("poetry", 1, None, 0)
    with pytest.raises(ValueError, match="path"):
        make_task("file", 1, None, 0)
    with pytest.raises(ValueError, match="difficulty"):
        make_task("arithmetic", 9, None, 0)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("The answer is 12.", 1.0),
        ("\\boxed{12}", 1.0),
        ("So 5 + 7 = \\boxed{12}, done", 1.0),
        ("5 + 7 = 12", 1.0),
        ("12.0", 1.0),
        ("The answer is 13.", 0.0),
        ("12 is wrong, the answer is 11", 0.0),
        ("", 0.0),
        ("no numbers at all", 0.0),
        ("\\boxed{", 0.0),
        ("}{}{\\boxed{\\frac{", 0.0),
        ("\x00\xff" * 50, 0.0),
    ],
)
def test_reward(completion, expected):
    assert reward(completion, "12") == expected


def test_reward_negative_and_thousands():
    assert reward("it is -3", "-3") == 1.0
    assert reward("7-3", "-3") == 0.0
    assert reward("total: 1,234", "1234") == 1.0


def test_score_names_the_error_when_checking_raises(monkeypatch):
    assert score("so 12", "12") == (1.0, None)
    assert score("no answer here", "12") == (0.0, None)  # a plain miss is not an error

    def broken(*_args, **_kwargs):
        raise RecursionError("deep")

    monkeypatch.setattr("math_verify.verify", broken)
    assert score("so 12", "12") == (0.0, "RecursionError")


def test_reward_errors_are_counted_per_reason_and_logged_rate_limited(caplog):
    errors = RewardErrors(log_every_s=3600)
    with caplog.at_level("WARNING", logger="pipeline.tasks"):
        for _ in range(3):
            errors.add("RecursionError", "so 12", "12")
        errors.add("TimeoutError", "so 12", "12")
    assert errors.counts == {"RecursionError": 3, "TimeoutError": 1}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # one line per reason within the interval, not one per error
    assert "RecursionError" in lines[0] and "TimeoutError" in lines[1]
    errors.log_every_s = 0.0
    with caplog.at_level("WARNING", logger="pipeline.tasks"):
        errors.add("RecursionError", "x", "12")
    assert "RecursionError 3 time(s)" in caplog.records[-1].getMessage()  # the 2 unlogged + 1


def test_file_task_reads_jsonl_with_gsm8k_answers(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "What is 1,000 + 234?", "answer": "#### 1,234"},
        {"question": "What is 2 + 2?", "answer": 4},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = FileTask(str(path), seed=1)
    seen = [task.sample() for _ in range(6)]
    assert {p.answer for p in seen[:3]} == {"7", "1234", "4"}
    assert sorted(p.id for p in seen[:3]) == sorted(p.id for p in seen[3:])
    assert isinstance(seen[0], Problem)


def test_file_task_reports_bad_rows(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "1 + 1?", "answer": "2"}\n{"question": "2 + 2?"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2.*'answer'"):
        FileTask(str(path), seed=0)
    path.write_text('{"question": "1 + 1?", "answer": "2"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2.*JSON"):
        FileTask(str(path), seed=0)
    with pytest.raises(ValueError, match="does not exist"):
        FileTask(str(tmp_path / "missing.jsonl"), seed=0)


def test_build_prompt_ids_uses_the_chat_template(tmp_path):
    _, tokenizer = load_model(materialize_model(TINY_MODEL, cache_dir=str(tmp_path)))
    ids = build_prompt_ids(tokenizer, "What is 2 + 3?", "Be brief.")
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.decode(build_prompt_ids(tokenizer, "Hi", None)).startswith("<|im_start|>user")
