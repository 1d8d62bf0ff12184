"""``python -m pipeline.inspect`` against a live run: the launcher and every pool
as real processes on a tiny model, inspected while they work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from pipeline.streams import wait_until
from tests.launching import launch_tiny, wait_for_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STREAMS = ("rollouts", "batches", "weights", "joins", "dead")
POOLS = ("trainer", "preprocessor-0", "actor-0")


def _inspect(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.inspect", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _snapshot(run_dir) -> dict:
    proc = _inspect("--run-dir", str(run_dir), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def _flowing(snap: dict) -> bool:
    """Every stream has carried entries and every pool has counted work."""
    streams, pools = snap["streams"], snap["pools"]
    return (
        all(streams[s]["entries_added"] > 0 for s in STREAMS)
        and all(p in pools for p in POOLS)
        and pools["actor-0"]["throughput"].get("weight_updates_applied", 0) > 0
        and pools["preprocessor-0"]["throughput"].get("dead_lettered", 0) > 0
    )


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A tiny run that keeps going until the module is done, then gets Ctrl-C."""
    tmp = tmp_path_factory.mktemp("inspect")
    run_dir = tmp / "run"
    proc = launch_tiny(tmp, run_dir, "trainer.max_steps=1000000")
    try:
        wait_for_step(run_dir, proc)
        yield run_dir
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        assert proc.returncode == 130, out


def _client(run_dir) -> redis.Redis:
    port = (run_dir / "redis" / "port").read_text().strip()
    auth = (run_dir / "redis" / "auth").read_text().strip()
    return redis.Redis(host="127.0.0.1", port=int(port), password=auth, socket_timeout=10)


def test_inspect_shows_every_stream_and_pool_of_a_live_run(live_run):
    client = _client(live_run)
    # an entry no decoder accepts: the preprocessor must dead-letter it, and inspect count it
    client.xadd("nonstop:tiny:rollouts", {"schema": "1", "data": b"\x00not msgpack"})
    deadline = time.monotonic() + 60
    snap = _snapshot(live_run)
    while not _flowing(snap) and time.monotonic() < deadline:
        time.sleep(0.5)
        snap = _snapshot(live_run)
    client.close()
    assert snap["run"] == "nonstop:tiny"
    assert snap["redis"]["maxmemory_policy"] == "noeviction"
    assert snap["trainer_version"] >= 1
    streams = snap["streams"]
    for name in STREAMS:
        assert streams[name]["exists"] and streams[name]["entries_added"] > 0, (name, snap)
    # consumer groups with their consumers, lag and pending entries
    (prep_group,) = streams["rollouts"]["groups"]
    assert prep_group["name"] == "preprocessor"
    assert [c["name"] for c in prep_group["consumers"]] == ["preprocessor-0"]
    assert prep_group["lag"] >= 0 and prep_group["pending"] >= 0
    (train_group,) = streams["batches"]["groups"]
    assert train_group["name"] == "trainer" and train_group["consumers"][0]["name"] == "trainer"
    # pools: role, live heartbeat, version, throughput counters
    pools = snap["pools"]
    assert set(POOLS) <= set(pools), pools
    for name in POOLS:
        assert pools[name]["alive"] and pools[name]["heartbeat_age_s"] < 15, pools[name]
        assert pools[name]["role"] == name.split("-")[0]
        assert pools[name]["last_error"] is None
    assert pools["trainer"]["version"] >= 1 and pools["trainer"]["throughput"]["step"] >= 1
    assert pools["trainer"]["throughput"]["samples_trained"] > 0
    assert pools["actor-0"]["version"] >= 1
    assert pools["actor-0"]["throughput"]["groups_produced"] > 0
    assert pools["actor-0"]["throughput"]["tokens"] > 0
    assert pools["preprocessor-0"]["throughput"]["kept"] > 0
    # the dead letter: in the stream, reported by the pool, with its reason
    dead = snap["dead_letters"]
    assert dead["count"] >= 1 and dead["reported_by_pools"] >= 1
    assert dead["recent"][0]["source"] == "nonstop:tiny:rollouts" and dead["recent"][0]["reason"]

    text = _inspect("--run-dir", str(live_run))
    assert text.returncode == 0, text.stderr
    for word in (*STREAMS, *POOLS, "preprocessor", "dead letters: 1"):
        assert word in text.stdout, (word, text.stdout)
    assert (live_run / "redis" / "auth").read_text().strip() not in text.stdout  # redacted


