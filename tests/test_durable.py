"""Durable writes (pipeline/streams/durable.py) against real redis-servers on loopback: XADD-once,
a primary with a replica attached (WAIT), the replica stopped (NotReplicated, then a
retry that adds no copy), and single mode sending no WAIT at all."""

from __future__ import annotations

import json
import os
import signal
import time
from types import SimpleNamespace

import pytest
import redis
from redis.crc import key_slot

from pipeline.redisd.server import EmbeddedRedis
from pipeline.streams import (
    Consumer,
    Names,
    add_once,
    connect,
    count_produced,
    durable,
    publish,
    retire_groups,
)
from pipeline.streams.durable import Durability, NotReplicated, attach, once_keys, publish_once

NAMES = Names("nsrl-test", "durable")


def entry(n: int) -> dict:
    return {"schema": "1", "group": f"g{n}", "data": b"\x00payload" + bytes([n])}


def wait_calls(client: redis.Redis) -> int:
    """WAIT commands the server has run since the last CONFIG RESETSTAT."""
    return int(client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


# ---- XADD-once (one server)


def test_same_token_twice_gives_one_entry_and_the_same_id(rclient):
    first, new = publish_once(rclient, NAMES.rollouts, "actor-0:aa", entry(1))
    again, new_again = publish_once(rclient, NAMES.rollouts, "actor-0:aa", entry(1))
    assert (again, new, new_again) == (first, True, False)
    other, new_other = publish_once(rclient, NAMES.rollouts, "actor-0:bb", entry(2))
    assert new_other and other != first
    ids = [i.decode() for i, _ in rclient.xrange(NAMES.rollouts)]
    assert ids == [first, other]
    fields = rclient.xrange(NAMES.rollouts)[0][1]
    assert fields[b"data"] == entry(1)["data"] and fields[b"group"] == b"g1"  # binary-safe


def test_publish_with_a_token_is_xadd_once_and_without_one_a_plain_xadd(rclient):
    a = publish(rclient, NAMES.batches, b"x", token="b1", samples=2)
    assert publish(rclient, NAMES.batches, b"x", token="b1", samples=2) == a
    assert rclient.xlen(NAMES.batches) == 1
    publish(rclient, NAMES.batches, b"x", samples=2)
    publish(rclient, NAMES.batches, b"x", samples=2)
    assert rclient.xlen(NAMES.batches) == 3  # no token: a new entry per call


def test_once_keys_forget_the_oldest_tokens_past_the_cap(rclient):
    for n in range(5):
        publish_once(rclient, NAMES.rollouts, f"t{n}", entry(n), cap=3)
    once, order = once_keys(NAMES.rollouts)
    assert rclient.hlen(once) == 3 and rclient.llen(order) == 3
    assert rclient.hget(once, "t0") is None and rclient.hget(once, "t4") is not None
    publish_once(rclient, NAMES.rollouts, "t4", entry(4), cap=3)
    assert rclient.xlen(NAMES.rollouts) == 5


def test_xadd_once_survives_a_flushed_script_cache(rclient):
    publish_once(rclient, NAMES.rollouts, "c1", entry(1))
    rclient.script_flush()  # a restarted server: EVALSHA answers NOSCRIPT, EVAL follows
    publish_once(rclient, NAMES.rollouts, "c1", entry(1))
    publish_once(rclient, NAMES.rollouts, "c2", entry(2))
    assert rclient.xlen(NAMES.rollouts) == 2


@pytest.mark.parametrize("token", ["", "~acked"])
def test_bad_tokens_are_refused(rclient, token):
    with pytest.raises(ValueError, match="token"):
        publish_once(rclient, NAMES.rollouts, token, entry(1))


def test_once_keys_share_the_hash_slot_of_a_tagged_stream():
    stream = "nonstop:run:{rollouts:3}"  # a cluster partition's name carries a hash tag
    assert {key_slot(k.encode()) for k in (stream, *once_keys(stream))} == {
        key_slot(stream.encode())
    }


def test_batch_ids_come_from_their_samples():
    from preprocessor.main import batch_id

    class G:
        def __init__(self, gid):
            self.group_id = gid

    class S:
        def __init__(self, i):
            self.index = i

    a = [(G("actor-0:x"), S(0)), (G("actor-0:x"), S(1))]
    assert batch_id(a) == batch_id([(G("actor-0:x"), S(0)), (G("actor-0:x"), S(1))])
    assert batch_id(a) != batch_id([(G("actor-0:x"), S(0)), (G("actor-0:y"), S(1))])


def test_durability_refuses_a_wait_without_deadline():
    with pytest.raises(ValueError, match="wait_timeout_ms"):
        Durability(replicas=1, timeout_ms=0)
    with pytest.raises(ValueError, match="min_replicas_acked"):
        Durability(replicas=-1)


# ---- a primary with one replica


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    primary = EmbeddedRedis(str(tmp_path_factory.mktemp("primary")))
    primary.start()
    replica = EmbeddedRedis(str(tmp_path_factory.mktemp("replica")))
    replica.password = primary.password
    replica.extra_args = [
        "--replicaof",
        "127.0.0.1",
        str(primary.port),
        "--masterauth",
        primary.password,
    ]
    try:
        replica.start()
        probe = primary.client(socket_timeout=5)
        deadline = time.monotonic() + 20
        while probe.wait(1, 200) < 1:  # the replica's first sync
            assert time.monotonic() < deadline, "the replica never came online"
        yield primary, replica
    finally:
        if replica.proc is not None and replica.proc.poll() is None:
            os.kill(replica.proc.pid, signal.SIGCONT)
        replica.stop()
        primary.stop()


@pytest.fixture
def durable_client(pair):
    primary, _ = pair
    client = connect(primary.url, attempts=3)
    client.flushdb()
    client.config_resetstat()
    attach(client, Durability(replicas=1, timeout_ms=300, give_up_s=1.0))
    try:
        yield client
    finally:
        client.close()


def replica_has(replica: EmbeddedRedis, stream: str, entry_id: str) -> bool:
    c = replica.client(socket_timeout=5)
    try:
        return [i.decode() for i, _ in c.xrange(stream, entry_id, entry_id)] == [entry_id]
    finally:
        c.close()


def test_a_durable_write_returns_after_wait_and_the_replica_has_it(pair, durable_client):
    _, replica = pair
    publish_once(durable_client, NAMES.rollouts, "warm", entry(0))  # scripts now cached:
    count_produced(durable_client, NAMES, "actor-0", "warm", 4)  # no NOSCRIPT round below
    retire_groups(durable_client, NAMES, [("warm", 4)])
    durable_client.config_resetstat()
    entry_id, new = publish_once(durable_client, NAMES.rollouts, "w1", entry(1))
    assert new and replica_has(replica, NAMES.rollouts, entry_id)  # WAIT said 1 had it
    count_produced(durable_client, NAMES, "actor-0", "w1", 4)
    retire_groups(durable_client, NAMES, [("w1", 4)])
    consumer = Consumer(durable_client, NAMES, NAMES.rollouts, "preprocessor", "p0", dict)
    ids = [i for i, _ in consumer._fetch(10, wait=False)]
    assert len(ids) == 2
    consumer.ack(ids)
    durable.set_value(durable_client, NAMES.trainer_version, 3)
    assert wait_calls(durable_client) == 5  # one WAIT behind each write, on its connection
    assert durable_client.xpending(NAMES.rollouts, "preprocessor")["pending"] == 0


def test_a_stopped_replica_makes_the_write_not_replicated_and_a_retry_adds_no_copy(
    pair, durable_client
):
    _, replica = pair
    os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(NotReplicated, match=r"XADD s1 to .*0 of the 1 replica") as e:
            publish_once(durable_client, NAMES.rollouts, "s1", entry(1))
        took = time.monotonic() - t0
        assert 1.0 <= took < 3.0  # give_up_s, then one more WAIT at most
        assert "min_replicas_acked" in str(e.value) and "INFO replication" in str(e.value)
        with pytest.raises(NotReplicated):
            add_once(durable_client, NAMES.samples_produced, NAMES.status("a"), "g", "s1", 4, {})
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
    again, new = publish_once(durable_client, NAMES.rollouts, "s1", entry(1))
    assert not new and durable_client.xlen(NAMES.rollouts) == 1  # the first send's entry
    assert replica_has(replica, NAMES.rollouts, again)
    assert (
        add_once(durable_client, NAMES.samples_produced, NAMES.status("a"), "g", "s1", 4, {})
        is False
    )
    assert int(durable_client.get(NAMES.samples_produced)) == 4  # counted once


NOT_WRITES = {"ping", "replconf", "info", "select", "multi", "exec", "config|resetstat"}


def writes_seen(replica_client: redis.Redis) -> int:
    """Data commands a replica has applied from its primary's stream."""
    stats = replica_client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k[len("cmdstat_") :] not in NOT_WRITES)


