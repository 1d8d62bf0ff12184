"""Group accounting (pipeline/run/accounting.py): the actors' records of what they
published, checked against the trainer's and the preprocessors' records and the streams
(read from a real redis-server); every discrepancy is named by id."""

from __future__ import annotations

import copy
import json

from pipeline.messages import (
    SCHEMA_VERSION,
    RolloutGroup,
    Sample,
    TrainBatch,
    encode,
    pack_f32,
    pack_i32,
)
from pipeline.messages import rle_encode as rle
from pipeline.run.accounting import account, dead_letters, in_flight, problems
from pipeline.run.summary import trainer_resume_position
from pipeline.streams import Consumer, Names, ensure_group, publish
from pipeline.telemetry import MetricsFile, read_jsonl

NAMES = Names("nsrl-acct", "run")
G = 2  # samples per group in these tests


def sample(i: int) -> Sample:
    return Sample(
        index=i,
        completion_ids=pack_i32([5, 6]),
        logprobs=pack_f32([-1.0, -1.0]),
        versions=rle([0, 0]),
        reward=0.0,
        finished=True,
    )


def group(gid: str) -> RolloutGroup:
    return RolloutGroup(
        schema=SCHEMA_VERSION,
        group_id=gid,
        actor="actor-0",
        problem_id="p",
        prompt_ids=pack_i32([1, 2]),
        samples=[sample(i) for i in range(G)],
        temperature=1.0,
    )


def batch(sample_ids: list[str]) -> TrainBatch:
    gids = [s.rsplit("/", 1)[0] for s in sample_ids]
    return TrainBatch(
        schema=SCHEMA_VERSION,
        batch_id="b",
        group_ids=gids,
        prompt_ids=[pack_i32([1, 2]) for _ in gids],
        samples=[sample(int(s.rsplit("/", 1)[1])) for s in sample_ids],
        temperature=1.0,
    )


def produced(*gids: str) -> list[dict]:
    return [{"event": "group", "group": g} for g in gids]


def step(n: int, trained: list[str], stale: list[str] = ()) -> dict:
    return {"event": "step", "step": n, "sample_ids": trained, "stale_ids": list(stale)}


NO_FLIGHT = {"rollouts_groups": [], "batches_samples": [], "bad": []}


def test_every_outcome_is_counted_once_and_a_missing_group_is_lost():
    records = produced("a", "b", "c", "d", "e", "f") + [
        step(1, ["a/0", "a/1"], stale=["b/0", "b/1"]),
        {"event": "no_signal", "groups": ["c"]},
    ]
    flight = {"rollouts_groups": ["e"], "batches_samples": [], "bad": []}
    dead = [{"source": "x:rollouts", "reason": "bad", "groups": ["d"], "samples": []}]
    terms = account(records, flight, dead, G)
    assert [terms[f"groups_{k}"] for k in ("trained", "stale", "no_signal")] == [1, 1, 1]
    assert terms["groups_dead_lettered"] == terms["groups_in_flight_at_end"] == 1
    assert terms["groups_lost"] == 1 and terms["groups_lost_ids"] == ["f"]
    assert terms["groups_produced"] == 6
    assert [p.split(" ")[:2] for p in problems(terms)] == [["lost:", "f"]]


def test_a_group_whose_xadd_reply_never_came_counts_where_it_turns_up():
    """A machine shutdown stops redis-server and the actor at once: redis may apply an
    XADD (and keep it in its AOF) whose reply never reaches the actor, which recorded
    ``group_unconfirmed`` before it and never ``group`` (actor/publish.py send_group). After the
    relaunch the group is trained: published, not a phantom. One that never reached
    redis is nowhere: not published, and so not lost."""
    unconfirmed = [{"event": "group_unconfirmed", "group": g, "samples": G} for g in "bc"]
    records = produced("a") + unconfirmed + [step(1, ["a/0", "a/1", "b/0", "b/1"])]
    terms = account(records, NO_FLIGHT, [], G)
    assert problems(terms) == []
    assert terms["groups_produced"] == 2 and terms["groups_trained"] == 2
    assert terms["groups_lost"] == 0
    # the same run had the actor not said so: the trained group is a phantom
    plain = [r for r in records if r["event"] != "group_unconfirmed"]
    assert any(p.startswith("phantom: b") for p in problems(account(plain, NO_FLIGHT, [], G)))


