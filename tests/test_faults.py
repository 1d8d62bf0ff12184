"""The faults benchmark as a test: SIGKILL each pool, SIGSTOP one, restart
redis-server and SIGKILL it; every fault must take effect (the process is gone, a new pid
reports; the server comes back with a new run_id). The run is then drained (the actors
stop, the rest empties the streams) and the account checks the actors' records of what
they published against the trainer's and the preprocessors' records and the streams:
nothing lost, duplicated or phantom, and nothing left in flight but the trainer's
unfinished step; the same check on the run's records with one trained id dropped from
the trainer's record must fail, naming that id."""

import contextlib
import copy
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import redis
from omegaconf import OmegaConf

from actor.stream import Room
from actor.sync import DRAIN_FIELD, Turns
from pipeline.accounting import account, in_flight
from pipeline.bench.faults import DEFAULT_SCHEDULE, account_run, left_in_flight, passed, plan
from pipeline.config import Config, validate
from pipeline.messages import SCHEMA_VERSION, RolloutGroup, encode
from pipeline.redis_server import EmbeddedRedis
from pipeline.runtime import Pool
from pipeline.streams import Names, connect, count_produced, publish, wait_until
from pipeline.telemetry import MetricsFile, PoolStatus, read_jsonl, surviving_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_fault_took_effect(fault: dict) -> None:
    effect = fault["effect"]
    assert fault["effective"] is not None, fault
    assert effect["old_pid_state"] in ("gone", "zombie"), fault  # the hit process died
    assert effect["new_pid"] not in (None, 0, fault["pid"]), fault  # and another came back
    if fault["kind"] == "stop":
        assert effect["was_stopped"], fault  # SIGSTOP held it before the watchdog killed it
    if fault["target"] == "redis":
        assert effect["new_run_id"] != fault["run_id"], fault  # a new server process


def run_faults_bench(tmp_path, *extra: str):
    out, run_dir = tmp_path / "faults.json", tmp_path / "run"
    env = dict(os.environ, NONSTOP_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.bench", "faults", "--out", str(out)]
        + ["--run-dir", str(run_dir), "--tail-steps", "5", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for fault in result["faults"]:
        check_fault_took_effect(fault)
    assert result["all_recovered"], result["faults"]
    return proc, result, run_dir


def check_account(result: dict, run_dir) -> dict:
    """The account, recomputed here from the run's own files; then the same check on
    those records with one trained id dropped from the trainer's record must fail."""
    records = read_jsonl(str(run_dir / "metrics.jsonl"))
    terms = account_run(str(run_dir))
    produced = {r["group"] for r in records if r.get("event") == "group"}
    assert terms["groups_produced"] == len(produced) == result["groups_produced"] > 0
    assert terms["problems"] == [] == result["problems"]
    assert terms["groups_trained"] > 0 and terms["groups_lost"] == 0
    assert result["drain"]["drained"], result["drain"]
    left = terms["in_flight_after_drain"]
    assert left["ok"], left  # at most the trainer's unfinished step, in its pending list
    assert all(e["where"] == "pending:trainer" for e in left["entries"]), left

    # the trainer's record loses one trained id: the check names it as lost
    flight = set(json.loads((run_dir / "summary.json").read_text())["in_flight"]["batches_samples"])
    broken = copy.deepcopy(records)
    # the latest step with a sample no longer in a stream (a step after the last
    # checkpoint has its batches still in the stream); the same dicts as in ``broken``
    step, dropped = next(
        (st, sid)
        for st in reversed(surviving_steps(broken))
        for sid in st["sample_ids"]
        if sid not in flight
    )
    step["sample_ids"].remove(dropped)
    bad = account_run(str(run_dir), broken)
    assert bad["problems"] == [
        f"lost: {dropped} (published by an actor; not trained, dropped, dead-lettered or in a "
        "stream)"
    ]
    assert passed(result) and not passed(result | bad)
    assert result["broken_record_check"]["named"], result["broken_record_check"]
    return terms


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
    proc, result, run_dir = run_faults_bench(
        tmp_path, "--faults", "redis_sigkill,redis_sigkill,redis_sigkill"
    )
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
    proc, result, run_dir = run_faults_bench(tmp_path)
    check_account(result, run_dir)
    assert {f["name"] for f in result["faults"]} >= {"redis_restart", "redis_sigkill"}
    assert result["restarts"].get("trainer", 0) >= 1 and result["restarts"].get("redis", 0) >= 1
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_a_draining_run_holds_every_actor_loop_back(rclient, tmp_path):
    """The ``drain`` field of <run>:run (what the faults bench sets before it stops a
    run): the batch loop's gate (Turns.wait) and the streaming loop's Room start no new
    group while it is there, the actor says ``draining`` and keeps ticking (not a hang
    to the watchdog), and both go on once it is gone."""
    from actor.main import wait_for_room

    cfg = OmegaConf.structured(Config)
    names = Names("t", f"drain-{time.time_ns()}")
    pool = Pool(
        cfg=cfg,
        name="actor-0",
        role="actor",
        client=rclient,
        names=names,
        stop=threading.Event(),
        status=PoolStatus(rclient, names, "actor-0", "actor"),
        metrics=MetricsFile(str(tmp_path / "metrics.jsonl")),
    )
    engine = SimpleNamespace(version=0)
    turns, room = Turns(pool, engine, wait_for_room), Room(pool, engine)
    assert turns.wait() == cfg.engine.prompts_per_batch and room(0)  # not draining

    rclient.hset(names.run_marker, DRAIN_FIELD, "1")
    got, ticked = {}, pool.last_tick
    waiter = threading.Thread(target=lambda: got.update(n=turns.wait()), daemon=True)
    waiter.start()
    state = lambda: rclient.hget(names.status("actor-0"), "state")  # noqa: E731
    assert wait_until(lambda: state() == b"draining", timeout_s=5)
    time.sleep(0.5)
    assert waiter.is_alive() and not got and pool.last_tick > ticked
    room.changed()
    assert room(0) is False and room.draining

    rclient.hdel(names.run_marker, DRAIN_FIELD)
    waiter.join(5)
    assert got == {"n": cfg.engine.prompts_per_batch}
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


class ReplyDropper:
    """A TCP proxy to a real redis-server that, when armed, lets one command through
    and closes the client's connection instead of passing the reply back: what a
    client sees when redis-server dies between applying a command and replying."""

    def __init__(self, port: int):
        self.target, self.armed = port, threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src, dst, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if replies and self.armed.is_set():
                    self.armed.clear()
                    break  # the command was applied; its reply never arrives
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # shutdown wakes the other direction's blocked recv
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


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
