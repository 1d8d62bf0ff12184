"""The shipped environments and the tool budgets: calc's whitelist evaluator (never
eval), every bad-call kind answered as an observation and counted, pyexec in its own
``python -I -S`` process group (a hung program killed within its limit, no process
left, the other calls not held up), infra failures marked, and task.kind=env's
config checks."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from omegaconf import OmegaConf

from pipeline.config import Config
from pipeline.config.schema import validate
from pipeline.envs import Environment, Turn, load_env
from pipeline.envs.calc import CalcEnv, CalcError, evaluate
from pipeline.envs.pyexec import PyExecEnv, run_python
from pipeline.envs.tools import ToolBox, ToolLimits, ToolResult
from pipeline.tasks import Problem

PROBLEM = Problem(id="p", question="What is 17 * 23 + 4?", answer="395")


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(
    "expression, value", [("17*23", 391), ("(2+3)*-4", -20), ("7/2", 3.5), ("2**10 % 7", 2)]
)
def test_calc_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("'a' * 3", "Constant is not allowed"),
        ("9 ** 99", "exponent larger than 64"),
        ("10 ** 20 * 10 ** 20", "value out of range"),
        ("1 / 0", "division by zero"),
        ("1" * 300, "longer than 200"),
    ],
)
def test_calc_refuses_everything_but_arithmetic(expression, reason):
    with pytest.raises(CalcError, match=reason):
        evaluate(expression)


def _env(cls=CalcEnv, **limits):
    env = cls({}, ToolBox(ToolLimits(**limits)))
    run(env.reset(PROBLEM))
    return env


@pytest.mark.parametrize(
    "text, ended, outcome, observation",
    [
        ("<calc>17*23</calc>", "stop", "ok", "<result>391</result>"),
        ("I will compute 17*23</calc>", "stop", "malformed", "</calc> without <calc>"),
        ("<calc>17*</calc>", "stop", "malformed", "cannot parse"),
        ("<calc>1/0</calc>", "stop", "error", "division by zero"),
        ("<calc>open('x')</calc>", "stop", "error", "Call is not allowed"),
        ("<search>17*23</search>", "eos", "unknown_tool", "unknown tool 'search'"),
    ],
)
def test_each_bad_call_kind_is_an_observation_and_counted(text, ended, outcome, observation):
    env = _env()
    step = run(env.step(Turn(text, ended)))
    assert step.outcome == outcome and not step.done and observation in step.observation
    assert env.tools.counts[outcome] == 1


def test_calc_scores_the_final_turn_and_the_budget_answers_past_it():
    env = _env(max_tool_calls=1)
    assert run(env.step(Turn("<calc>17*23+4</calc>", "stop"))).outcome == "ok"
    spent = run(env.step(Turn("<calc>1+1</calc>", "stop")))
    assert spent.outcome == "budget" and "1 tool calls used" in spent.observation
    assert run(env.step(Turn("The answer is 395.", "eos"))).reward == 1.0
    assert run(_env().step(Turn("It is 394.", "eos"))).reward == 0.0
    assert dict(env.tools.counts) == {"ok": 1, "budget": 1}


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_pyexec_runs_code_isolated_and_reports_its_output():
    result = run(run_python("import sys; print(6 * 7, sys.flags.isolated, sys.flags.no_site)", 5))
    assert (result.outcome, result.text) == ("ok", "<output>42 1 1</output>")
    err = run(run_python("raise ValueError('boom')", 5))
    assert err.outcome == "error" and "ValueError: boom" in err.text
    big = run(run_python("print('x' * 100_000)", 5, output_bytes=100))
    assert big.outcome == "oversized" and len(big.text) < 200
    mem = run(run_python("b = bytearray(10**9)", 5, memory_mb=128))
    assert mem.outcome == "error" and "MemoryError" in mem.text


def test_a_hung_program_is_killed_within_its_limit_with_its_children_and_others_go_on():
    async def both():
        spawned = []

        async def hung(timeout):
            # forks a sleeper into the same process group, then spins
            code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nwhile True: pass"
            t0 = time.monotonic()
            result = await run_python(code, timeout, cpu_s=30)
            spawned.append(time.monotonic() - t0)
            return result

        box = ToolBox(ToolLimits(call_timeout_s=2.0, concurrency=2))
        other = ToolBox(ToolLimits(), box.gate)
        t0 = time.monotonic()
        slow = asyncio.ensure_future(box.run(hung))
        await asyncio.sleep(0.2)
        quick = await other.run(lambda t: run_python("print(1)", t))
        quick_s = time.monotonic() - t0
        return await slow, quick, quick_s, spawned

    before = set(_python_children())
    slow, quick, quick_s, took = run(both())
    assert slow.outcome == "timeout" and quick.outcome == "ok"
    assert quick_s < 1.5  # the other call did not wait for the hung one
    assert took[0] < 2.0 + 1.0  # its limit plus a margin
    time.sleep(0.2)
    assert set(_python_children()) <= before  # nothing left running, the fork included


def _python_children() -> list[int]:
    """Processes whose command line runs the pyexec prelude."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"RLIMIT_CPU" in f.read():
                        out.append(int(pid))
            except OSError:
                pass
    return out


def test_a_cpu_bound_program_hits_its_cpu_limit():
    result = run(run_python("while True: pass", 10, cpu_s=1))
    assert result.outcome == "timeout" and "CPU time" in result.text


def test_a_sandbox_that_does_not_start_is_an_infra_failure_not_a_wrong_answer():
    result = run(run_python("print(1)", 5, python="/nonexistent/python3"))
    assert result.outcome == "infra" and result.infra
    env = PyExecEnv({}, ToolBox(ToolLimits()))
    run(env.reset(PROBLEM))
    step = run(env.step(Turn("<python>print(17*23+4)</python>", "stop")))
    assert (step.outcome, step.observation, step.infra) == ("ok", "<output>395</output>", False)


def test_a_tool_that_raises_is_an_error_observation():
    async def broken(_timeout):
        raise RuntimeError("tool bug")

    box = ToolBox(ToolLimits())
    result = run(box.run(broken))
    assert result == ToolResult("error", "<error>RuntimeError: tool bug</error>")


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"task.env": ""}, "task.kind=env needs task.env"),
        ({"task.env": "nowhere.module:Env"}, "cannot load nowhere.module:Env"),
        ({"task.env": "calc"}, None),
        ({"task.env": "pipeline.envs.calc:CalcEnv"}, None),
        ({"task.episode.max_turns": 0}, "task.episode.max_turns=0 must be > 0"),
        ({"task.episode.call_timeout_s": 0.0}, "call_timeout_s=0.0 must be > 0"),
        ({"task.episode.max_tokens": 8}, "below sampling.max_new_tokens"),
        ({"preprocessor.scorers": ["prm"]}, "does not read episodes"),
    ],
)
def test_task_kind_env_config_is_checked(changes, reason):
    cfg = OmegaConf.structured(Config)
    cfg.task.kind, cfg.task.env = "env", "calc"
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value)
    if reason is None:
        validate(cfg)
        assert load_env(cfg.task.env) is CalcEnv
        return
    with pytest.raises(ValueError, match=reason):
        validate(cfg)


class HalfEnv(Environment):
    """An environment that forgot step() and tasks()."""

    async def reset(self, problem):
        return []


def test_an_environment_missing_part_of_the_contract_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"does not define step, tasks\(\)"):
        load_env("tests.test_envs:HalfEnv")