def test_a_repeated_write_still_writes_so_its_wait_covers_the_first(pair, durable_client):
    """A re-send may come on another connection: it must put a write of its own in the
    replication stream (counted on the replica), or a server that advances a
    connection's WAIT offset only for writes would let WAIT cover nothing of the first."""
    _, replica = pair
    seen = replica.client(socket_timeout=5)
    publish_once(durable_client, NAMES.rollouts, "r1", entry(1))
    add_once(durable_client, NAMES.samples_produced, NAMES.status("a"), "g", "r1", 4, {})
    retire_groups(durable_client, NAMES, [("r1", 4)])
    consumer = Consumer(durable_client, NAMES, NAMES.rollouts, "preprocessor", "p0", dict)
    ids = [i for i, _ in consumer._fetch(10, wait=False)]
    consumer.ack(ids)
    repeats = {
        "xadd-once": lambda: publish_once(durable_client, NAMES.rollouts, "r1", entry(1)),
        "add_once": lambda: add_once(
            durable_client, NAMES.samples_produced, NAMES.status("a"), "g", "r1", 4, {}
        ),
        "retire_groups": lambda: retire_groups(durable_client, NAMES, [("r1", 4)]),
        "xack": lambda: consumer.ack(ids),
    }
    for name, repeat in repeats.items():
        before = writes_seen(seen)
        repeat()  # returns once WAIT saw the replica take it
        assert writes_seen(seen) > before, name
    assert durable_client.xlen(NAMES.rollouts) == 1
    assert int(durable_client.get(NAMES.samples_retired)) == 4
    seen.close()