def test_inspect_by_url_finds_the_run(live_run):
    port = (live_run / "redis" / "port").read_text().strip()
    auth = (live_run / "redis" / "auth").read_text().strip()
    url = f"redis://:{auth}@127.0.0.1:{port}/0"
    named = _inspect("--url", url, "--prefix", "nonstop", "--run", "tiny", "--json")
    assert named.returncode == 0, named.stderr
    assert set(POOLS) <= set(json.loads(named.stdout)["pools"])
    found = subprocess.run(  # only the URL, from the environment: the one run is found
        [sys.executable, "-m", "pipeline.inspect", "--json"],
        cwd=ROOT,
        env=dict(os.environ, NONSTOP_REDIS_URL=url),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["run"] == "nonstop:tiny"


def test_watch_redraws_until_ctrl_c(live_run, tmp_path):
    # output to files, never a pipe nobody reads while it runs (a full pipe blocks the
    # redraw); Ctrl-C once three frames are out, not after a guessed start-up time;
    # faulthandler: a watch that outlives its Ctrl-C dumps where it is stuck on SIGABRT
    out_path, err_path = tmp_path / "watch.out", tmp_path / "watch.err"
    with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
        proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "pipeline.inspect"]
            + ["--run-dir", str(live_run), "--watch", "0.3"],
            cwd=ROOT,
            stdout=out_f,
            stderr=err_f,
            text=True,
        )
        drawn = wait_until(
            lambda: out_path.read_text().count("\x1b[H\x1b[2J") >= 3 or proc.poll() is not None,
            60,
        )
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
            proc.wait(timeout=10)
            pytest.fail(f"inspect --watch outlived its Ctrl-C by 30 s:\n{err_path.read_text()}")
    out, err = out_path.read_text(), err_path.read_text()
    assert drawn, (out[-2000:], err)
    assert proc.returncode == 0, err
    frames = out.split("\x1b[H\x1b[2J")
    assert len(frames) >= 3, out  # cleared and redrawn at least twice
    assert all("rollouts" in f and "trainer" in f for f in frames[1:]), out
    # the live view adds rates from one frame to the next
    assert "groups/s" in frames[-1] or "groups/s" in frames[-2], frames[-1]


def test_inspect_says_what_to_pass(tmp_path):
    proc = _inspect("--run-dir", str(tmp_path))
    assert proc.returncode == 2
    assert "no embedded redis-server" in proc.stderr and "--url" in proc.stderr


def test_a_silent_or_stuck_pool_is_flagged():
    from pipeline.inspect import pool_info, render

    now = 1000.0
    pools = {
        "actor-0": pool_info({"role": "actor", "state": "generating", "heartbeat": "900"}, now, 30),
        "actor-1": pool_info(
            {"role": "actor", "state": "generating", "heartbeat": "999", "progress": "880"},
            now,
            30,
        ),
        "trainer": pool_info({"role": "trainer", "state": "finished", "heartbeat": "1"}, now, 30),
    }
    assert not pools["actor-0"]["alive"] and pools["actor-1"]["stalled"]
    snap = {
        "run": "nonstop:x",
        "time": now,
        "redis": {"version": "7", "used_memory": "1M", "maxmemory_policy": "noeviction"},
        "trainer_version": None,
        "published_version": None,
        "samples_in_flight": None,
        "streams": {},
        "pools": pools,
        "dead_letters": {"count": 0, "reported_by_pools": 0, "recent": []},
    }
    text = render(snap)
    assert "generating (no heartbeat)" in text
    assert "generating (no progress for 2.0m)" in text
    assert "finished  " in text and "finished (no heartbeat)" not in text


def test_publisher_failures_and_reward_errors_are_shown():
    from pipeline.inspect import pool_info, render

    now = 1000.0
    trainer = {
        "role": "trainer",
        "state": "training",
        "heartbeat": "999",
        "weight_updates_published": "7",
        "weight_versions_unreceived": "2",
        "weight_publish_failures": "3",
        "actors_dropped": "1",
        "last_publish_error": "actor-1 timed out receiving version 9",
    }
    actor = {"role": "actor", "state": "generating", "heartbeat": "999", "reward_errors": "4"}
    actor |= {"reward_errors.RecursionError": "3", "reward_errors.TimeoutError": "1"}
    pools = {"trainer": pool_info(trainer, now, 30), "actor-0": pool_info(actor, now, 30)}
    assert pools["trainer"]["throughput"]["weight_publish_failures"] == 3
    assert pools["actor-0"]["reward_error_reasons"] == {"RecursionError": 3, "TimeoutError": 1}
    snap = {
        "run": "nonstop:x",
        "time": now,
        "redis": {"version": "7", "used_memory": "1M", "maxmemory_policy": "noeviction"},
        "trainer_version": 9,
        "published_version": 7,
        "samples_in_flight": 0,
        "streams": {},
        "pools": pools,
        "dead_letters": {"count": 0, "reported_by_pools": 0, "recent": []},
    }
    text = render(snap)
    for shown in ("unreceived 2", "publish failures 3", "actors dropped 1", "timed out receiving"):
        assert shown in text, text
    assert "reward errors 4" in text and "RecursionError 3" in text, text