def test_steps_undone_by_a_trainer_restart_do_not_count_as_trained():
    records = produced("a") + [step(1, ["a/0", "a/1"]), {"event": "resume", "version": 0}]
    assert account(records, NO_FLIGHT, [], G)["groups_lost"] == 1
    flight = {"rollouts_groups": [], "batches_samples": ["a/0", "a/1"], "bad": []}
    assert account(records, flight, [], G)["groups_in_flight_at_end"] == 1


def test_a_sample_of_a_trained_group_that_vanished_is_lost():
    records = produced("a") + [step(1, ["a/0"])]
    assert account(records, NO_FLIGHT, [], G)["samples_lost"] == 1
    flight = {"rollouts_groups": [], "batches_samples": ["a/1"], "bad": []}
    assert account(records, flight, [], G)["samples_lost"] == 0


def test_duplicates_and_conflicting_outcomes_are_reported():
    records = produced("a", "b") + [
        step(1, ["a/0", "a/1", "b/0", "b/1"]),
        step(2, ["a/0"]),
        {"event": "no_signal", "groups": ["b"]},
    ]
    terms = account(records, NO_FLIGHT, [], G)
    assert terms["groups_duplicated"] == 1
    assert terms["samples_conflicting"] == 2  # b's samples: trained and dropped for no signal


def test_in_flight_and_dead_letters_read_from_redis(rclient):
    ensure_group(rclient, NAMES.rollouts, "preprocessor")
    for gid in ("acked", "pending", "unread"):
        publish(rclient, NAMES.rollouts, encode(group(gid)), group=gid)
    c = Consumer(rclient, NAMES, NAMES.rollouts, "preprocessor", "p-0", RolloutGroup, block_ms=20)
    got = c.read(2)
    c.ack([got[0][0]])
    publish(rclient, NAMES.batches, encode(batch(["t/0", "t/1"])))  # no trainer group yet
    publish(rclient, NAMES.rollouts, b"garbage", group="broken")
    c.read(10)  # the garbage entry is dead-lettered; "unread" is now pending
    flight = in_flight(rclient, NAMES)
    assert flight["rollouts_groups"] == ["pending", "unread"]
    assert flight["batches_samples"] == ["t/0", "t/1"]
    where = {(e["stream"], tuple(e["ids"])): e["where"] for e in flight["entries"]}
    assert where == {
        ("rollouts", ("pending",)): "pending:p-0",  # read, never acknowledged
        ("rollouts", ("unread",)): "pending:p-0",  # read by the second read
        ("batches", ("t/0", "t/1")): "unread",  # no consumer group: nobody read it
    }
    assert all(
        rclient.xrange(NAMES.stream(e["stream"]), e["id"], e["id"]) for e in flight["entries"]
    )
    dead = dead_letters(rclient, NAMES)
    assert [d["groups"] for d in dead] == [["broken"]]  # from the plain field: no payload
    assert dead[0]["source"] == NAMES.rollouts and "RolloutGroup" in dead[0]["reason"]


def test_batches_after_the_trainers_resume_position_stay_in_flight(rclient, tmp_path):
    """A trainer stopped between a step's acknowledgement and its record: the entries are
    acknowledged, but a resume from the checkpoint reads them again, so they are in flight."""
    ensure_group(rclient, NAMES.batches, "trainer")
    first = publish(rclient, NAMES.batches, encode(batch(["a/0", "a/1"])))
    publish(rclient, NAMES.batches, encode(batch(["b/0", "b/1"])))
    c = Consumer(rclient, NAMES, NAMES.batches, "trainer", "trainer", TrainBatch, block_ms=20)
    c.ack([entry_id for entry_id, _ in c.read(10)])  # both acknowledged; b was never recorded
    assert in_flight(rclient, NAMES)["batches_samples"] == []
    again = in_flight(rclient, NAMES, trainer_from=first)
    assert again["batches_samples"] == ["b/0", "b/1"]
    assert [e["where"] for e in again["entries"]] == ["after-resume-position"]
    records = produced("a", "b") + [step(1, ["a/0", "a/1"])]
    terms = account(records, in_flight(rclient, NAMES, trainer_from=first), [], G)
    assert terms["groups_trained"] == terms["groups_in_flight_at_end"] == 1
    assert terms["groups_lost"] == 0 and problems(terms) == []

    run = tmp_path / "run"  # where that position comes from
    assert trainer_resume_position(str(run)) == "0-0"  # no checkpoint: from the start
    folder = run / "checkpoints" / "step-000001"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"entry_id": first}))
    (run / "checkpoints" / "latest").write_text("step-000001")
    assert trainer_resume_position(str(run)) == first
    (run / "config.yaml").write_text("trainer:\n  resume: false\n")
    assert trainer_resume_position(str(run)) is None  # a restart would not read them again


