"""Group accounting (pipeline/accounting.py): every produced group gets exactly one
outcome, and the in-flight and dead-letter parts are read from a real redis-server."""

from __future__ import annotations

import json

from pipeline.accounting import account, conserved, dead_letters, in_flight
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
from pipeline.streams import Consumer, Names, ensure_group, publish
from pipeline.summary import trainer_resume_position

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
    assert conserved(terms) and terms["groups_produced"] == 6


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
    assert in_flight(rclient, NAMES, trainer_from=first)["batches_samples"] == ["b/0", "b/1"]
    records = produced("a", "b") + [step(1, ["a/0", "a/1"])]
    terms = account(records, in_flight(rclient, NAMES, trainer_from=first), [], G)
    assert terms["groups_trained"] == terms["groups_in_flight_at_end"] == 1
    assert terms["groups_lost"] == 0 and conserved(terms)

    run = tmp_path / "run"  # where that position comes from
    assert trainer_resume_position(str(run)) == "0-0"  # no checkpoint: from the start
    folder = run / "checkpoints" / "step-000001"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"entry_id": first}))
    (run / "checkpoints" / "latest").write_text("step-000001")
    assert trainer_resume_position(str(run)) == first
    (run / "config.yaml").write_text("trainer:\n  resume: false\n")
    assert trainer_resume_position(str(run)) is None  # a restart would not read them again
