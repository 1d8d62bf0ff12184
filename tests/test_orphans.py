"""Processes started under an actor end when it is SIGKILLed (actor/orphans.py),
without the launcher: a multiprocessing child that loads the plugin, and (real vLLM)
the engine core and worker of a VLLMEngine whose process is SIGKILLed."""

import os
import signal
import subprocess
import sys
import uuid

import pytest

from tests.launching import ROOT, marked_processes, wait_until

# a parent: a spawned multiprocessing child that calls the vLLM plugin hook and sleeps;
# "<parent pid> <child pid>" on stdout once the child runs
PARENT = """
import multiprocessing, os, sys, time

def child(q):
    from actor.orphans import vllm_plugin
    vllm_plugin()
    q.put(os.getpid())
    time.sleep(600)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    ctx.Process(target=child, args=(q,)).start()
    print(os.getpid(), q.get(timeout=60), flush=True)
    time.sleep(600)
"""

# a VLLMEngine (real vLLM) in a process of its own; "up" on stdout once it generated
ENGINE = """
import sys
if __name__ == "__main__":
    sys.path.insert(0, "")  # the repository (cwd): tests.vllm_real
    from tests.vllm_real import save_tiny, start_engine
    engine = start_engine(save_tiny(sys.argv[1]))
    engine.generate([[1, 2, 3]], 4)
    print("up", flush=True)
    sys.stdin.read()
"""


def start(script: str, *args: str, env: dict[str, str], tmp_path) -> subprocess.Popen:
    """Run ``script`` from a file (multiprocessing's spawn re-imports the main module)."""
    path = tmp_path / f"script_{uuid.uuid4().hex[:8]}.py"
    path.write_text(script)
    return subprocess.Popen(
        [sys.executable, str(path), *args],
        cwd=ROOT,
        env=dict(os.environ, **env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def kill_marked(marker: str) -> None:
    for pid in marked_processes("NONSTOP_TEST_MARK", marker):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("watch", [True, False])
def test_a_child_with_the_plugin_dies_with_its_sigkilled_parent(watch, tmp_path):
    marker = uuid.uuid4().hex
    env = {"NONSTOP_TEST_MARK": marker, "NONSTOP_DIE_WITH_PARENT": "1" if watch else "0"}
    proc = start(PARENT, env=env, tmp_path=tmp_path)
    try:
        parent, child = map(int, proc.stdout.readline().split())
        os.kill(parent, signal.SIGKILL)
        proc.wait()
        if watch:
            wait_until(lambda: not marked_processes("NONSTOP_TEST_MARK", marker), 10)
        else:  # without the marker variable the plugin does nothing: the child lives on
            assert child in marked_processes("NONSTOP_TEST_MARK", marker)
    finally:
        kill_marked(marker)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_core_and_worker_die_with_a_sigkilled_actor(tmp_path):
    """No launcher, no process group: SIGKILL the process that runs the engine alone."""
    marker = uuid.uuid4().hex
    env = {
        "NONSTOP_TEST_MARK": marker,
        "NONSTOP_DIE_WITH_PARENT": "1",  # what python -m actor sets
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    proc = start(ENGINE, str(tmp_path / "model"), env=env, tmp_path=tmp_path)
    try:
        lines = iter(proc.stdout.readline, "")  # up to EOF: other lines are warnings
        assert any(line.strip() == "up" for line in lines), "the engine did not start"
        vllm = [p for p in marked_processes("NONSTOP_TEST_MARK", marker) if p != proc.pid]
        assert len(vllm) >= 2, vllm  # VLLM::EngineCore and its VLLM::Worker
        proc.kill()  # the engine's process alone: its group lives on
        proc.wait()
        wait_until(lambda: not marked_processes("NONSTOP_TEST_MARK", marker), 15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_marked(marker)
