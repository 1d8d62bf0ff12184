"""Where every produced group ended: the account behind ``summary.json`` and
the faults benchmark.

::

    reads   metrics.jsonl events: actor ``group`` (produced), preprocessor
            ``batched`` and ``no_signal``, trainer ``step`` (``sample_ids``,
            ``stale_ids``) and ``resume``; from Redis (while the run's server is
            up) the entries still unread or pending in ``rollouts`` and
            ``batches`` (and the batches past the trainer's resume position,
            which a restart reads again), and the dead-letter stream
    writes  nothing; :func:`account` returns the terms of
            produced = trained + stale + no_signal + dead_lettered + in_flight + lost

A group's outcome is the first of: trained (a sample of it in a step that
survived: steps undone by a trainer restart do not count), rejected as stale,
dropped for no signal, dead-lettered, still in flight at the end (unread or
pending in ``rollouts`` or ``batches``); a produced group with none of them is
lost. Samples are checked too: every sample of a trained group must itself be
trained, stale, dead-lettered or in flight (``samples_lost``), and no sample
may have two final outcomes (``samples_conflicting``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import redis

from pipeline.messages import BadEntry, RolloutGroup, TrainBatch, decode
from pipeline.shards import parse_position
from pipeline.streams import Names
from pipeline.telemetry import surviving_steps

PREPROCESSOR_GROUP = Names.ROLLOUTS_GROUP
TRAINER_GROUP = Names.BATCHES_GROUP


def _group_of(sample_id: str) -> str:
    return sample_id.rsplit("/", 1)[0]


def _sample_ids(batch: TrainBatch) -> list[str]:
    return [f"{g}/{s.index}" for g, s in zip(batch.group_ids, batch.samples, strict=True)]


def _newer(a: str, b: str) -> bool:
    return tuple(map(int, a.split("-"))) > tuple(map(int, b.split("-")))


def _unconsumed(
    client: redis.Redis, stream: str, group: str, after: str | None = None
) -> list[tuple[bytes, dict]]:
    """Entries of ``stream`` the consumer group has not acknowledged (unread or pending),
    or newer than ``after`` (a resume position: a restarted consumer reads them again);
    every entry when the group does not exist yet."""
    try:
        info = next((g for g in client.xinfo_groups(stream) if g["name"] == group.encode()), None)
    except redis.ResponseError:  # no such stream: nothing in it
        return []
    entries = client.xrange(stream)
    if info is None:
        return entries
    last = info["last-delivered-id"].decode()
    if after is not None and _newer(last, after):
        last = after
    pending = {
        p["message_id"].decode()
        for p in client.xpending_range(stream, group, "-", "+", max(1, int(info["pending"])))
    }
    return [(i, f) for i, f in entries if _newer(i.decode(), last) or i.decode() in pending]


def in_flight(
    client: redis.Redis, names: Names, shards=(), trainer_from: str | None = None
) -> dict[str, list[str]]:
    """Group ids still in ``rollouts`` and sample ids still in ``batches``, not yet
    acknowledged by their consumer group, on the primary ``client`` and every other
    shard (``shards``: their clients, redis.shards > 1); undecodable entries by entry
    id (``k@id`` on shard k > 0). ``trainer_from``: the position a restarted trainer
    resumes from (its last checkpoint's, one id per shard, comma-separated): the batches
    after it are in flight too, acknowledged or not, since a resume reads them again
    (a trainer stopped between a step's acknowledgement and its record left some)."""
    groups, samples, bad = set(), set(), []
    n = 1 + len(shards)
    starts = parse_position(trainer_from, n) if trainer_from else [None] * n
    for k, (shard, start) in enumerate(zip([client, *shards], starts, strict=True)):
        tag = f"{k}@" if k else ""
        for entry_id, fields in _unconsumed(shard, names.rollouts, PREPROCESSOR_GROUP):
            try:
                groups.add(decode(fields[b"data"], RolloutGroup).group_id)
            except (BadEntry, KeyError):
                bad.append(f"rollouts/{tag}{entry_id.decode()}")
        for entry_id, fields in _unconsumed(shard, names.batches, TRAINER_GROUP, start):
            try:
                samples.update(_sample_ids(decode(fields[b"data"], TrainBatch)))
            except (BadEntry, KeyError, ValueError):
                bad.append(f"batches/{tag}{entry_id.decode()}")
    return {"rollouts_groups": sorted(groups), "batches_samples": sorted(samples), "bad": bad}


def _role_of(source: str) -> str:
    """The pool that dead-letters entries of ``source``: rollouts are read by the
    preprocessors, batches by the trainer."""
    return {"rollouts": "preprocessor", "batches": "trainer"}.get(source.rsplit(":", 1)[-1], "")


def dead_letters(client: redis.Redis, names: Names) -> list[dict[str, Any]]:
    """Every dead-letter entry: its source stream, the consumer that wrote it and
    its ``role`` (preprocessor or trainer), reason, and the groups (rollouts)
    or samples (batches) its payload names; ``groups`` falls back to the entry's
    plain ``group`` field when the payload does not decode."""
    out = []
    for entry_id, f in client.xrange(names.dead):
        text = {k.decode(): v.decode(errors="replace") for k, v in f.items() if k != b"data"}
        item = {"id": entry_id.decode(), "source": text.get("source", ""), "reason": ""}
        item["reason"] = text.get("reason", "")
        item["consumer"], item["role"] = text.get("consumer", ""), _role_of(item["source"])
        item["groups"], item["samples"] = [], []
        data = f.get(b"data", b"")
        try:
            if item["source"].endswith(":batches"):
                item["samples"] = _sample_ids(decode(data, TrainBatch))
            else:
                item["groups"] = [decode(data, RolloutGroup).group_id]
        except (BadEntry, ValueError):
            if text.get("group"):
                item["groups"] = [text["group"]]
        out.append(item)
    return out


def account(
    records: list[dict],
    flight: dict[str, list[str]],
    dead: list[dict[str, Any]],
    group_size: int,
) -> dict[str, Any]:
    """The conservation terms (see the module doc) from metrics records, the in-flight
    ids and the dead letters; ``groups_lost_ids`` names the lost groups."""
    produced = {r["group"] for r in records if r.get("event") == "group"}
    batched = {g for r in records if r.get("event") == "batched" for g in r["groups"]}
    no_signal = {g for r in records if r.get("event") == "no_signal" for g in r["groups"]}
    steps = surviving_steps(records)
    trained = Counter(sid for s in steps for sid in s.get("sample_ids", []))
    stale = {sid for s in steps for sid in s.get("stale_ids", [])}
    dead_samples = {sid for d in dead for sid in d["samples"]}
    dead_whole = {g for d in dead for g in d["groups"]}  # rollouts entries: whole groups
    dead_groups = dead_whole | {_group_of(s) for s in dead_samples}
    flight_groups = set(flight.get("rollouts_groups", []))
    flight_samples = set(flight.get("batches_samples", []))
    flight_groups |= {_group_of(s) for s in flight_samples}

    outcome: dict[str, str] = {}
    for g in produced:
        samples = [f"{g}/{i}" for i in range(group_size)]
        if any(s in trained for s in samples):
            outcome[g] = "trained"
        elif any(s in stale for s in samples):
            outcome[g] = "stale"
        elif g in no_signal:
            outcome[g] = "no_signal"
        elif g in dead_groups:
            outcome[g] = "dead_lettered"
        elif g in flight_groups:
            outcome[g] = "in_flight"
        else:
            outcome[g] = "lost"
    terms = Counter(outcome.values())

    rollouts_groups = set(flight.get("rollouts_groups", []))
    samples_lost, conflicting = 0, 0
    for g, o in outcome.items():
        for s in (f"{g}/{i}" for i in range(group_size)):
            final = [s in trained, s in stale, g in no_signal, s in dead_samples or g in dead_whole]
            conflicting += sum(final) > 1
            waiting = s in flight_samples or g in rollouts_groups
            samples_lost += o in ("trained", "stale") and not any(final) and not waiting
    seen_downstream = batched | {_group_of(s) for s in trained} | no_signal
    reasons = Counter(d["reason"].split(":")[0] for d in dead)
    return {
        "groups_produced": len(produced),
        "groups_trained": terms["trained"],
        "groups_stale": terms["stale"],
        "groups_no_signal": terms["no_signal"],
        "groups_dead_lettered": terms["dead_lettered"],
        "groups_in_flight_at_end": terms["in_flight"],
        "groups_lost": terms["lost"],
        "groups_duplicated": len({_group_of(s) for s, n in trained.items() if n > 1}),
        "groups_batched": len(batched & produced),
        "groups_not_recorded_as_produced": len(seen_downstream - produced),
        "samples_lost": samples_lost,
        "samples_conflicting": conflicting,
        "dead_letters": len(dead),
        "dead_letter_reasons": dict(reasons),
        "in_flight_undecodable": len(flight.get("bad", [])),
        "groups_lost_ids": sorted(g for g, o in outcome.items() if o == "lost"),
    }


def conserved(terms: dict[str, Any]) -> bool:
    """produced = trained + stale + no_signal + dead_lettered + in_flight + lost."""
    parts = ("trained", "stale", "no_signal", "dead_lettered", "in_flight_at_end", "lost")
    return terms["groups_produced"] == sum(terms[f"groups_{p}"] for p in parts)
