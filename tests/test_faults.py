"""The faults benchmark as a test: SIGKILL each pool, SIGSTOP one, restart
redis-server and SIGKILL it; every fault must take effect (the process is gone, a new pid
reports; the server comes back with a new run_id). The run is then drained (the actors
stop, the rest empties the streams) and the account checks the actors' records of what
they published against the trainer's and the preprocessors' records and the streams:
nothing lost, duplicated or phantom, and nothing left in flight but the trainer's
unfinished step; the same check on the run's records with one trained id dropped from
the trainer's record must fail, naming that id."""

import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest
import redis
from omegaconf import OmegaConf

from actor.room import Room
from pipeline.bench.faults import DEFAULT_SCHEDULE, left_in_flight, plan
from pipeline.config import Config, validate
from pipeline.messages import SCHEMA_VERSION, RolloutGroup, encode
from pipeline.redisd.server import EmbeddedRedis
from pipeline.run.accounting import account, in_flight
from pipeline.runtime import Pool
from pipeline.streams import DRAIN_FIELD, Names, connect, count_produced, publish, wait_until
from pipeline.telemetry import MetricsFile, PoolStatus, read_jsonl
from tests.fault_runs import ReplyDropper, check_account, run_faults_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REDIS_KILLS = "5:kill:redis,25:kill:redis,45:kill:redis"  # what --faults redis_sigkill x3 plans


def back_to_back(schedule: str) -> str:
    """``schedule``'s faults in its order, 1 s apart: the bench applies each after the one
    before has taken effect and the run recovered from it (a trainer step since, the hit
    pool reporting again), so the run's own recovery spaces them, not idle waits (the
    default schedule's 80 s)."""
    return ",".join(
        f"{i + 1}:{kind}:{target}" for i, (_, kind, target) in enumerate(plan(schedule, None))
    )


def test_faults_flag_picks_named_faults_from_the_schedule():
    schedule = "5:kill:actor-0,60:restart:redis,80:kill:redis"
    assert plan(schedule, None) == [(5.0, "kill", "actor-0"), (60.0, "restart", "redis")] + [
        (80.0, "kill", "redis")
    ]
    assert plan(schedule, "redis_sigkill,actor-0_sigkill") == [
        (5.0, "kill", "redis"),
        (25.0, "kill", "actor-0"),
    ]
    with pytest.raises(SystemExit, match="redis_sigstop"):
        plan(schedule, "redis_sigstop")
    assert "80:kill:redis" in DEFAULT_SCHEDULE  # the hard kill is in the default schedule
    assert plan(REDIS_KILLS, None) == plan(DEFAULT_SCHEDULE, "redis_sigkill," * 3)
    assert back_to_back(schedule) == "1:kill:actor-0,2:restart:redis,3:kill:redis"


def test_what_is_left_after_a_drain_must_be_what_the_trainer_says_it_holds():
    """Left after a drain: only the trainer's unfinished step, in its pending list. Its
    samples must be exactly what the trainer's status says the step holds (fresh below
    a step, plus stale ones its record will drop): one sample more in the pending list,
    a full step's worth, or an entry elsewhere is not ok."""
    step = {"event": "step", "version": 1, "sample_ids": ["a", "b"], "stale_ids": []}

    def entry(ids, where="pending:trainer", stream="batches"):
        return {"stream": stream, "shard": 0, "id": "1-0", "where": where, "ids": ids}

    def left(entries, fresh, stale=0):
        trainer = {"buffered_samples": str(fresh), "buffered_stale": str(stale)}
        return left_in_flight([step], {"entries": entries}, 8, trainer)

    held = [entry(["a", "c", "d"]), entry(["e", "f"])]  # "a" was trained: not left
    assert left(held, fresh=4)["ok"] and left(held, fresh=4)["samples"] == 4
    assert left(held, fresh=2, stale=2)["ok"]  # two of them stale: the record drops them
    assert not left(held, fresh=3)["ok"]  # one in the pending list the trainer lost track of
    assert not left([entry(list("cdefghij"))], fresh=8)["ok"]  # a whole step, not trained
    assert not left([*held, entry(["g"], where="unread")], fresh=4)["ok"]
    assert not left([entry(["c"], stream="rollouts")], fresh=1)["ok"]
    assert left([], fresh=0)["ok"] and not left([], fresh=1)["ok"]


@pytest.mark.slow
def test_redis_sigkill_mid_run_loses_and_duplicates_nothing(tmp_path):
    """SIGKILL redis-server three times mid-run (appendfsync always, the default):
    the launcher restarts it from its AOF each time, and every group is accounted for."""
    proc, result, run_dir = run_faults_bench(tmp_path, "--schedule", back_to_back(REDIS_KILLS))
    assert [f["name"] for f in result["faults"]] == ["redis_sigkill"] * 3
    assert OmegaConf.load(run_dir / "config.yaml").redis.embedded_appendfsync == "always"
    check_account(result, run_dir)
    assert result["restarts"].get("redis", 0) >= 3, result["restarts"]
    assert result["passed"] and proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.slow
