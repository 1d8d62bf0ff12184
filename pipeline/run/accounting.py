"""Where every published group ended: the account behind ``summary.json`` and
the faults benchmark, checked across sources that do not derive from each other.

::

    reads   metrics.jsonl, each pool's own records: the actors' ``group`` records (a
            group id and its sample count, written once the XADD was acknowledged;
            ``group_unconfirmed`` before it),
            the preprocessors' ``batched`` and ``no_signal``, the trainer's ``step``
            (``sample_ids`` trained, ``stale_ids`` dropped) and ``resume``; from Redis
            (while the run's server is up) the entries physically in ``rollouts`` and
            ``batches`` that their consumer group has not acknowledged (unread, or in
            its pending list), the batches past the trainer's resume position (a
            restart reads them again), and the dead-letter stream
    writes  nothing; :func:`account` returns the counts and the discrepancies by id,
            :func:`problems` says each discrepancy in one line

The check: every sample the actors recorded as published must be found again
somewhere else: trained or rejected as stale in a trainer step that survived (steps
undone by a trainer restart do not count), dropped for no signal by a preprocessor,
dead-lettered, or still in a stream (in flight); one found nowhere is **lost** (by
group id when none of the group's samples is found, else by sample id). A sample
in two surviving steps is **duplicated**; an id the trainer, a preprocessor or a
stream holds that no actor recorded as published is a **phantom**; a sample with
two final outcomes (trained, stale, no signal, dead-lettered) is **conflicting**,
except one: a copy of a trained sample that reaches the trainer again in a later step
(an entry re-read after a restart, packed into a batch with another id; a work-stream
XADD retried after its reply was lost makes no copy: XADD-once, pipeline/streams/durable.py)
is dropped as a duplicate while the trainer's dedupe window still holds its id, and
after that as stale (trainer/batches.py): "trained at
step k, stale at a step after k" is that second copy turned away, **redelivered**
(listed, not a problem). Stale at or before the step that trained it stays a conflict.

The counts (``groups_trained``, ``groups_in_flight_at_end``, ...) give each
published group its first outcome in that order, for the summary; they add up by
construction and prove nothing on their own: the id lists do.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import redis

from pipeline.messages import BadEntry, RolloutGroup, TrainBatch, decode
from pipeline.streams import Names
from pipeline.streams.shards import Shards, parse_position, parts_of
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
) -> list[tuple[bytes, dict, str]]:
    """Entries of ``stream`` the consumer group has not acknowledged (unread or pending),
    or newer than ``after`` (a resume position: a restarted consumer reads them again);
    every entry when the group does not exist yet. Each with where it lies: ``unread``,
    ``pending:<consumer>`` (in the group's PEL) or ``after-resume-position``."""
    try:
        info = next((g for g in client.xinfo_groups(stream) if g["name"] == group.encode()), None)
    except redis.ResponseError:  # no such stream: nothing in it
        return []
    entries = client.xrange(stream)
    if info is None:
        return [(i, f, "unread") for i, f in entries]
    delivered = info["last-delivered-id"].decode()
    last = after if after is not None and _newer(delivered, after) else delivered
    pending = {
        p["message_id"].decode(): p["consumer"].decode()
        for p in client.xpending_range(stream, group, "-", "+", max(1, int(info["pending"])))
    }
    out = []
    for i, f in entries:
        eid = i.decode()
        if eid in pending:
            out.append((i, f, f"pending:{pending[eid]}"))
        elif _newer(eid, delivered):
            out.append((i, f, "unread"))
        elif _newer(eid, last):
            out.append((i, f, "after-resume-position"))
    return out


def in_flight(
    client: redis.Redis,
    names: Names,
    shards: Shards | None = None,
    trainer_from: str | None = None,
) -> dict[str, list]:
    """Group ids still in ``rollouts`` and sample ids still in ``batches``, not yet
    acknowledged by their consumer group, in every part of the run (``shards``: the
    partitions of redis.mode=cluster; None: the one part on ``client``); undecodable
    entries by entry id (``k@id`` in partition k > 0). ``trainer_from``: the position a
    restarted trainer resumes from (its last checkpoint's, one id per partition,
    comma-separated): the batches after it are in flight too, acknowledged or not,
    since a resume reads them again (a trainer stopped between a step's acknowledgement
    and its record left some).

    ``entries`` shows where each of those ids physically lies: one item per stream
    entry with its ``stream``, ``shard``, entry ``id``, ``where`` (``unread``,
    ``pending:<consumer>``, ``after-resume-position``) and the ``ids`` it holds."""
    groups, samples, bad, entries = set(), set(), [], []
    parts = parts_of(client, names, shards)
    n = len(parts)
    starts = parse_position(trainer_from, n) if trainer_from else [None] * n
    for (k, shard, part_names), start in zip(parts, starts, strict=True):
        tag = f"{k}@" if k else ""
        reads = (
            ("rollouts", _unconsumed(shard, part_names.rollouts, PREPROCESSOR_GROUP)),
            ("batches", _unconsumed(shard, part_names.batches, TRAINER_GROUP, start)),
        )
        for stream, found in reads:
            for entry_id, fields, where in found:
                item = {"stream": stream, "shard": k, "id": entry_id.decode(), "where": where}
                try:
                    if stream == "rollouts":
                        item["ids"] = [decode(fields[b"data"], RolloutGroup).group_id]
                        groups.update(item["ids"])
                    else:
                        item["ids"] = _sample_ids(decode(fields[b"data"], TrainBatch))
                        samples.update(item["ids"])
                except (BadEntry, KeyError, ValueError):
                    bad.append(f"{stream}/{tag}{item['id']}")
                    item["ids"] = []
                entries.append(item)
    try:  # episode groups open in the journal (actor/journal.py): in flight too
        journal = sorted(g.decode() for g in client.hgetall(names.episode_claims))
    except redis.ResponseError:
        journal = []
    return {
        "rollouts_groups": sorted(groups),
        "batches_samples": sorted(samples),
        "episode_groups": journal,
        "bad": bad,
        "entries": entries,
    }


def episode_account(
    records: list[dict], flight: dict[str, list], dead: list[dict[str, Any]] = ()
) -> dict[str, Any]:
    """task.kind=env: every group of episodes an actor opened (its ``episode_group``
    records) was published (a ``group`` record), dropped (its first turn failed in the
    engine), dead-lettered (refused whole when taken over: actor/journal.py, found by
    its ``dead_lettered`` record or by its entry in the dead-letter stream, ``dead``,
    whichever survived; its reason in ``episode_groups_dead_lettered_reasons``), or is
    still open in the episode journal (``flight["episode_groups"]``, read from Redis:
    without it nothing is said); else it is lost. A group published more than once (an
    actor that took it over and the one that woke up) is one entry (XADD-once on its
    id); its ``group`` records beyond the first are ``republished``. Episodes resumed /
    restarted by a takeover are summed from the records."""
    opened, dropped, taken = set(), set(), set()
    refused = {g: d["reason"] for d in dead for g in d.get("episode_groups", [])}
    resumed = restarted = 0
    for r in records:
        if r.get("event") != "episode_group":
            continue
        if r["action"] == "dropped":
            dropped.add(r["group"])
            continue
        if r["action"] == "dead_lettered":
            refused.setdefault(r["group"], r.get("reason", ""))
            continue
        opened.add(r["group"])
        if r["action"] == "taken_over":
            taken.add(r["group"])
            resumed += int(r.get("resumed", 0))
            restarted += int(r.get("restarted", 0))
    if not opened:
        return {}
    pub = Counter(r["group"] for r in records if r.get("event") == "group")
    out: dict[str, Any] = {
        "episode_groups_opened": len(opened),
        "episode_groups_taken_over": len(taken),
        "episode_groups_published": len(opened & set(pub)),
        "episode_groups_dropped": len(opened & dropped),
        "episode_groups_dead_lettered": len(opened & set(refused)),
        "episode_groups_dead_lettered_reasons": {
            g: refused[g] for g in sorted(opened & set(refused))
        },
        "episode_groups_republished": sum(n - 1 for g, n in pub.items() if g in opened and n > 1),
        "episodes_resumed": resumed,
        "episodes_restarted": restarted,
    }
    if "episode_groups" in flight:
        open_now = set(flight["episode_groups"])
        lost = sorted(opened - set(pub) - dropped - set(refused) - open_now)
        out["episode_groups_open_at_end"] = len(opened & open_now - set(pub))
        out["episode_groups_lost_ids"] = lost
        out["episode_groups_lost"] = len(lost)
    return out


def _role_of(source: str) -> str:
    """The pool that dead-letters entries of ``source``: rollouts are read by the
    preprocessors, batches by the trainer."""
    return {"rollouts": "preprocessor", "batches": "trainer"}.get(source.rsplit(":", 1)[-1], "")


def dead_letters(client: redis.Redis, names: Names) -> list[dict[str, Any]]:
    """Every dead-letter entry: its source stream, the consumer that wrote it and
    its ``role`` (preprocessor or trainer; actor for a group it could not publish),
    reason, and the groups (rollouts) or samples (batches) its payload names; ``groups``
    falls back to the entry's plain ``group`` field when the payload does not decode.
    An episode group the journal refused at take-over (source ``<run>:episodes:<id>``,
    actor/journal.py) was never published: its id is in ``episode_groups`` instead."""
    out = []
    episodes = names.episode("")  # the journal's keys start so
    for entry_id, f in client.xrange(names.dead):
        text = {
            k.decode(): v.decode(errors="replace")
            for k, v in f.items()
            if k != b"data" and not k.startswith(b"journal:")  # a refused journal's raw fields
        }
        item = {"id": entry_id.decode(), "source": text.get("source", ""), "reason": ""}
        item["reason"] = text.get("reason", "")
        item["consumer"] = text.get("consumer", "")
        # an actor's own dead letter (a group too big to publish) names its role
        item["role"] = text.get("role") or _role_of(item["source"])
        item["groups"], item["samples"], item["episode_groups"] = [], [], []
        if item["source"].startswith(episodes):
            item["episode_groups"] = [text.get("group", "")]
            out.append(item)
            continue
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


def published(records: list[dict], group_size: int) -> dict[str, int]:
    """Group id -> its number of samples, from the actors' own ``group`` records (each
    written by the actor once its XADD was acknowledged); ``group_size`` for a record
    without ``samples``."""
    return {
        r["group"]: int(r.get("samples", group_size)) for r in records if r.get("event") == "group"
    }


def account(
    records: list[dict],
    flight: dict[str, list],
    dead: list[dict[str, Any]],
    group_size: int,
) -> dict[str, Any]:
    """The account of every published group and sample (see the module doc): the count
    of each outcome, and by id each discrepancy between the independent sources:
    ``lost_ids``, ``duplicated_ids``, ``phantom_ids``, ``conflicting_ids``
    (:func:`problems` says them in words)."""
    sizes = published(records, group_size)
    batched = {g for r in records if r.get("event") == "batched" for g in r["groups"]}
    no_signal = {g for r in records if r.get("event") == "no_signal" for g in r["groups"]}
    steps = surviving_steps(records)
    trained = Counter(sid for s in steps for sid in s.get("sample_ids", []))
    stale = {sid for s in steps for sid in s.get("stale_ids", [])}
    # a step not applied (non-finite): its fresh samples were dead-lettered, its stale ones
    # are listed in its record
    stale |= {sid for r in records if r.get("event") == "nonfinite_step" for sid in r["stale_ids"]}
    dead_samples = {sid for d in dead for sid in d["samples"]}
    dead_whole = {g for d in dead for g in d["groups"]}  # rollouts entries: whole groups
    flight_rollouts = set(flight.get("rollouts_groups", []))
    flight_samples = set(flight.get("batches_samples", []))
    # a group the actor began to send and never confirmed (its ``group_unconfirmed`` record,
    # written before each XADD, with no ``group`` record after it: the reply never came, or
    # the actor was killed first; actor/publish.py send_group): published if the group turns
    # up anywhere, not published (and so not lost) if it does not
    seen = batched | no_signal | dead_whole | flight_rollouts
    seen |= {_group_of(s) for s in set(trained) | stale | dead_samples | flight_samples}
    unconfirmed = {
        r["group"]: int(r.get("samples", group_size))
        for r in records
        if r.get("event") == "group_unconfirmed" and r["group"] not in sizes
    }
    sizes |= {g: n for g, n in unconfirmed.items() if g in seen}
    pub_samples = {f"{g}/{i}" for g, n in sizes.items() for i in range(n)}

    trained_at: dict[str, list[int]] = {}
    stale_at: dict[str, list[int]] = {}
    for st in steps:
        for sid in st.get("sample_ids", []):
            trained_at.setdefault(sid, []).append(st["step"])
        for sid in st.get("stale_ids", []):
            stale_at.setdefault(sid, []).append(st["step"])

    def finals(g: str, s: str) -> list[bool]:  # a sample's final outcomes
        return [s in trained, s in stale, g in no_signal, s in dead_samples or g in dead_whole]

    def said(s: str) -> str:  # a conflicting sample's outcomes, with the trainer's steps
        g, parts = _group_of(s), []
        if s in trained:
            parts.append("trained at step " + ",".join(map(str, trained_at[s])))
        if s in stale:
            parts.append("stale at step " + ",".join(map(str, stale_at[s])))
        if g in no_signal:
            parts.append("no signal")
        if s in dead_samples or g in dead_whole:
            parts.append("dead-lettered")
        return "; ".join(parts)

    def somewhere(g: str, s: str) -> bool:
        return any(finals(g, s)) or s in flight_samples or g in flight_rollouts

    outcome: dict[str, str] = {}  # a group's first outcome, for the counts
    lost: list[str] = []
    for g in sorted(sizes):
        samples = [f"{g}/{i}" for i in range(sizes[g])]
        missing = [s for s in samples if not somewhere(g, s)]
        if len(missing) == len(samples):
            lost.append(g)  # the whole group is nowhere
        else:
            lost.extend(missing)
        if any(s in trained for s in samples):
            outcome[g] = "trained"
        elif any(s in stale for s in samples):
            outcome[g] = "stale"
        elif g in no_signal:
            outcome[g] = "no_signal"
        elif g in dead_whole or any(s in dead_samples for s in samples):
            outcome[g] = "dead_lettered"
        elif g in flight_rollouts or any(s in flight_samples for s in samples):
            outcome[g] = "in_flight"
        else:
            outcome[g] = "lost"
    terms = Counter(outcome.values())
    # a later copy of a trained sample turned away as stale: every stale step after its
    # one training step, and no other outcome (see the module doc)
    redelivered = sorted(
        s
        for s in pub_samples
        if len(trained_at.get(s, ())) == 1
        and min(stale_at.get(s, [0])) > trained_at[s][0]
        and finals(_group_of(s), s) == [True, True, False, False]
    )
    conflicting = sorted(
        s for s in pub_samples if sum(finals(_group_of(s), s)) > 1 and s not in redelivered
    )
    seen_samples = set(trained) | stale | dead_samples | flight_samples
    seen_groups = batched | no_signal | dead_whole | flight_rollouts
    phantom = sorted(s for s in seen_samples if s not in pub_samples)
    phantom += sorted(g for g in seen_groups if g not in sizes)
    duplicated = sorted(s for s, n in trained.items() if n > 1)
    reasons = Counter(d["reason"].split(":")[0] for d in dead)
    return {
        **episode_account(records, flight, dead),
        "groups_produced": len(sizes),
        "groups_trained": terms["trained"],
        "groups_stale": terms["stale"],
        "groups_no_signal": terms["no_signal"],
        "groups_dead_lettered": terms["dead_lettered"],
        "groups_in_flight_at_end": terms["in_flight"],
        "groups_lost": terms["lost"],
        "groups_duplicated": len({_group_of(s) for s in duplicated}),
        "groups_batched": len(batched & set(sizes)),
        "samples_produced": len(pub_samples),
        "samples_trained": sum(s in pub_samples for s in trained),
        "samples_lost": sum("/" in x for x in lost),  # of groups found in part
        "samples_conflicting": len(conflicting),
        "samples_redelivered_stale": len(redelivered),
        "dead_letters": len(dead),
        "dead_letter_reasons": dict(reasons),
        "in_flight_undecodable": len(flight.get("bad", [])),
        "groups_lost_ids": [x for x in lost if "/" not in x],
        "lost_ids": lost,
        "duplicated_ids": duplicated,
        "phantom_ids": phantom,
        "conflicting_ids": conflicting,
        "conflicting_outcomes": {c: said(c) for c in conflicting},
        "redelivered_ids": redelivered,
    }


def problems(terms: dict[str, Any]) -> list[str]:
    """Every discrepancy of an account, one line each naming the id; empty when the
    actors', the streams' and the consumers' records agree."""
    say = {
        "lost_ids": "lost: {} (published by an actor; not trained, dropped, dead-lettered "
        "or in a stream)",
        "episode_groups_lost_ids": "lost: episode group {} (opened by an actor; never "
        "published, not dropped, and no longer in the episode journal)",
        "duplicated_ids": "duplicated: {} (trained in two surviving steps)",
        "phantom_ids": "phantom: {} (trained, dropped or in a stream, never published by an actor)",
        "conflicting_ids": "conflicting: {} (two final outcomes: trained, stale, no signal, "
        "dead-lettered)",
    }
    outcomes = terms.get("conflicting_outcomes", {})  # which outcomes, in which steps
    return [
        f"conflicting: {x} ({outcomes[x]})"
        if key == "conflicting_ids" and x in outcomes
        else text.format(x)
        for key, text in say.items()
        for x in terms.get(key, [])
    ]