def test_single_mode_sends_no_wait(pair):
    primary, _ = pair
    client = connect(primary.url, attempts=3)
    client.flushdb()
    client.config_resetstat()
    attach(client, Durability(replicas=0))  # single mode (as with no policy attached)
    publish(client, NAMES.rollouts, b"x", token="n1", group="n1")
    count_produced(client, NAMES, "actor-0", "n1", 4)
    retire_groups(client, NAMES, [("n1", 4)])
    consumer = Consumer(client, NAMES, NAMES.rollouts, "preprocessor", "p0", dict)
    consumer.ack([i for i, _ in consumer._fetch(10, wait=False)])
    durable.set_value(client, NAMES.trainer_version, 1)
    stats = client.info("commandstats")
    assert "cmdstat_wait" not in stats
    assert stats["cmdstat_evalsha"]["calls"] + stats.get("cmdstat_eval", {}).get("calls", 0) == 3
    client.close()


@pytest.mark.parametrize("replicas", [0, 1])
def test_a_publish_whose_reply_is_lost_is_resent_without_a_copy(pair, replicas):
    """connect()'s retry re-sends an XADD whose reply was lost (the primary died between
    applying and replying): with a token the re-send returns the first entry's id, and
    the stream holds the group once (a plain XADD holds it twice: tests/test_faults.py)."""
    from tests.fault_runs import ReplyDropper

    primary, _ = pair
    proxy = ReplyDropper(primary.port)
    direct = primary.client(socket_timeout=5)
    direct.flushdb()
    try:
        url = f"redis://:{primary.password}@127.0.0.1:{proxy.port}/0"
        client = attach(connect(url, reconnect_s=4), Durability(replicas=replicas))
        publish(client, NAMES.rollouts, b"w", token="warm", group="warm")  # script cached
        proxy.armed.set()
        got = publish(client, NAMES.rollouts, b"x", token="g-1", group="g-1")
        assert not proxy.armed.is_set()  # one reply was dropped, and the retry answered
        groups = [(i.decode(), f[b"group"]) for i, f in direct.xrange(NAMES.rollouts)]
        assert groups[1:] == [(got, b"g-1")]
        client.close()
    finally:
        proxy.sock.close()
        direct.close()


