"""A run whose weights never reach an actor is not "finished": the rules of
pipeline/run/summary.py's weight_problems, the live progress line, and (slow) a real
launcher run whose weight transfers all miss their deadline exiting 1."""

import json
import os
import subprocess
import sys
import time

import pytest

from pipeline.run.progress import Progress
from pipeline.run.summary import weight_problems
from pipeline.streams import Names
from tests.config_builders import actor_config
from tests.launching import ROOT, run_leftovers, run_tiny


def statuses(trainer_v: int, **actors: dict) -> dict[str, dict[str, str]]:
    out = {"trainer": {"role": "trainer", "version": str(trainer_v)}}
    for name, fields in actors.items():
        out[name.replace("_", "-")] = {"role": "actor", **{k: str(v) for k, v in fields.items()}}
    return out


def test_an_actor_that_applied_nothing_while_the_trainer_moved_on():
    st = statuses(3, actor_0=dict(version=0, weight_updates_applied=0))
    assert weight_problems(st, None) == ["actor-0 applied no weight version (trainer at v3)"]
    # live, the first version may simply not have arrived yet: not flagged
    assert weight_problems(st, None, at_end=False) == []
    assert weight_problems(statuses(0, actor_0=dict(version=0)), None) == []  # nothing made


def test_more_failed_than_applied_is_flagged_live_and_at_the_end():
    fields = dict(
        version=0,
        weight_updates_applied=1,
        weight_versions_offered=3,
        weight_versions_failed=2,
        last_error="RuntimeError: 0 rows",
    )
    st = statuses(3, actor_0=fields)
    want = [
        "actor-0 applied 1 weight versions; 2 of 3 sent failed (last error: RuntimeError: 0 rows)"
    ]
    assert weight_problems(st, None, at_end=False) == want
    assert weight_problems(st, None) == want
    # half or fewer failed: a flaky transfer, not starvation (versions the publisher
    # skipped or sent before the actor joined are never offered, so never count)
    fields.update(weight_updates_applied=2, version=3)
    assert weight_problems(statuses(3, actor_0=fields), 3) == []


def test_an_actor_left_on_an_older_version_than_the_newest_published():
    st = statuses(6, actor_0=dict(version=6, weight_updates_applied=4), actor_1=dict(version=2))
    st["actor-1"]["weight_updates_applied"] = "1"  # joined late: one catch-up, then stuck
    assert weight_problems(st, 6) == ["actor-1 ended on v2; the newest published is v6"]
    assert weight_problems(st, 6, at_end=False) == []
    assert weight_problems(st, 2) == []  # v6 never reached any actor: nothing to hold
    # a relaunch whose trainer ran to v4 on leftover data before the (restarted) actor
    # joined: the published key still says v2 from the first launch, the actor is on v0
    relaunch = statuses(4, actor_0=dict(version=0, weight_updates_applied=2))
    assert weight_problems(relaunch, 2) == []


def test_an_actor_holding_partial_weights():
    """An in-place update that failed leaves version "None" in the status hash."""
    st = statuses(4, actor_0=dict(version="None", weight_updates_applied=3))
    assert weight_problems(st, 4) == [
        "actor-0 ended on partial weights (an in-place update failed)"
    ]
    assert "lag 0" in Progress.line(st, 10, 1.0)  # no whole version: no lag to show


def test_the_progress_line_shows_the_published_version_and_starved_actors():
    st = statuses(
        2,
        actor_0=dict(
            version=0, weight_updates_applied=0, weight_versions_offered=2, weight_versions_failed=2
        ),
        actor_1=dict(version=2, weight_updates_applied=2),
    )
    line = Progress.line(st, 10, 5.0, published=2)
    assert "trainer v2 published v2 actors v0,2" in line
    assert line.endswith(
        "WEIGHTS NOT ARRIVING: actor-0 applied 0 weight versions; 2 of 2 sent failed"
    )
    st["actor-0"]["weight_versions_failed"] = "0"
    assert "WEIGHTS" not in Progress.line(st, 10, 5.0)


def test_a_batch_job_gives_an_actor_still_joining_the_last_version_before_stopping_it(
    redis_server, rclient, tmp_path
):
    """deploy/slurm/run.sbatch's ``python -m pipeline.run.batch_end sync`` after its
    trainer exits 0: it waits (``launch.final_sync_timeout_s``) while an actor is behind
    the trainer's last version and returns once that actor has it, as the launcher does.
    Without it a Slurm job of 6 steps stopped an actor that was still joining the weight
    transfer and failed "actor-0 applied no weight version (trainer at v6)"."""
    config = actor_config(
        tmp_path, redis_server.url, "trainer.max_steps=6", "launch.final_sync_timeout_s=30"
    )
    names = Names("nonstop", "tiny")
    for name, role, version in (("trainer", "trainer", 6), ("actor-0", "actor", 0)):
        rclient.hset(names.status(name), mapping={"role": role, "version": version})
    env = dict(os.environ, NONSTOP_CONFIG=config, NONSTOP_REDIS_URL=redis_server.url)
    env |= {"NONSTOP_RUN": "tiny", "NONSTOP_RUN_DIR": str(tmp_path)}
    sync = [sys.executable, "-m", "pipeline.run.batch_end", "sync"]
    proc = subprocess.Popen(sync, cwd=ROOT, env=env)
    try:
        time.sleep(3)  # the module's import and a few status reads
        assert proc.poll() is None, "returned while actor-0 was on v0 and the trainer on v6"
        rclient.hset(names.status("actor-0"), "version", 6)  # sent v6 on joining
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
    bad = subprocess.run([*sync[:-1], "syncc"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "sync|summary" in bad.stderr


@pytest.mark.slow
def test_a_run_whose_weights_never_arrive_exits_1(tmp_path):
    """Every transfer misses its deadline (weights announced, buckets never in time): the
    trainer finishes its steps, yet the launcher says the weights did not arrive, exits 1,
    and summary.json's outcome says so too."""
    run_dir = tmp_path / "run"
    code, out = run_tiny(
        tmp_path,
        run_dir,
        "trainer.max_steps=3",
        "trainer.transfer_timeout_s=0.001",
        "launch.final_sync_timeout_s=2",
        timeout=300,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_steps"] == 3, out
    assert code == 1, out
    assert summary["outcome"].startswith("failed: weights did not reach the actors: actor-0"), out
    assert summary["weight_updates_applied"] == {"actor-0": 0}
    assert summary["weight_problems"] and "run failed: weights did not reach" in out
    assert run_leftovers(run_dir) == []