def test_each_discrepancy_is_named_by_id():
    records = produced("a", "b", "c", "d") + [
        {"event": "group", "group": "e", "samples": 1},  # the actor's record says 1 sample
        step(1, ["a/0", "a/1", "b/0", "d/0", "d/1", "e/0", "e/1"]),
        step(2, ["a/0", "x/0"]),  # a/0 trained again; x never published
        {"event": "no_signal", "groups": ["d"]},  # d: trained and dropped
    ]
    terms = account(records, NO_FLIGHT, [], G)
    assert terms["lost_ids"] == ["b/1", "c"]  # c: the whole group nowhere
    assert terms["duplicated_ids"] == ["a/0"]
    assert terms["phantom_ids"] == ["e/1", "x/0"]
    assert terms["conflicting_ids"] == ["d/0", "d/1"]
    said = problems(terms)
    assert [p.split(" (")[0] for p in said] == [
        "lost: b/1",
        "lost: c",
        "duplicated: a/0",
        "phantom: e/1",
        "phantom: x/0",
        "conflicting: d/0",
        "conflicting: d/1",
    ]
    assert said[-1] == "conflicting: d/1 (trained at step 1; no signal)"  # which two, when
    assert terms["groups_lost"] == 1 and terms["samples_lost"] == 1


def test_a_trained_id_dropped_from_the_trainers_record_is_lost(rclient, tmp_path):
    """Records written as the pools write them (MetricsFile, one line per event) and the
    streams of a real redis-server: groups published, batched by a consumer of the
    preprocessors' group, read by the trainer's, one step trained and one step's
    batch still pending in its list. The account agrees; without one trained id in
    the trainer's record it names that id as lost; a group the actors never recorded
    is a phantom."""
    metrics = MetricsFile(str(tmp_path / "metrics.jsonl"))
    for gid in ("g1", "g2"):
        publish(rclient, NAMES.rollouts, encode(group(gid)), group=gid)
        metrics.write(pool="actor-0", event="group", group=gid, samples=G)
    prep = Consumer(rclient, NAMES, NAMES.rollouts, "preprocessor", "p-0", RolloutGroup)
    for entry_id, g in prep.read(10):
        publish(rclient, NAMES.batches, encode(batch([f"{g.group_id}/{i}" for i in range(G)])))
        prep.ack([entry_id])
        metrics.write(pool="preprocessor-0", event="batched", groups=[g.group_id])
    trainer = Consumer(rclient, NAMES, NAMES.batches, "trainer", "trainer", TrainBatch)
    (first_id, first), (second_id, _) = trainer.read(10)
    trainer.ack([first_id])  # g2's batch stays pending: the trainer's unfinished step
    ids = [f"{g}/{s.index}" for g, s in zip(first.group_ids, first.samples, strict=True)]
    metrics.write(pool="trainer", event="step", step=1, sample_ids=ids, stale_ids=[])
    metrics.close()

    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    flight = in_flight(rclient, NAMES)
    assert [(e["id"], e["where"]) for e in flight["entries"]] == [(second_id, "pending:trainer")]
    terms = account(records, flight, dead_letters(rclient, NAMES), G)
    assert problems(terms) == [] and terms["groups_trained"] == 1
    assert terms["groups_in_flight_at_end"] == 1

    broken = copy.deepcopy(records)
    step_record = next(r for r in broken if r.get("event") == "step")
    step_record["sample_ids"].remove("g1/1")
    said = problems(account(broken, flight, [], G))
    assert said == [
        "lost: g1/1 (published by an actor; not trained, dropped, dead-lettered or in a stream)"
    ]
    unrecorded = [r for r in records if r.get("group") != "g2"]  # the actor's line for g2 gone
    assert [p.split(" (")[0] for p in problems(account(unrecorded, flight, [], G))] == [
        "phantom: g2/0",
        "phantom: g2/1",
        "phantom: g2",
    ]