@pytest.mark.parametrize(
    "drop,key",
    [
        (" %RW~nonstop:*:rollouts:once*", "rollouts_once"),  # XADD-once's keys
        (" %RW~nonstop:*:dead:once*", "dead_once"),  # a refused journal, dead-lettered once
        (" %RW~nonstop:*:retired_recent", "retired_recent"),  # a group too big to publish
    ],
)
def test_an_actor_without_a_scripts_keys_is_refused_at_start_up(tmp_path, drop, key):
    """XADD-once, the journal's dead letter and the retiring of a group too big to
    publish run scripts whose keys the actor must write: a user missing one is named at
    start-up (check_permissions), not with NOPERM mid-run. The shipped ACL passes."""
    from pipeline.streams import RedisUnavailable, check_permissions
    from tests.redis_builders import acl_server

    urls = acl_server(tmp_path, drop=drop)
    try:
        names = Names("nonstop", "probe")
        with pytest.raises(RedisUnavailable) as info:
            check_permissions(connect(urls["actor"]), names, "actor", urls["actor"])
        assert "EVALSHA" in str(info.value) and getattr(names, key) in str(info.value)
    finally:
        urls["proc"].terminate()
        urls["proc"].wait()
    (tmp_path / "shipped").mkdir()
    urls = acl_server(tmp_path / "shipped")
    try:
        check_permissions(connect(urls["actor"]), names, "actor", urls["actor"])
    finally:
        urls["proc"].terminate()
        urls["proc"].wait()


def test_the_pools_policy_comes_from_the_run_config():
    from omegaconf import OmegaConf

    from pipeline.config import Config

    cfg = OmegaConf.structured(Config)
    assert Durability.from_config(cfg) == Durability(replicas=0, timeout_ms=2000)  # single
    cfg.redis.mode, cfg.redis.wait_timeout_ms, cfg.redis.reconnect_s = "sentinel", 500, 9.0
    assert Durability.from_config(cfg) == Durability(replicas=1, timeout_ms=500, give_up_s=9.0)
    cfg.redis.min_replicas_acked = 2
    assert Durability.from_config(cfg).replicas == 2


@pytest.mark.slow
def test_a_run_whose_writes_the_replicas_cannot_confirm_stops_in_one_line(tmp_path):
    """+redis=ha has one replica; asking for two makes every work write fall short: the
    pool that writes first says so in one line (what, 1 of 2, what to check) and exits
    2, nothing is counted, and the run stops (restart_policy=never)."""
    from tests.launching import run_tiny

    code, out = run_tiny(
        tmp_path,
        tmp_path / "run",
        "redis=ha",
        "redis.min_replicas_acked=2",
        "redis.reconnect_s=3",
        "launch.restart_policy=never",
        timeout=300,
    )
    assert code != 0, out[-3000:]
    line = next(ln for ln in out.splitlines() if "is not replicated" in ln)
    assert "WAIT saw 1 of the 2 replica(s)" in line and "INFO replication" in line
    assert "exited with 2" in out and "Traceback" not in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["samples_trained"] == 0


def test_a_preprocessor_restarted_before_its_ack_publishes_no_second_batch(rclient):
    """A preprocessor that published a read's batches and died before acknowledging the
    read re-reads the same groups after its restart and packs the same batches: their
    ids come from their samples, and XADD-once adds no copy for the trainer to turn
    away (before XADD-once: a second copy, rejected as stale or a duplicate)."""
    from omegaconf import OmegaConf

    from pipeline.config import Config
    from pipeline.messages import RolloutGroup, encode
    from preprocessor.main import process, usable
    from tests.message_builders import group

    cfg = OmegaConf.structured(Config)
    pool = SimpleNamespace(cfg=cfg, client=rclient, names=NAMES, record=lambda **_: None)
    for gid in ("g1", "g2", "g3"):
        publish(rclient, NAMES.rollouts, encode(group(gid, 1.0)), token=gid, group=gid)

    def read_and_process() -> int:
        c = Consumer(rclient, NAMES, NAMES.rollouts, "preprocessor", "pre-0", RolloutGroup)
        return process(pool, [], usable(pool, c, c.read(10)))["batches"]  # then dies

    first = read_and_process()
    assert first >= 1 and rclient.xlen(NAMES.batches) == first
    assert read_and_process() == first  # the restart re-reads its pending entries
    assert rclient.xlen(NAMES.batches) == first  # ... and publishes no copy