def test_a_tls_only_redis_killed_mid_run_comes_back_on_tls(tmp_path):
    """redis.tls=true: the launcher restarts the SIGKILLed server from its AOF on TLS only
    with the run's certificates; the pools reconnect over TLS and every group is
    accounted for (the bench reaches the run's Redis as pipeline.inspect --run-dir does)."""
    proc, result, run_dir = run_faults_bench(
        tmp_path, "--faults", "redis_sigkill", "--set", "redis.tls=true"
    )
    assert OmegaConf.load(run_dir / "config.yaml").redis.tls.enabled is True
    assert (run_dir / "redis" / "tls" / "ca.crt").exists()
    check_account(result, run_dir)
    assert result["restarts"].get("redis", 0) >= 1, result["restarts"]
    assert result["passed"] and proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.slow
def test_pipeline_survives_the_fault_schedule(tmp_path):
    """Every fault of the default schedule, in its order, each as soon as the one before
    has taken effect and been recovered from (the bench waits for both)."""
    proc, result, run_dir = run_faults_bench(tmp_path, "--schedule", back_to_back(DEFAULT_SCHEDULE))
    assert [(f["kind"], f["target"]) for f in result["faults"]] == [
        (kind, target) for _, kind, target in plan(DEFAULT_SCHEDULE, None)
    ]
    check_account(result, run_dir)
    assert {f["name"] for f in result["faults"]} >= {"redis_restart", "redis_sigkill"}
    assert result["restarts"].get("trainer", 0) >= 1 and result["restarts"].get("redis", 0) >= 1
    assert proc.returncode == 0, proc.stdout[-3000:]


def _actor_pool(rclient, tmp_path, tag: str) -> Pool:
    """An actor's Pool on the default config, on a run of its own in ``rclient``'s
    server, recording into tmp_path/metrics.jsonl."""
    names = Names("t", f"{tag}-{time.time_ns()}")
    return Pool(
        cfg=OmegaConf.structured(Config),
        name="actor-0",
        role="actor",
        client=rclient,
        names=names,
        stop=threading.Event(),
        status=PoolStatus(rclient, names, "actor-0", "actor"),
        metrics=MetricsFile(str(tmp_path / "metrics.jsonl")),
    )


def test_a_hold_is_recorded_per_reason_and_when_the_loop_ends(rclient, tmp_path):
    """A hold whose reason changes without room in between (the backlog drains while
    the trainer runs ahead: backlog, then lag, then the run drains) is one
    ``backpressure`` record per reason, each with its own time; the hold in progress
    when the loop ends is recorded too. Recorded only when room came back, such a hold
    was never recorded, and the actor's histogram stayed empty."""
    pool = _actor_pool(rclient, tmp_path, "holds")
    cfg, names = pool.cfg, pool.names
    engine = SimpleNamespace(version=0, dead=lambda: "")
    g = cfg.task.group_size
    room = Room(pool, engine)
    rclient.set(names.samples_produced, cfg.actor.max_queue_groups * g)
    assert room(0) is False and room.backlog == cfg.actor.max_queue_groups
    time.sleep(0.3)
    rclient.set(names.samples_retired, cfg.actor.max_queue_groups * g)  # the backlog drained,
    rclient.set(names.trainer_version, cfg.actor.max_lag + 1)  # the trainer ran ahead
    room.changed()
    assert room(0) is False and room.behind > cfg.actor.max_lag
    time.sleep(0.2)
    rclient.hset(names.run_marker, DRAIN_FIELD, "1")
    room.changed()
    assert room(0) is False and room.draining
    room.close()
    holds = [
        (r["reason"], r["wait_s"])
        for r in read_jsonl(str(tmp_path / "metrics.jsonl"))
        if r["event"] == "backpressure"
    ]
    assert [reason for reason, _ in holds] == ["backlog", "lag", "drain"], holds
    assert holds[0][1] >= 0.3 and holds[1][1] >= 0.2, holds


