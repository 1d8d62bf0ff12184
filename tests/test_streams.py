"""Stream behaviour against a real redis-server: plain fields, consumer groups,
dead letters, trimming, and how the embedded server is locked down."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import time

import msgspec
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline.messages import SCHEMA_VERSION, RolloutGroup, Sample, encode, pack_f32, pack_i32
from pipeline.messages import rle_encode as rle
from pipeline.redisd.server import check_no_eviction
from pipeline.streams import Consumer, Names, publish, trim_consumed

NAMES = Names("nsrl-test", "run1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def group(n: int, schema: int = SCHEMA_VERSION) -> RolloutGroup:
    return RolloutGroup(
        schema=schema,
        group_id=f"actor-0:{n}",
        actor="actor-0",
        problem_id=f"p{n}",
        prompt_ids=pack_i32([1, 2, n]),
        samples=[
            Sample(
                index=i,
                completion_ids=pack_i32([n, i]),
                logprobs=pack_f32([-0.5, -1.0]),
                versions=rle([n, n]),
                reward=float(i),
                finished=True,
            )
            for i in range(2)
        ],
        temperature=0.7,
    )


def publish_group(client, n: int, schema: int = SCHEMA_VERSION) -> str:
    return publish(
        client,
        NAMES.rollouts,
        encode(group(n, schema)),
        schema=schema,
        version=n,
        reward=0.5,
        tokens=4,
    )


def consumer(client, name: str = "pre-0", grp: str = "preprocessor") -> Consumer:
    return Consumer(client, NAMES, NAMES.rollouts, grp, name, RolloutGroup, block_ms=20)


def read_all(c: Consumer, count: int = 100) -> list[tuple[str, RolloutGroup]]:
    out = []
    while batch := c.read(count):
        out.extend(batch)
    return out


def pending_ids(client, stream: str, grp: str) -> list[str]:
    rows = client.xpending_range(stream, grp, min="-", max="+", count=1000)
    return [r["message_id"].decode() for r in rows]


def stream_ids(client, stream: str) -> list[str]:
    return [i.decode() for i, _ in client.xrange(stream)]


# ---------------------------------------------------------------- publish


def test_publish_writes_plain_readable_fields_beside_data(rclient):
    payload = encode(group(7))
    entry_id = publish(
        rclient,
        NAMES.rollouts,
        payload,
        schema=SCHEMA_VERSION,
        version=7,
        reward=0.25,
        tokens=42,
        actor="actor-0",
    )
    [(got_id, fields)] = rclient.xrange(NAMES.rollouts)
    assert got_id.decode() == entry_id
    assert fields.pop(b"data") == payload
    plain = {k.decode(): v.decode("utf-8") for k, v in fields.items()}
    assert plain == {
        "schema": str(SCHEMA_VERSION),
        "version": "7",
        "reward": "0.25",
        "tokens": "42",
        "actor": "actor-0",
    }
    assert all(v.isprintable() for v in plain.values())


def test_published_entries_keep_their_order(rclient):
    ids = [publish_group(rclient, n) for n in range(5)]
    assert stream_ids(rclient, NAMES.rollouts) == ids
    assert rclient.xlen(NAMES.rollouts) == 5


# ---------------------------------------------------------------- consumer groups


def test_consumer_reads_through_group_and_ack_clears_pending(rclient):
    ids = [publish_group(rclient, n) for n in range(3)]
    c = consumer(rclient)
    got = c.read(10)
    assert [i for i, _ in got] == ids
    assert [m for _, m in got] == [group(n) for n in range(3)]
    assert rclient.xpending(NAMES.rollouts, "preprocessor")["pending"] == 3
    assert pending_ids(rclient, NAMES.rollouts, "preprocessor") == ids

    c.ack(ids[:2])
    assert pending_ids(rclient, NAMES.rollouts, "preprocessor") == ids[2:]
    c.ack(ids[2:])
    assert rclient.xpending(NAMES.rollouts, "preprocessor")["pending"] == 0
    assert c.read(10) == []  # nothing new, nothing re-delivered
    assert rclient.xlen(NAMES.rollouts) == 3  # ack does not delete


def test_consumer_created_before_the_stream_sees_later_entries(rclient):
    c = consumer(rclient)
    assert c.read(10) == []
    entry_id = publish_group(rclient, 1)
    assert [i for i, _ in c.read(10)] == [entry_id]


def test_two_consumers_in_one_group_split_entries_without_duplicates(rclient):
    ids = [publish_group(rclient, n) for n in range(10)]
    a, b = consumer(rclient, "pre-0"), consumer(rclient, "pre-1")
    got_a = a.read(4)
    got_b = read_all(b, 3)
    got_a += read_all(a)
    ids_a, ids_b = [i for i, _ in got_a], [i for i, _ in got_b]
    assert len(ids_a) == 4 and len(ids_b) == 6
    assert not set(ids_a) & set(ids_b)
    assert sorted(ids_a + ids_b, key=lambda i: tuple(map(int, i.split("-")))) == ids
    info = {
        c["name"].decode(): c["pending"]
        for c in rclient.xinfo_consumers(NAMES.rollouts, "preprocessor")
    }
    assert info == {"pre-0": 4, "pre-1": 6}


def test_separate_groups_each_get_every_entry(rclient):
    ids = [publish_group(rclient, n) for n in range(4)]
    one, two = consumer(rclient, grp="g1"), consumer(rclient, grp="g2")
    assert [i for i, _ in read_all(one)] == ids
    assert [i for i, _ in read_all(two)] == ids


def test_a_second_consumer_claims_a_dead_consumers_pending_entries(rclient):
    ids = [publish_group(rclient, n) for n in range(5)]
    dead = consumer(rclient, "pre-0")
    assert [i for i, _ in dead.read(3)] == ids[:3]  # read, never acknowledged: it "dies"

    def peer(name: str, idle_s: float) -> Consumer:
        return Consumer(
            rclient,
            NAMES,
            NAMES.rollouts,
            "preprocessor",
            name,
            RolloutGroup,
            block_ms=20,
            claim_idle_s=idle_s,
            claim_every_s=0.0,
        )

    time.sleep(0.3)
    patient = peer("pre-1", 60.0)  # entries held for less than claim_idle_s stay with their owner
    assert [i for i, _ in patient.read(10)] == ids[3:]
    assert patient.claimed == 0
    alive = peer("pre-2", 0.2)
    claimed = alive.read(10)
    assert [i for i, _ in claimed] == ids[:3] and alive.claimed == 3
    assert [m for _, m in claimed] == [group(n) for n in range(3)]
    owners = {
        r["message_id"].decode(): r["consumer"].decode()
        for r in rclient.xpending_range(NAMES.rollouts, "preprocessor", "-", "+", 10)
    }
    assert owners == {**dict.fromkeys(ids[:3], "pre-2"), **dict.fromkeys(ids[3:], "pre-1")}
    alive.ack(ids)
    assert rclient.xpending(NAMES.rollouts, "preprocessor")["pending"] == 0
    assert alive.read(10) == []  # nothing is delivered twice once acknowledged


def held(client, name: str, **kw) -> Consumer:
    """A consumer that checks its own pending list at every read (claims, lost replies)."""
    return Consumer(
        client, NAMES, NAMES.rollouts, "trainer", name, RolloutGroup, block_ms=20,
        claim_every_s=0.0, lost_every_s=0.0, **kw,
    )  # fmt: skip


def lose_a_reply(client, name: str, count: int) -> list[str]:
    """What a read whose reply is lost does on the server: XREADGROUP > as ``name`` on
    another connection, the entries then pending for ``name`` and never seen by it."""
    reply = client.xreadgroup("trainer", name, {NAMES.rollouts: ">"}, count=count)
    return [e[0].decode() for _s, es in reply for e in es]


def test_entries_a_lost_read_reply_delivered_are_handed_out_once(rclient):
    """A read's reply lost after the server delivered (Redis killed after the AOF had
    it, the client retrying the read): the consumer finds those entries in its own
    pending list once a later read passed them, hands them out once, and never hands
    out again an entry it still holds (no recover_pending: the trainer's setting)."""
    ids = [publish_group(rclient, n) for n in range(6)]
    c = held(rclient, "trainer", recover_pending=False)
    first = [i for i, _ in c.read(2)]  # held: not acknowledged
    assert first == ids[:2]
    assert lose_a_reply(rclient, "trainer", 2) == ids[2:4]
    assert [i for i, _ in c.read(2)] == ids[4:]  # newer than the lost ones: read on
    again = c.read(10)
    assert [i for i, _ in again] == ids[2:4] and c.lost_replies == 2
    assert [m for _, m in again] == [group(2), group(3)]
    assert c.read(10) == []  # the held entries are not handed out a second time
    c.ack(ids)
    assert rclient.xpending(NAMES.rollouts, "trainer")["pending"] == 0
    assert c.read(10) == [] and c.lost_replies == 2


def test_entries_still_held_are_not_claimed_back_or_read_again(rclient):
    """A consumer holding entries past claim_idle_s (XAUTOCLAIM claims them back to
    itself) or whose read position is set back gets only the entries it does not hold,
    and the newer ones still flow."""
    ids = [publish_group(rclient, n) for n in range(4)]
    c = held(rclient, "pre-0", claim_idle_s=0.05)
    assert [i for i, _ in c.read(2)] == ids[:2]
    time.sleep(0.1)  # idle past claim_idle_s, still held
    assert [i for i, _ in c.read(1)] == ids[2:3] and c.claimed == 0
    c.set_position("0-0")  # everything after it delivered again
    assert [i for i, _ in c.read(10)] == ids[3:]  # ids[:3] delivered again, still held
    assert c.read(10) == []
    c.ack(ids)
    assert rclient.xpending(NAMES.rollouts, "trainer")["pending"] == 0


def test_a_read_whose_reply_the_connection_lost_is_recovered(redis_server, rclient):
    """The real thing: a TCP proxy passes the XREADGROUP to redis-server and closes the
    connection instead of passing its reply back; redis-py's retry (connect()) reads the
    entries after the lost ones. The consumer later hands the lost ones out, once."""
    from pipeline.streams import connect
    from tests.fault_runs import ReplyDropper

    ids = [publish_group(rclient, n) for n in range(5)]
    proxy = ReplyDropper(redis_server.port)
    url = redis_server.url.replace(f":{redis_server.port}/", f":{proxy.port}/")
    client = connect(url, reconnect_s=4)
    try:
        c = Consumer(
            client, NAMES, NAMES.rollouts, "trainer", "trainer", RolloutGroup, block_ms=20,
            recover_pending=False, lost_every_s=0.5,
        )  # fmt: skip
        assert [i for i, _ in c.read(1)] == ids[:1]
        proxy.armed.set()  # the next command is the XREADGROUP (no lost-reply tick yet)
        assert [i for i, _ in c.read(2)] == ids[3:5]  # the retry's reply: ids[1:3] unseen
        assert not proxy.armed.is_set()  # one reply was dropped
        time.sleep(0.6)
        assert [i for i, _ in c.read(10)] == ids[1:3] and c.lost_replies == 2
        assert c.read(10) == []
        c.ack(ids)
        assert rclient.xpending(NAMES.rollouts, "trainer")["pending"] == 0
    finally:
        client.close()
        proxy.sock.close()


def test_a_lost_reply_is_found_at_its_tick_not_before(rclient):
    ids = [publish_group(rclient, n) for n in range(4)]
    c = Consumer(
        rclient, NAMES, NAMES.rollouts, "trainer", "t", RolloutGroup, block_ms=20,
        lost_every_s=0.5, recover_pending=False,
    )  # fmt: skip
    assert [i for i, _ in c.read(1)] == ids[:1]
    lose_a_reply(rclient, "t", 1)
    assert [i for i, _ in c.read(1)] == ids[2:3]
    assert [i for i, _ in c.read(1)] == ids[3:4]  # the tick has not come: new entries
    time.sleep(0.6)
    assert [i for i, _ in c.read(5)] == ids[1:2] and c.lost_replies == 1


def test_own_pending_entries_are_walked_once_while_held(rclient):
    """A restarted consumer re-reads what its former process left pending, a page at a
    time, while it still holds the earlier pages (before: the first page again)."""
    ids = [publish_group(rclient, n) for n in range(7)]
    former = consumer(rclient, "pre-0")
    assert [i for i, _ in former.read(5)] == ids[:5]  # then it dies, holding them
    again = consumer(rclient, "pre-0")
    got = [i for i, _ in again.read(2)] + [i for i, _ in again.read(2)]
    got += [i for i, _ in again.read(2)]
    assert got == ids[:5]  # the last page is short: its one entry
    assert [i for i, _ in again.read(10)] == ids[5:]


def test_a_pending_entry_gone_from_the_stream_is_reported_not_handed_out(rclient, caplog):
    ids = [publish_group(rclient, n) for n in range(3)]
    c = held(rclient, "trainer", recover_pending=False)
    lost = lose_a_reply(rclient, "trainer", 1)
    rclient.xdel(NAMES.rollouts, lost[0])
    assert [i for i, _ in c.read(5)] == ids[1:]
    with caplog.at_level("ERROR"):
        assert c.read(5) == [] and c.read(5) == []
    gone = [r for r in caplog.records if "no longer in the stream" in r.getMessage()]
    assert len(gone) == 1 and lost[0] in gone[0].getMessage()  # said once, not every tick


def test_the_read_position_never_goes_back(rclient):
    c = consumer(rclient)
    assert c.position("5-0", ["3-0"]) == "5-0"  # an entry re-read after a lost reply
    assert c.position("0-0", ["3-0", "2-9"]) == "3-0"
    assert c.position("2-0", []) == "2-0"


# ---------------------------------------------------------------- dead letters


def test_malformed_entries_go_to_dead_stream_and_good_ones_flow_in_order(rclient):
    s = NAMES.rollouts
    good = [publish_group(rclient, 0)]
    no_data = rclient.xadd(s, {"schema": "1", "note": "forgot the payload"}).decode()
    good.append(publish_group(rclient, 1))
    garbage = rclient.xadd(s, {"schema": "1", "data": b"\xc1\xff garbage"}).decode()
    good.append(publish_group(rclient, 2))
    old_schema = publish_group(rclient, 3, schema=SCHEMA_VERSION + 1)
    pickled = rclient.xadd(s, {"data": pickle.dumps({"schema": 1})}).decode()
    good.append(publish_group(rclient, 4))

    c = consumer(rclient)
    got = read_all(c, 3)
    assert [i for i, _ in got] == good
    assert [m.group_id for _, m in got] == [f"actor-0:{n}" for n in (0, 1, 2, 4)]
    assert c.dead_lettered == 4

    # bad entries are acknowledged already; only the good ones wait for an ack
    assert pending_ids(rclient, s, "preprocessor") == good

    dead = [{k.decode(): v for k, v in f.items()} for _, f in rclient.xrange(NAMES.dead)]
    assert [d["id"].decode() for d in dead] == [no_data, garbage, old_schema, pickled]
    assert all(d["source"].decode() == s for d in dead)
    assert all(d["consumer"].decode() == "pre-0" for d in dead)
    reasons = [d["reason"].decode() for d in dead]
    assert "data" in reasons[0]
    assert "RolloutGroup" in reasons[1]
    assert "schema version" in reasons[2] and str(SCHEMA_VERSION + 1) in reasons[2]
    assert "RolloutGroup" in reasons[3]
    assert dead[1]["data"] == b"\xc1\xff garbage"  # the payload is kept for inspection


def test_entry_with_invalid_utf8_string_is_dead_lettered(rclient):
    fields = msgspec.msgpack.decode(encode(group(1)))
    bad = msgspec.msgpack.encode(fields).replace(b"\xa7actor-0", b"\xa7actor\xff\xfe")
    bad_id = rclient.xadd(NAMES.rollouts, {"data": bad}).decode()
    good_id = publish_group(rclient, 2)
    c = consumer(rclient)
    assert [i for i, _ in read_all(c)] == [good_id]
    assert [f[b"id"].decode() for _, f in rclient.xrange(NAMES.dead)] == [bad_id]


# ---------------------------------------------------------------- trimming
#
# trim_consumed may trim less than it is allowed to (XTRIM with "~" removes only
# whole stream nodes), so these tests check the safe bound exactly (nothing a
# group still needs is ever removed) and that trimming does make progress on a
# stream long enough to fill several nodes.


def _fill(client, n: int) -> list[str]:
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(NAMES.batches, {"i": str(i), "data": b"x"})
    return [i.decode() for i in pipe.execute()]


def _read_ids(client, grp: str, count: int) -> list[str]:
    reply = client.xreadgroup(grp, "c", {NAMES.batches: ">"}, count=count)
    return [i.decode() for _, entries in reply for i, _ in entries]


def _assert_trimmed_prefix(client, ids: list[str], allowed: int, removed: int) -> None:
    left = stream_ids(client, NAMES.batches)
    assert left == ids[len(ids) - len(left) :], "trimming must only ever cut a prefix"
    assert len(ids) - len(left) == removed
    assert removed <= allowed, f"trimmed {removed} entries, only {allowed} were consumed by all"


def test_trim_removes_only_what_every_group_acknowledged(rclient):
    ids = _fill(rclient, 300)
    for grp in ("trainer", "audit"):
        rclient.xgroup_create(NAMES.batches, grp, id="0")
    assert _read_ids(rclient, "trainer", 300) == ids
    rclient.xack(NAMES.batches, "trainer", *ids)
    assert _read_ids(rclient, "audit", 300) == ids
    rclient.xack(NAMES.batches, "audit", *ids[:150])  # ids[150:] stay pending

    removed = trim_consumed(rclient, NAMES.batches)
    _assert_trimmed_prefix(rclient, ids, allowed=150, removed=removed)
    assert removed > 0
    assert pending_ids(rclient, NAMES.batches, "audit") == ids[150:]

    rclient.xack(NAMES.batches, "audit", *ids[150:])
    removed += trim_consumed(rclient, NAMES.batches)
    _assert_trimmed_prefix(rclient, ids, allowed=300, removed=removed)


def test_trim_never_removes_pending_entries_before_an_acked_tail(rclient):
    ids = _fill(rclient, 300)
    rclient.xgroup_create(NAMES.batches, "trainer", id="0")
    assert _read_ids(rclient, "trainer", 300) == ids
    # everything acknowledged except one entry in the middle (a crashed consumer's)
    rclient.xack(NAMES.batches, "trainer", *ids[:120], *ids[121:])
    removed = trim_consumed(rclient, NAMES.batches)
    _assert_trimmed_prefix(rclient, ids, allowed=120, removed=removed)
    assert ids[120] in stream_ids(rclient, NAMES.batches)
    assert pending_ids(rclient, NAMES.batches, "trainer") == [ids[120]]


def test_trim_never_removes_unread_entries(rclient):
    ids = _fill(rclient, 300)
    rclient.xgroup_create(NAMES.batches, "trainer", id="0")
    rclient.xgroup_create(NAMES.batches, "late", id="0")
    rclient.xack(NAMES.batches, "trainer", *_read_ids(rclient, "trainer", 300))
    rclient.xack(NAMES.batches, "late", *_read_ids(rclient, "late", 130))  # 170 never read
    removed = trim_consumed(rclient, NAMES.batches)
    _assert_trimmed_prefix(rclient, ids, allowed=130, removed=removed)
    assert _read_ids(rclient, "late", 1000) == ids[130:]


def test_trim_keep_from_keeps_that_entry_and_later(rclient):
    ids = _fill(rclient, 300)
    rclient.xgroup_create(NAMES.batches, "trainer", id="0")
    rclient.xack(NAMES.batches, "trainer", *_read_ids(rclient, "trainer", 300))
    removed = trim_consumed(rclient, NAMES.batches, keep_from=ids[180])
    _assert_trimmed_prefix(rclient, ids, allowed=180, removed=removed)
    assert removed > 0
    assert stream_ids(rclient, NAMES.batches)[-120:] == ids[180:]


def test_trim_keep_from_beyond_the_floor_changes_nothing(rclient):
    ids = _fill(rclient, 300)
    rclient.xgroup_create(NAMES.batches, "trainer", id="0")
    rclient.xack(NAMES.batches, "trainer", *_read_ids(rclient, "trainer", 100))
    removed = trim_consumed(rclient, NAMES.batches, keep_from=ids[250])
    _assert_trimmed_prefix(rclient, ids, allowed=100, removed=removed)


def test_trim_without_groups_or_stream_removes_nothing(rclient):
    assert trim_consumed(rclient, NAMES.batches) == 0  # no stream at all
    ids = _fill(rclient, 300)
    assert trim_consumed(rclient, NAMES.batches) == 0  # nobody has consumed anything
    rclient.xgroup_create(NAMES.batches, "trainer", id="0")
    assert trim_consumed(rclient, NAMES.batches) == 0
    assert stream_ids(rclient, NAMES.batches) == ids


def test_trim_is_exact_on_a_short_stream(rclient):
    ids = _fill(rclient, 10)
    rclient.xgroup_create(NAMES.batches, "trainer", id="0")
    rclient.xack(NAMES.batches, "trainer", *_read_ids(rclient, "trainer", 10)[:5])
    assert trim_consumed(rclient, NAMES.batches) == 5
    assert stream_ids(rclient, NAMES.batches) == ids[5:]


# ---------------------------------------------------------------- the embedded server


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of LISTEN sockets on ``port``, from /proc/net/tcp{,6}."""
    found = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(path):
            continue
        with open(path) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                addr, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(addr)
    return found


def _other_local_addresses() -> set[str]:
    addrs = set()
    with contextlib.suppress(OSError):
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        addrs |= {info[4][0] for info in infos}
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # picks the outgoing interface; no packet is sent
        addrs.add(s.getsockname()[0])
    return addrs - {"127.0.0.1", "0.0.0.0"}


def test_embedded_redis_listens_on_loopback_only(redis_server, rclient):
    assert rclient.config_get("bind")["bind"] == "127.0.0.1"
    assert rclient.config_get("protected-mode")["protected-mode"] == "yes"
    assert "127.0.0.1" in redis_server.url
    if os.path.exists("/proc/net/tcp"):
        assert _listening_addresses(redis_server.port) == {"0100007F"}  # 127.0.0.1 only
    for addr in _other_local_addresses():
        with pytest.raises(OSError):
            socket.create_connection((addr, redis_server.port), timeout=1).close()


def test_embedded_redis_requires_its_password(redis_server, rclient):
    assert redis_server.password and redis_server.password in redis_server.url
    no_retry = {"socket_timeout": 5, "retry": Retry(NoBackoff(), 0)}  # fail fast
    anonymous = redis.Redis(host="127.0.0.1", port=redis_server.port, **no_retry)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    wrong = redis.Redis(host="127.0.0.1", port=redis_server.port, password="not-it", **no_retry)
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    right = redis.Redis(
        host="127.0.0.1", port=redis_server.port, password=redis_server.password, **no_retry
    )
    assert right.ping()
    for c in (anonymous, wrong, right):
        c.close()


def test_embedded_redis_is_durable_and_never_evicts(redis_server, rclient):
    assert rclient.config_get("appendonly")["appendonly"] == "yes"
    assert rclient.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    assert os.path.realpath(rclient.config_get("dir")["dir"]) == os.path.realpath(
        redis_server.data_dir
    )
    check_no_eviction(rclient)  # passes on the embedded server


def test_check_no_eviction_refuses_an_evicting_server(rclient):
    rclient.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with pytest.raises(ValueError, match="noeviction"):
            check_no_eviction(rclient)
    finally:
        rclient.config_set("maxmemory-policy", "noeviction")
    check_no_eviction(rclient)


def acl_user(rclient, redis_server, role: str, rules: list[str] | None = None) -> redis.Redis:
    """A client logged in as ``role`` with its rules from deploy/redis/users.acl."""
    if rules is None:
        with open(os.path.join(ROOT, "deploy", "redis", "users.acl")) as f:
            line = next(x for x in f if x.startswith(f"user {role} "))
        rules = [r for r in line.split()[2:] if not r.startswith(">")]
    rclient.execute_command("ACL", "SETUSER", f"t-{role}", "reset", *rules, ">pw")
    return redis.Redis(
        host="127.0.0.1", port=redis_server.port, username=f"t-{role}", password="pw"
    )


@pytest.mark.parametrize("role", ["actor", "preprocessor", "trainer", "operator"])
def test_every_deployed_role_checks_the_eviction_policy(rclient, redis_server, role):
    user = acl_user(rclient, redis_server, role)
    try:
        with pytest.raises(redis.ResponseError):
            user.config_get("maxmemory-policy")  # the roles may not run CONFIG ...
        check_no_eviction(user)  # ... and still check the policy (INFO memory)
        rclient.config_set("maxmemory-policy", "allkeys-lru")
        with pytest.raises(ValueError, match="noeviction"):
            check_no_eviction(user)
    finally:
        rclient.config_set("maxmemory-policy", "noeviction")
        rclient.execute_command("ACL", "DELUSER", f"t-{role}")


def test_a_user_that_may_not_read_the_policy_is_refused_not_skipped(rclient, redis_server):
    user = acl_user(rclient, redis_server, "blind", ["on", "+@connection", "+ping", "~*"])
    try:
        with pytest.raises(ValueError, match=r"\+info"):
            check_no_eviction(user)
    finally:
        rclient.execute_command("ACL", "DELUSER", "t-blind")


def test_stream_and_key_names_are_defined_in_one_place():
    """No module but pipeline/streams/names.py spells a run's stream or key name: they use
    the properties of Names (a renamed stream changes in one place)."""
    import re

    raw = re.compile(r"""\.(key|stream)\(\s*f?["']""")
    offenders = []
    for top in ("actor", "preprocessor", "trainer", "pipeline"):
        for folder, _dirs, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(folder, name)
                if not name.endswith(".py") or path.endswith(
                    os.path.join("pipeline", "streams", "names.py")
                ):
                    continue
                with open(path) as f:
                    for n, line in enumerate(f, 1):
                        if raw.search(line) and 'names.key("*")' not in line:
                            offenders.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not offenders, "use a Names property instead:\n" + "\n".join(offenders)


def test_an_entry_of_the_previous_schema_is_dead_lettered_saying_so(rclient):
    """A rollout group as the build before episodes wrote it (schema 1, still left in a
    stream after an upgrade) is not read as an episode: it goes to the dead-letter stream
    with a reason that names both versions and what to do, and the consumer goes on."""
    old = publish_group(rclient, 0, schema=SCHEMA_VERSION - 1)
    good = publish_group(rclient, 1)
    c = consumer(rclient)
    assert [i for i, _ in read_all(c)] == [good]
    [(_, dead)] = rclient.xrange(NAMES.dead)
    reason = dead[b"reason"].decode()
    assert dead[b"id"].decode() == old
    assert f"schema version {SCHEMA_VERSION - 1}, this build reads {SCHEMA_VERSION}" in reason
    assert "older build" in reason and "one build" in reason
