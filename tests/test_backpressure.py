"""Actor back-pressure, with a real actor process (tiny model) against a real
redis-server and no consumer: it starts a batch only while fewer than
actor.max_queue_groups groups are in flight and while at most actor.max_lag
versions behind the trainer, so rollouts never exceed
max_queue_groups - 1 + sampling.prompts_per_batch groups."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pipeline.streams import Names
from pipeline.telemetry import read_jsonl, read_statuses
from tests.config_builders import MAX_QUEUE, PER_BATCH, G, actor_config
from tests.launching import ROOT, tiny_cache

BOUND = MAX_QUEUE - 1 + PER_BATCH  # groups in flight, at most


def in_flight(client, names: Names) -> float:
    produced, retired = client.mget(names.key("samples_produced"), names.key("samples_retired"))
    return (int(produced or 0) - int(retired or 0)) / G


def wait_waiting(client, names: Names, behind: int = 0, timeout_s: float = 120) -> dict:
    """The actor's status once it waits (back-pressure) while ``behind`` versions behind."""
    deadline, st = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        st = read_statuses(client, names).get("actor-0", {})
        if st.get("state") == "waiting" and int(st.get("behind", -1)) == behind:
            return st
        time.sleep(0.1)
    raise AssertionError(f"the actor never waited {behind} versions behind: {st}")


def watch(client, names: Names, seconds: float) -> float:
    """The most groups in flight (produced, not retired) seen while watching."""
    most, end = 0.0, time.monotonic() + seconds
    while time.monotonic() < end:
        most = max(most, in_flight(client, names))
        time.sleep(0.05)
    return most


@pytest.mark.slow
def test_actor_never_exceeds_its_backpressure_bounds(tmp_path, redis_server, rclient):
    names = Names("nonstop", "tiny")
    env = dict(
        os.environ,
        NONSTOP_CACHE=tiny_cache(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
        NONSTOP_RUN_SECRET="s" * 32,
        NONSTOP_REDIS_URL=redis_server.url,
    )
    cmd = [sys.executable, "-m", "actor", "--config", actor_config(tmp_path, redis_server.url)]
    log = open(tmp_path / "actor.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd + ["--name", "actor-0"], cwd=ROOT, env=env, stdout=log, stderr=log)
    try:
        # nothing consumes: it fills up to the queue bound, then waits
        st = wait_waiting(rclient, names)
        assert float(st["backlog"]) >= MAX_QUEUE
        assert watch(rclient, names, 3.0) <= BOUND
        produced = rclient.xlen(names.rollouts)
        assert MAX_QUEUE <= produced <= BOUND

        # two groups retired (as a preprocessor or trainer would): room for one more batch
        rclient.incrby(names.key("samples_retired"), 2 * G)
        deadline = time.monotonic() + 60
        while rclient.xlen(names.rollouts) == produced and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rclient.xlen(names.rollouts) > produced, "no new batch after room was made"
        assert watch(rclient, names, 3.0) <= BOUND

        # plenty of room, but the trainer is 2 versions ahead (max_lag=1): it must wait
        rclient.incrby(names.key("samples_retired"), 100 * G)
        rclient.set(names.key("trainer_version"), 2)
        wait_waiting(rclient, names, behind=2)  # a batch already started has finished
        before = rclient.xlen(names.rollouts)
        time.sleep(3.0)
        assert rclient.xlen(names.rollouts) == before, "generated while too far behind"
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert proc.returncode == 0, (tmp_path / "actor.log").read_text()[-2000:]
    # each hold is a ``backpressure`` record (the actor's histogram
    # nonstop_backpressure_wait_seconds{reason}): the full backlog's once room was made,
    # the lag's when the actor stopped (a hold in progress is recorded at the end); each
    # at least the 3 s watched
    holds = [r for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if r["event"] == "backpressure"]
    longest = {}
    for r in holds:
        longest[r["reason"]] = max(longest.get(r["reason"], 0.0), r["wait_s"])
    assert set(longest) == {"backlog", "lag"}, holds
    assert min(longest.values()) >= 3.0, holds
