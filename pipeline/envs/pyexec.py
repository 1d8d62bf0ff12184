"""``pyexec``: python code the model writes, run in a separate process.

The model writes ``<python>print(6 * 7)</python>`` (``</python>`` is the stop
string); the code runs in a fresh ``python -I -S`` (isolated: no user site, no
environment variables, no ``site``) process of its own session and process group,
which first sets its rlimits - CPU seconds (``cpu_s``: SIGXCPU, SIGKILL 1 s later), address space
(``memory_mb``), no core files, file size (``file_mb``) - and then runs the code
read from stdin. Its stdout and stderr together, at most ``output_bytes``, are the
observation ``<output>...</output>``. Past the call's wall-clock limit (the
ToolBox's, pipeline/envs/tools.py) the whole process group is SIGKILLed and reaped:
no process outlives its call, whatever it forked. Outcomes: ``ok``; ``error``
(non-zero exit, e.g. an exception or MemoryError); ``timeout`` (wall clock, or the
CPU rlimit's SIGXCPU); ``oversized`` (output past ``output_bytes``, cut); ``infra``
(the interpreter would not start, or died by a signal nobody sent it for a limit).

The problems are calc's (pipeline/envs/calc.py): the final number of the last turn
is the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time

from pipeline.envs import Environment, Step, Turn
from pipeline.envs.calc import CalcTasks, arithmetic_tasks
from pipeline.envs.tools import ToolResult, error_text
from pipeline.tasks import Problem, score

SYSTEM_PROMPT = (
    "You can run python. Write <python>code</python> and stop; you will be given "
    "<output>what it printed</output>. When you know the answer, reply with the final number."
)
# runs first in the child: limits, then the code from stdin (-I -S: nothing else loads)
PRELUDE = (
    "import resource as r, sys\n"
    "cpu, mem, fsize = (int(a) for a in sys.argv[1:4])\n"
    "r.setrlimit(r.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu s, SIGKILL a second later\n"
    "r.setrlimit(r.RLIMIT_AS, (mem, mem))\n"
    "r.setrlimit(r.RLIMIT_CORE, (0, 0))\n"
    "r.setrlimit(r.RLIMIT_FSIZE, (fsize, fsize))\n"
    "code = sys.stdin.read()\n"
    "del cpu, mem, fsize, r\n"
    "exec(compile(code, '<python>', 'exec'), {'__name__': '__main__'})\n"
)


async def run_python(
    code: str,
    timeout_s: float,
    cpu_s: int = 2,
    memory_mb: int = 256,
    file_mb: int = 1,
    output_bytes: int = 4096,
    python: str = sys.executable,
) -> ToolResult:
    """Run ``code`` in its own ``python -I -S`` process group under the limits."""
    args = [str(cpu_s), str(memory_mb << 20), str(file_mb << 20)]
    t0 = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            python, "-I", "-S", "-c", PRELUDE, *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed whole
        )  # fmt: skip
    except OSError as e:
        return ToolResult("infra", error_text(f"the python sandbox did not start: {e}"), True)
    timed_out = False
    try:
        try:
            out = await asyncio.wait_for(_talk(proc, code, output_bytes), timeout_s)
        except TimeoutError:
            timed_out, out = True, b""
    finally:  # on time-out, on cancellation, and after a normal exit (its children too)
        _kill_group(proc.pid)
        await proc.wait()
    text = out[:output_bytes].decode("utf-8", "replace")
    code_ = proc.returncode
    if timed_out:
        return ToolResult("timeout", error_text(f"killed after {timeout_s:g} s of wall clock"))
    if len(out) > output_bytes:  # cut, and the group killed for it
        return ToolResult("oversized", f"<output>{text}</output>")
    cpu_kill = code_ == -signal.SIGKILL and time.monotonic() - t0 >= cpu_s  # the hard limit
    if code_ == -signal.SIGXCPU or cpu_kill:
        return ToolResult("timeout", error_text(f"killed after {cpu_s} s of CPU time"))
    if code_ is not None and code_ < 0:
        name = signal.Signals(-code_).name
        return ToolResult("infra", error_text(f"the python process died ({name})"), True)
    if code_ != 0:
        return ToolResult("error", f"<output>{text.strip()[-500:]}</output>")
    return ToolResult("ok", f"<output>{text.strip()}</output>")


async def _talk(proc, code: str, limit: int) -> bytes:
    """Send the code, read at most ``limit`` + 1 bytes of output, then wait for the exit."""
    proc.stdin.write(code.encode())
    await proc.stdin.drain()
    proc.stdin.close()
    out = b""
    while len(out) <= limit:
        chunk = await proc.stdout.read(65536)
        if not chunk:
            break
        out += chunk
    if len(out) > limit:
        return out  # too much: the caller kills the group; no need to wait
    await proc.wait()
    return out


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pgid, signal.SIGKILL)


class PyExecEnv(Environment):
    stop = ("</python>",)

    @classmethod
    def tasks(cls, settings, seed: int) -> CalcTasks:
        return arithmetic_tasks(settings, seed)

    async def reset(self, problem: Problem) -> list[dict]:
        self.problem = problem
        system = self.settings.get("system_prompt", SYSTEM_PROMPT)
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": problem.question},
        ]

    async def step(self, turn: Turn) -> Step:
        if turn.ended != "stop":
            return Step(reward=score(turn.text, self.problem.answer)[0], done=True)
        start, end = turn.text.rfind("<python>"), turn.text.rfind("</python>")
        if start < 0 or start > end:
            result = self.tools.count(
                ToolResult("malformed", error_text("</python> without <python>"))
            )
        else:
            code = turn.text[start + len("<python>") : end]
            s = self.settings
            result = await self.tools.run(
                lambda timeout: run_python(
                    code,
                    timeout,
                    int(s.get("cpu_s", 2)),
                    int(s.get("memory_mb", 256)),
                    int(s.get("file_mb", 1)),
                    int(s.get("output_bytes", 4096)),
                )
            )
        return Step(observation=result.text, outcome=result.outcome, infra=result.infra)
