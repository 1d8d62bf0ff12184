"""Several trainer ranks started, named, failed and restarted as one group:
by the launcher (pipeline/run/supervisor.py) and by deploy/bin/nonstop-pool (torchrun)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.telemetry import read_jsonl
from tests.launching import launch_tiny, wait_for_step
from tests.listen_builders import CONFIGURED, ListenerWatch

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"

STAND_IN = """
import os, sys, time
rank = os.environ["RANK"]
with open(f"rank-{rank}.txt", "w") as f:
    f.write(" ".join([rank, os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]] + sys.argv[1:]))
if rank == "1" and os.environ.get("FAIL_RANK_1"):
    sys.exit(1)
time.sleep(float(os.environ.get("STAND_IN_S", "0")))
"""


def _pool(tmp_path, **env_extra) -> subprocess.CompletedProcess:
    config = tmp_path / "config.yaml"
    config.write_text("run:\n  name: x\n")
    (tmp_path / "trainer.py").write_text(STAND_IN)  # a stand-in "trainer" module
    env = dict(
        os.environ,
        NONSTOP_PYTHON=sys.executable,
        NONSTOP_CONFIG=str(config),
        NONSTOP_REDIS_URL="redis://:pw@127.0.0.1:1/0",
        NONSTOP_TRAINER_RANKS="2",
        PYTHONPATH=str(tmp_path),
        **env_extra,
    )
    return subprocess.run(
        [DEPLOY / "bin" / "nonstop-pool", "trainer", "trainer", "trainer.lr=0.1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_pool_script_starts_the_trainer_ranks_under_torchrun(tmp_path):
    out = _pool(tmp_path)
    assert out.returncode == 0, out.stderr
    ranks = [(tmp_path / f"rank-{r}.txt").read_text().split() for r in (0, 1)]
    assert [r[:2] for r in ranks] == [["0", "2"], ["1", "2"]]
    assert ranks[0][2] == ranks[1][2]  # one rendezvous port
    for r in ranks:
        assert r[3:7] == ["--config", str(tmp_path / "config.yaml"), "--name", "trainer"]
        assert "trainer.world_size=2" in r and r[-1] == "trainer.lr=0.1"


def test_one_failed_rank_stops_the_group_under_torchrun(tmp_path):
    t0 = time.monotonic()
    out = _pool(tmp_path, FAIL_RANK_1="1", STAND_IN_S="100")
    assert out.returncode != 0  # the unit (Restart=on-failure) then restarts the group
    assert time.monotonic() - t0 < 60  # rank 0 was stopped, not waited for


@pytest.mark.slow
def test_killed_rank_restarts_the_deepspeed_group_from_its_checkpoint(tmp_path, wrap):
    """ZeRO-2 on 2 ranks: SIGKILL rank 1 after a checkpoint; the launcher restarts both
    ranks, they resume from the checkpoint and the run finishes with nothing trained twice
    in the surviving steps and nothing lost. Also: every listener of the run
    (tests/listen_builders.py, in ``wrap``'s namespace where this host's name resolves
    off loopback), both ranks' among them, is on 127.0.0.1 for the whole run (checked
    to fail with ``listen_on_master_addr`` a no-op: the ranks' gloo devices listen on the
    network address)."""
    pytest.importorskip("deepspeed")
    run_dir = tmp_path / "run"
    proc = launch_tiny(
        tmp_path,
        run_dir,
        "trainer.backend=deepspeed",
        "trainer.zero_stage=2",
        "trainer.world_size=2",
        "trainer.max_steps=6",
        "trainer.checkpoint_every=2",
        wrap=wrap,
    )
    listeners = ListenerWatch(proc, run_dir).start()
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for_step(run_dir, proc, timeout=180)
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoints" / "latest").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
        victims = [p for p in pids if f"{run_dir}/config.yaml --name trainer-1" in _cmdline(p)]
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        listeners.stop()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "restarting its group trainer (2 ranks)" in out
    listeners.check(CONFIGURED, {"redis-server", "trainer", "trainer-1", "actor-0"}, out)
    records = read_jsonl(str(metrics))
    restarts = [r for r in records if r.get("event") == "restart"]
    assert [r["target"] for r in restarts] == ["trainer"]
    assert any(r.get("event") == "resume" for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_steps"] == 6
    # a DeepSpeed run says it is one: the trainer's first log line and summary.json
    setup = "backend=deepspeed zero_stage=2 world_size=2 dtype=float32 device=cpu"
    logged = (run_dir / "logs" / "trainer.log").read_text().splitlines()
    assert setup in next(line for line in logged if " INFO " in line), logged[:5]
    assert summary["trainer_setup"] == {
        "backend": "deepspeed", "zero_stage": 2, "world_size": 2, "dtype": "float32",
        "device": "cpu",
    }  # fmt: skip
    from pipeline.telemetry import surviving_steps

    trained = [sid for r in surviving_steps(records) for sid in r["sample_ids"]]
    assert len(trained) == len(set(trained))  # no sample trained twice


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