def test_a_draining_run_holds_every_actor_loop_back(rclient, tmp_path):
    """The ``drain`` field of <run>:run (what the faults bench sets before it stops a
    run): the Room's wait (the batch loop) and room(unpublished) (the streaming loop)
    start no new group while it is there, the actor says ``draining`` and keeps ticking
    (not a hang to the watchdog), and both go on once it is gone."""
    pool = _actor_pool(rclient, tmp_path, "drain")
    cfg, names = pool.cfg, pool.names
    engine = SimpleNamespace(version=0, dead=lambda: "")  # alive, at version 0
    turns, room = Room(pool, engine), Room(pool, engine)  # the batch and streaming loops
    assert turns.wait() == cfg.sampling.prompts_per_batch and room(0)  # not draining

    rclient.hset(names.run_marker, DRAIN_FIELD, "1")
    got, ticked = {}, pool.last_tick or 0.0
    waiter = threading.Thread(target=lambda: got.update(n=turns.wait()), daemon=True)
    waiter.start()
    state = lambda: rclient.hget(names.status("actor-0"), "state")  # noqa: E731
    assert wait_until(lambda: state() == b"draining", timeout_s=5)
    time.sleep(0.5)
    assert waiter.is_alive() and not got and (pool.last_tick or 0.0) > ticked
    room.changed()
    assert room(0) is False and room.draining

    rclient.hdel(names.run_marker, DRAIN_FIELD)
    waiter.join(5)
    assert got == {"n": cfg.sampling.prompts_per_batch}
    room.changed()
    assert room(0) is True


def test_embedded_redis_fsyncs_every_write_by_default(tmp_path, caplog):
    assert Config().redis.embedded_appendfsync == "always"
    server = EmbeddedRedis(str(tmp_path / "redis"))
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        server.stop()
    with caplog.at_level(logging.WARNING):
        EmbeddedRedis(str(tmp_path / "r2"), "everysec")
    assert "up to the last second" in caplog.text
    with pytest.raises(ValueError, match="redis.embedded_appendfsync='no'"):
        EmbeddedRedis(str(tmp_path / "r3"), "no")
    cfg = OmegaConf.structured(Config)
    cfg.redis.embedded_appendfsync = "no"
    with pytest.raises(ValueError, match="redis.embedded_appendfsync"):
        validate(cfg)


def test_a_resent_xadd_duplicates_the_entry_and_the_account_counts_it_once(tmp_path):
    """connect()'s retry re-sends a plain XADD whose reply was lost: the rollouts stream
    then holds the group twice (the trainer's dedupe window trains it once:
    tests/test_trainer.py), and the account counts the group once, not duplicated. The
    pools publish with a token (XADD-once), which makes no copy: tests/test_durable.py."""
    server = EmbeddedRedis(str(tmp_path / "redis"))
    server.start()
    proxy = ReplyDropper(server.port)
    try:
        client = connect(f"redis://:{server.password}@127.0.0.1:{proxy.port}/0", reconnect_s=4)
        client.ping()
        names = Names("t", "run")
        group = RolloutGroup(
            schema=SCHEMA_VERSION,
            group_id="g-1",
            actor="actor-0",
            problem_id="p",
            prompt_ids=b"",
            samples=[],
            temperature=1.0,
        )
        proxy.armed.set()
        publish(client, names.rollouts, encode(group), group="g-1")
        assert not proxy.armed.is_set()  # the reply was dropped once, and the retry answered
        direct = redis.Redis.from_url(server.url)
        entries = direct.xrange(names.rollouts)
        assert [f[b"group"] for _, f in entries] == [b"g-1", b"g-1"]
        flight = in_flight(direct, names)
        assert flight["rollouts_groups"] == ["g-1"]
        terms = account([{"event": "group", "group": "g-1"}], flight, [], group_size=2)
        assert terms["groups_produced"] == terms["groups_in_flight_at_end"] == 1
        assert terms["groups_duplicated"] == 0 and terms["groups_lost"] == 0
    finally:
        proxy.sock.close()
        server.stop()


def test_a_resent_produced_count_counts_the_group_once(tmp_path):
    """The actor's samples_produced / groups_produced update, re-sent by connect()'s retry
    after its reply was lost, adds the group once: else back-pressure would count a group
    in flight forever, and the actors' room would shrink by it for the rest of the run."""
    server = EmbeddedRedis(str(tmp_path / "redis"))
    server.start()
    proxy = ReplyDropper(server.port)
    try:
        client = connect(f"redis://:{server.password}@127.0.0.1:{proxy.port}/0", reconnect_s=4)
        names = Names("t", "run")
        assert count_produced(client, names, "actor-0", "g-1", 4)
        proxy.armed.set()
        assert count_produced(client, names, "actor-0", "g-2", 4) is False  # the re-sent call
        assert not proxy.armed.is_set()  # the first reply was dropped, the retry answered
        assert count_produced(client, names, "actor-0", "g-3", 4)
        direct = redis.Redis.from_url(server.url)
        assert int(direct.get(names.samples_produced)) == 12
        assert int(direct.hget(names.status("actor-0"), "groups_produced")) == 3
    finally:
        proxy.sock.close()
        server.stop()