def test_a_later_copy_of_a_trained_sample_turned_away_as_stale_is_redelivered():
    """A retried XADD's second copy reaching the trainer after its dedupe window is
    rejected as stale: trained once, not a conflict. Stale in or before the step that
    trained it is two outcomes: a conflict."""
    records = produced("a", "b") + [step(1, ["a/0", "a/1", "b/0", "b/1"]), step(9, [], ["a/0"])]
    terms = account(records, NO_FLIGHT, [], G)
    assert terms["redelivered_ids"] == ["a/0"] and terms["samples_redelivered_stale"] == 1
    assert terms["conflicting_ids"] == [] and problems(terms) == []
    assert terms["groups_trained"] == 2
    early = produced("a", "b") + [step(1, [], ["a/0"]), step(2, ["a/0", "a/1", "b/0", "b/1"])]
    same = produced("a", "b") + [step(1, ["a/0", "a/1", "b/0", "b/1"], ["a/0"])]
    for records, when in ((early, "trained at step 2; stale at step 1"), (same, "step 1; stale")):
        terms = account(records, NO_FLIGHT, [], G)
        assert terms["conflicting_ids"] == ["a/0"] and terms["redelivered_ids"] == []
        assert when in problems(terms)[0]


def test_an_actor_whose_xadd_failed_says_the_group_is_unconfirmed():
    """send_group against a redis-server that is gone (a real client, a closed port): the
    XADD raises, and before it propagates the actor's metrics file holds the group as
    unconfirmed, for the account above."""
    import socket
    from types import SimpleNamespace

    import pytest
    import redis

    from actor.publish import send_group

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = redis.Redis(port=port, socket_connect_timeout=1)
    part = SimpleNamespace(client=client, names=Names("test", "gone"))
    records: list[dict] = []
    pool = SimpleNamespace(
        name="actor-0",
        shards=SimpleNamespace(next=lambda: part),
        record=lambda **r: records.append(r),
    )
    with pytest.raises(redis.ConnectionError):
        send_group(pool, group("g"))
    assert records == [{"event": "group_unconfirmed", "group": "g", "samples": G}]


# an actor that publishes one group through the proxy below, once told to (stdin)
SENDER = """
import sys
from types import SimpleNamespace
import redis
from actor.publish import send_group
from pipeline.streams import Names, publish
from pipeline.telemetry import MetricsFile
from tests.test_accounting import group
url, prefix, run, path = sys.argv[1:]
client = redis.Redis.from_url(url)
part = SimpleNamespace(client=client, names=Names(prefix, run))
publish(client, part.names.rollouts + ":warm", b"w", token="warm")  # the script cached
metrics = MetricsFile(path)
pool = SimpleNamespace(name="actor-0", shards=SimpleNamespace(next=lambda: part),
                       record=lambda **r: metrics.write(**r))
print("ready", flush=True)
sys.stdin.readline()
send_group(pool, group("g"))
"""


def test_an_actor_killed_between_its_xadd_and_the_reply_leaves_no_phantom(
    redis_server, rclient, tmp_path
):
    """A real actor process SIGKILLed after redis applied its group's XADD and before the
    reply came (a proxy holds the reply; what the faults bench's SIGKILL hit in a CI run):
    the group is in the stream, the actor wrote no ``group`` record, and its
    ``group_unconfirmed`` record, written before the XADD, keeps the group published and
    in flight, not a phantom."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.fault_runs import ROOT, ReplyDropper

    proxy = ReplyDropper(redis_server.port, hold=True)
    url = f"redis://:{redis_server.password}@127.0.0.1:{proxy.port}/0"
    path = tmp_path / "metrics.jsonl"
    args = [sys.executable, "-c", SENDER, url, NAMES.prefix, NAMES.run, str(path)]
    proc = subprocess.Popen(
        args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proxy.armed.set()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 30
        while rclient.xlen(NAMES.rollouts) == 0:
            assert proc.poll() is None and time.monotonic() < deadline, "the XADD never arrived"
            time.sleep(0.01)
        assert proc.poll() is None  # still waiting for the reply
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
        proc.wait(10)
        proxy.sock.close()
    records = [{k: r[k] for k in ("event", "group")} for r in read_jsonl(str(path))]
    assert records == [{"event": "group_unconfirmed", "group": "g"}]
    terms = account(
        read_jsonl(str(path)), in_flight(rclient, NAMES), dead_letters(rclient, NAMES), G
    )
    assert problems(terms) == []
    assert terms["groups_produced"] == 1 and terms["groups_in_flight_at_end"] == 1
