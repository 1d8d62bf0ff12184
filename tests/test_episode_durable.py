"""Episodes durable in Redis (actor/journal.py), real redis-server: each finished turn
is written as the episode goes; a real actor process (hf engine, tiny random model)
SIGKILLed after a finished turn, or during a slow tool call, loses no episode: its
groups are taken over by itself restarted, or by another actor once its lease ran
out, from the last written turn with identical ids, log-probs and versions; the
accounting finds 0 groups lost and none duplicated. In process: an environment that
is not resumable restarts its episodes (counted), a zombie's writes are fenced off,
and an environment that raises ends its episode as an infra failure, never the actor."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest

from actor.engines.hf import HFEngine
from actor.episodes import EpisodeRunner, episode_counts, publish_episodes
from actor.journal import EpisodeState, Journal, episode_delta, read_group
from pipeline.messages import (
    SCHEMA_VERSION,
    BadEntry,
    EpisodeDelta,
    EpisodeOpen,
    RolloutGroup,
    decode,
    encode,
    pack_f32,
    pack_i32,
    pack_u8,
    rle_decode,
    rle_encode,
    unpack_f32,
    unpack_i32,
)
from pipeline.models import load_model
from pipeline.run.accounting import account, in_flight, problems
from pipeline.streams import Names
from pipeline.telemetry import Window, read_jsonl
from tests.config_builders import actor_config
from tests.episode_builders import DurableEnv, RestartingEnv, actor_pool, env_config
from tests.launching import ROOT, tiny_cache, wait_until

NAMES = Names("nonstop", "tiny")  # +exp=tiny's run


def _journal(client, names: Names) -> dict[str, dict[int, EpisodeState]]:
    """Every open group in the journal: group id -> episode index -> its state as the
    journal's deltas assemble it (actor/journal.py read_group, as a take-over reads it)."""
    out = {}
    for gid in client.hgetall(names.episode_claims):
        fields = client.hgetall(names.episode(gid.decode()))
        out[gid.decode()] = read_group(fields).states if fields else {}
    return out


def _published(client, names: Names) -> list[RolloutGroup]:
    return [decode(f[b"data"], RolloutGroup) for _, f in client.xrange(names.rollouts)]


def _prefix_kept(state: EpisodeState, sample) -> None:
    """The published episode starts with exactly what the journal held of it."""
    ids = np.frombuffer(state.ids, dtype="<i4")
    assert sample.tokens()[: ids.size].tolist() == ids.tolist()
    assert sample.sampled()[: ids.size].tolist() == list(np.frombuffer(state.mask, np.uint8) == 1)
    n = len(state.logprobs) // 4
    assert unpack_f32(sample.logprobs)[:n].tolist() == unpack_f32(state.logprobs).tolist()
    assert sample.token_versions()[:n].tolist() == rle_decode(state.versions).tolist()


def _start(tmp_path, config: str, name: str) -> subprocess.Popen:
    env = dict(
        os.environ,
        NONSTOP_CACHE=tiny_cache(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
        NONSTOP_RUN_SECRET="s" * 32,
    )
    log = open(tmp_path / f"{name}.log", "ab")  # noqa: SIM115
    cmd = [sys.executable, "-m", "actor", "--config", config, "--name", name]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)


def _config(tmp_path, url: str, *extra: str) -> str:
    return actor_config(
        tmp_path,
        url,
        "task.kind=env",
        "task.env=tests.episode_builders:DurableEnv",
        "+task.env_args.turns=3",
        "task.episode.max_turns=3",
        "task.episode.max_tokens=64",
        "task.episode.takeover_s=2",
        "sampling.max_new_tokens=8",
        "sampling.prompts_per_batch=1",
        "task.group_size=2",
        "actor.max_queue_groups=1000",
        *extra,
    )


def _kill_and_take_over(tmp_path, rclient, config: str, ready, successor: str):
    """Start actor-0, SIGKILL it once ``ready(journal)`` holds, snapshot the journal,
    start ``successor`` and wait until every snapshotted group is published; returns
    the snapshot, the published groups and the successor's status."""
    first = _start(tmp_path, config, "actor-0")
    snapshot: dict = {}
    try:
        wait_until(lambda: ready(_journal(rclient, NAMES)), timeout=60, every=0.02)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        snapshot = _journal(rclient, NAMES)
    finally:
        first.kill()
        first.wait()
    written = {g: s for g, s in snapshot.items() if any(not st.done for st in s.values())}
    assert written, "the actor was killed with no episode in flight: nothing to take over"
    second = _start(tmp_path, config, successor)
    try:

        def all_published() -> bool:
            return set(written) <= {g.group_id for g in _published(rclient, NAMES)}

        wait_until(all_published, timeout=60, every=0.1)
    finally:
        second.terminate()
        second.wait(30)
    assert second.returncode == 0, (tmp_path / f"{successor}.log").read_text()[-3000:]
    status = {k.decode(): v.decode() for k, v in rclient.hgetall(NAMES.status(successor)).items()}
    return written, _published(rclient, NAMES), status


def _check(tmp_path, rclient, written: dict, published: list[RolloutGroup], status: dict):
    by_id: dict[str, list[RolloutGroup]] = {}
    for g in published:
        by_id.setdefault(g.group_id, []).append(g)
    assert all(len(v) == 1 for v in by_id.values()), "a group was published twice"
    resumed = 0
    for gid, states in written.items():
        (group,) = by_id[gid]
        group.check()
        for k, st in states.items():
            _prefix_kept(st, group.samples[k])
            resumed += 1
    assert int(status["episodes_resumed"]) >= resumed
    assert int(status["episode_groups_taken_over"]) >= len(written)
    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    terms = account(records, in_flight(rclient, NAMES), [], 2)
    assert terms["episode_groups_lost"] == 0 and terms["groups_lost"] == 0, terms
    assert terms["duplicated_ids"] == [] and problems(terms) == [], problems(terms)
    assert terms["episode_groups_taken_over"] >= len(written)
    assert terms["episodes_resumed"] >= resumed
    # the same account finds a group opened, never published and gone from the journal
    vanished = {"event": "episode_group", "group": "actor-0:gone", "action": "opened"}
    terms = account([*records, vanished], in_flight(rclient, NAMES), [], 2)
    assert (
        terms["episode_groups_lost"] == 1
        and "lost: episode group actor-0:gone" in problems(terms)[0]
    )


def test_an_actor_killed_after_a_finished_turn_resumes_its_episodes_when_restarted(
    tmp_path, redis_server, rclient
):
    """SIGKILL once an episode has a finished turn written and is not done; the same
    actor name restarted takes its groups back at once. The environment answers from
    turn 1 on after 3 s, so an episode is in flight for seconds once its first turn is
    written (8-token turns of the tiny model otherwise finish an episode between two
    looks at the journal, and the kill found nothing to take over)."""
    config = _config(
        tmp_path, redis_server.url, "+task.env_args.tool_s=3", "+task.env_args.slow_from=1"
    )

    def ready(journal) -> bool:
        return any(st.turns > 0 and not st.done for s in journal.values() for st in s.values())

    written, published, status = _kill_and_take_over(tmp_path, rclient, config, ready, "actor-0")
    _check(tmp_path, rclient, written, published, status)


def test_an_actor_killed_in_a_slow_tool_call_is_taken_over_by_another(
    tmp_path, redis_server, rclient
):
    """SIGKILL while a tool call sleeps (3 s); actor-1 takes the group over once
    actor-0's lease (task.episode.takeover_s=2) ran out, and resumes it."""
    marker = tmp_path / "tool"
    marker.mkdir()
    config = _config(
        tmp_path, redis_server.url, "+task.env_args.tool_s=3", f"+task.env_args.marker={marker}"
    )

    def ready(journal) -> bool:  # a turn written, and a tool call running now
        return any(st.turns for s in journal.values() for st in s.values()) and any(
            marker.iterdir()
        )

    written, published, status = _kill_and_take_over(tmp_path, rclient, config, ready, "actor-1")
    _check(tmp_path, rclient, written, published, status)


# ---------------------------------------------------------------- in process


def _runner(tiny, env_cls, rclient, actor: str, lease_s: float = 30.0, seed=3, **env_args):
    model, tok = load_model(tiny)
    engine = HFEngine(model, tok, temperature=0.7, top_p=1.0, top_k=0, seed=seed)
    engine.stop_ids = set()  # every turn runs to its token limit
    cfg = env_config(f"tests.episode_builders:{env_cls.__name__}", max_turns=3)
    cfg.task.env_args = {"turns": 3, **env_args}
    runner = EpisodeRunner(cfg, engine, tok, env_cls, seed=0)
    runner.journal = Journal(rclient, Names("test", "journal"), actor, lease_s)
    return runner


def _stopped_after_one_turn(runner) -> str:
    """Open a group, run its first turn, stop inside the second: the journal holds it."""
    grp = runner.open_group(runner.tasks.sample(), 2, "actor-0:g1")

    def should_stop() -> bool:  # inside turn 1's generation
        return any(ep.offsets for ep in grp.episodes)

    assert runner.drive([grp], should_stop=should_stop) is None
    return grp.group_id


@pytest.mark.parametrize("env_cls", [DurableEnv, RestartingEnv])
def test_a_taken_over_group_resumes_or_restarts_by_what_its_environment_declares(
    tiny, rclient, env_cls
):
    names = Names("test", "journal")
    first = _runner(tiny, env_cls, rclient, "actor-0")
    gid = _stopped_after_one_turn(first)
    first.journal.close()  # "killed": no more renewals
    (states,) = _journal(rclient, names).values()
    assert sorted(states) == [0, 1] and all(st.turns == 1 for st in states.values())
    # restarted (another sampling seed: what it samples differs from what was written)
    again = _runner(tiny, env_cls, rclient, "actor-0", seed=4)  # takes its own at once
    grp = again.take_over()
    assert grp is not None and grp.group_id == gid
    assert again.drive([grp]) == [grp]
    again.close()
    first.close()
    counts = episode_counts(grp.episodes)
    for k, ep in enumerate(grp.episodes):
        sample = ep.to_sample(k)
        sample.check("episode")
        assert sample.turns() == 3
        if env_cls.resumable:
            _prefix_kept(states[k], sample)
        else:  # begun again: its first turn sampled anew
            written = np.frombuffer(states[k].ids, dtype="<i4").tolist()
            assert sample.tokens()[: len(written)].tolist() != written
    if env_cls.resumable:
        assert counts.get("episodes_resumed") == 2 and not counts.get("episodes_restarted")
    else:
        assert counts.get("episodes_restarted") == 2 and not counts.get("episodes_resumed")


def test_a_group_is_taken_over_only_after_its_lease_ran_out_and_the_old_owner_is_fenced(
    tiny, rclient
):
    first = _runner(tiny, DurableEnv, rclient, "actor-0", lease_s=1.5)
    _stopped_after_one_turn(first)
    other = _runner(tiny, DurableEnv, rclient, "actor-1", lease_s=1.5)
    assert other.take_over() is None  # actor-0 renews its lease: still its own
    first.journal.close()  # actor-0 stops renewing (it hangs, or died)
    time.sleep(1.7)
    grp = other.take_over()
    assert grp is not None and all(ep.resumed for ep in grp.episodes)
    ep = first.journal  # actor-0 wakes up: its writes no longer land
    key = Names("test", "journal").episode(grp.group_id)
    before = rclient.hgetall(key)
    assert not ep.write(grp.group_id, episode_delta(grp.episodes[0], 0, b"")) and (
        grp.group_id in ep.lost
    )
    assert not ep.forget(grp.group_id, [b.decode() for b in before if b != b"open"])
    assert rclient.hgetall(key) == before
    other.close()
    first.close()


def test_an_environment_that_raises_ends_its_episode_as_an_infra_failure(tiny, rclient, tmp_path):
    """The environment's step raises on turn 1 of every episode: each episode ends as
    an infrastructure failure after its first turn, counted; the actor goes on and
    publishes the groups."""
    runner = _runner(tiny, DurableEnv, rclient, "actor-0", raise_on=1)
    names = Names("test", "journal")
    pool = actor_pool(runner.cfg, rclient, names, str(tmp_path / "metrics.jsonl"))
    runner.on_env_error = lambda what: pool.status.incr(f"env_errors.{what}")
    assert publish_episodes(pool, runner, Window(10), prompts_n=2) == 2
    runner.close()
    groups = _published(rclient, names)
    assert len(groups) == 2
    for g in groups:
        g.check()
        assert [s.infra_failure for s in g.samples] == [True, True]
        assert [s.tool_outcomes for s in g.samples] == [["ok", "infra"]] * 2
    assert runner.env_errors["step"] == 4
    assert int(rclient.hget(pool.status.key, "env_errors.step")) == 4
    assert int(rclient.hget(pool.status.key, "infra_failures")) == 4
    assert rclient.hgetall(names.episode_claims) == {}  # published: the journal is empty


def test_an_environment_whose_reset_raises_opens_no_group_and_the_actor_goes_on(tiny, rclient):
    runner = _runner(tiny, DurableEnv, rclient, "actor-0", raise_in_reset=True)
    assert runner.open_group(runner.tasks.sample(), 2, "actor-0:g") is None
    runner.close()
    assert runner.env_errors["reset"] == 1  # one group failed to open
    assert rclient.hgetall(Names("test", "journal").episode_claims) == {}  # nothing opened


def test_the_hf_engine_stops_a_row_at_the_id_that_completes_a_stop_string(tiny):
    """The environment's stop strings are the hf engine's own: the same seeded draw with
    a stop string taken from its text ends at the id that completes it, not EOS."""
    from actor.episodes import cut_at_stop

    model, tok = load_model(tiny)

    def draw(stops: tuple[str, ...]):
        engine = HFEngine(model, tok, temperature=0.7, top_p=1.0, top_k=0, seed=5)
        engine.stop_ids, engine.stop_strings = set(), stops
        return engine.generate([[1, 2, 3], [4, 5, 6]], 24)

    free = draw(())
    # a stop string that first completes inside the draw of row 0, past its start
    text = tok.decode(free[0].tokens[6:10])
    stop = text[-3:] if len(text) >= 3 else text
    outs = draw((stop,))
    for before, after in zip(free, outs, strict=True):
        at = cut_at_stop(tok, before.tokens, (stop,))
        want = len(before.tokens) if at is None else at
        assert after.tokens == before.tokens[:want] and not after.finished
        assert after.logprobs == before.logprobs[:want]
    assert len(outs[0].tokens) < 24  # row 0 did stop early


def test_a_journal_of_another_schema_is_refused_with_the_reason(rclient, caplog):
    """A group an older build left in the journal: not taken over (its layout is not
    this build's), logged with the reason, dead-lettered, its claim and entry removed."""
    from pipeline.messages import EpisodeOpen, encode, pack_i32
    from pipeline.tasks import Problem

    names = Names("test", "journal")
    old = EpisodeOpen(
        schema=1,
        group_id="actor-9:old",
        actor="actor-9",
        problem=Problem(id="p", question="q", answer="1"),
        prompt_ids=pack_i32([1, 2]),
        group_size=2,
    )
    rclient.hset(names.episode_claims, "actor-9:old", "actor-9/dead 0")  # lease long gone
    rclient.hset(names.episode("actor-9:old"), "open", encode(old))
    journal = Journal(rclient, names, "actor-0", 30.0)
    with caplog.at_level("ERROR", logger="actor"):
        assert journal.take_over() is None
    journal.close()
    assert "actor-9:old cannot be taken over: schema version 1" in caplog.text
    assert rclient.hgetall(names.episode_claims) == {}
    assert not rclient.exists(names.episode("actor-9:old"))
    ((_, dead),) = rclient.xrange(names.dead)  # kept, with the reason, for the operator
    assert dead[b"journal:open"] == encode(old) and b"schema version 1" in dead[b"reason"]


def _refused_journal(rclient, names: Names, gid: str, how: str) -> dict[bytes, bytes]:
    """A group of 2 episodes (one turn each) left in the journal by a dead actor (lease
    long gone, its ``opened`` record written), its ``open`` field made unreadable:
    ``corrupt`` (bytes that do not decode) or ``schema`` (another build's); its fields
    as written."""
    fields = _group_fields(1)
    if how == "corrupt":
        fields[b"open"] = b"\x93garbage"
    else:
        raw = msgspec.msgpack.decode(fields[b"open"])
        fields[b"open"] = msgspec.msgpack.encode({**raw, "schema": 1, "group_id": gid})
    rclient.hset(names.episode_claims, gid, "actor-9/dead 0")
    rclient.hset(names.episode(gid), mapping=fields)
    return fields


REFUSED = {
    "corrupt": "not a valid EpisodeOpen",
    "schema": "schema version 1",
}


@pytest.mark.parametrize("how", sorted(REFUSED))
def test_a_group_refused_whole_at_take_over_is_dead_lettered_and_counted_not_lost(
    rclient, tmp_path, caplog, how
):
    """A group whose ``open`` field does not decode, or is another schema's: the actor
    taking it over dead-letters it (``<run>:dead``: role actor, the reason, every raw
    field of its journal), deletes its journal and goes on to the next group; the
    account counts it dead-lettered with the reason, not lost (from the actor's record,
    and from the dead letter alone when the actor died before writing its record)."""
    from actor.episodes import dead_lettered_as
    from pipeline.run.accounting import dead_letters

    names, metrics = Names("test", "refused"), str(tmp_path / "metrics.jsonl")
    pool = actor_pool(env_config(), rclient, names, metrics, name="actor-1")
    bad = "actor-9:bad"
    fields = _refused_journal(rclient, names, bad, how)
    good = _group_fields(1)  # another group the dead actor left: readable
    rclient.hset(names.episode_claims, "actor-0:g", "actor-0/dead 0")
    rclient.hset(names.episode("actor-0:g"), mapping=good)
    for gid in (bad, "actor-0:g"):  # the dead actors' own records of opening them
        pool.record(event="episode_group", group=gid, action="opened", resumed=0, restarted=0)
    journal = Journal(
        rclient, names, "actor-1", 30.0, on_dead_letter=lambda g, w: dead_lettered_as(pool, g, w)
    )
    taken = []
    with caplog.at_level("ERROR", logger="actor"):
        while (t := journal.take_over()) is not None:
            taken.append(t.opened.group_id)
    journal.close()
    assert taken == ["actor-0:g"]  # the actor went on
    assert f"episode group {bad} cannot be taken over: " in caplog.text
    assert REFUSED[how] in caplog.text and "dead-lettered" in caplog.text
    # the journal's hash and claim are gone; its raw fields are in the dead letters
    assert not rclient.exists(names.episode(bad))
    assert sorted(rclient.hgetall(names.episode_claims)) == [b"actor-0:g"]
    ((_, entry),) = rclient.xrange(names.dead)
    assert entry[b"source"] == names.episode(bad).encode() and entry[b"group"] == bad.encode()
    assert entry[b"role"] == b"actor" and entry[b"consumer"] == b"actor-1"
    assert REFUSED[how] in entry[b"reason"].decode()
    copied = {k.removeprefix(b"journal:"): v for k, v in entry.items() if k.startswith(b"journal:")}
    assert copied == fields
    status = pool.status.key
    assert int(rclient.hget(status, "episode_groups_dead_lettered")) == 1
    # the account: dead-lettered with its reason, none lost (actor-0:g still open)
    records = read_jsonl(metrics)
    assert [r["action"] for r in records if r.get("group") == bad] == ["opened", "dead_lettered"]
    flight = in_flight(rclient, names)
    for recs, dead in (
        (records, dead_letters(rclient, names)),
        (records, []),  # the dead-letter stream trimmed: the actor's record says it
        ([r for r in records if r.get("action") != "dead_lettered"], dead_letters(rclient, names)),
    ):
        terms = account(recs, flight, dead, 2)
        assert terms["episode_groups_lost"] == 0 and terms["episode_groups_dead_lettered"] == 1
        assert REFUSED[how] in terms["episode_groups_dead_lettered_reasons"][bad]
        assert terms["episode_groups_open_at_end"] == 1 and problems(terms) == []
        assert terms["phantom_ids"] == [] and terms["groups_dead_lettered"] == 0
    # without the fix the same group would be lost by the account
    bare = [r for r in records if r.get("action") != "dead_lettered"]
    assert account(bare, flight, [], 2)["episode_groups_lost_ids"] == [bad]


def test_a_refused_group_two_actors_take_over_is_dead_lettered_once(rclient, monkeypatch, caplog):
    """Actor A claims a refused group and reads it, then stalls past its lease; actor B
    takes it over and dead-letters it; A, awake, dead-letters nothing (it no longer
    holds the group: fenced). A group of that id found again (its journal written anew) is
    not dead-lettered a second time (XADD-once on the group id); its journal still goes."""
    import actor.journal as journal_mod

    names, gid = Names("test", "twice"), "actor-9:bad"
    _refused_journal(rclient, names, gid, "corrupt")
    told: list[tuple[str, str]] = []
    a = Journal(rclient, names, "actor-a", 30.0, on_dead_letter=lambda *x: told.append(("a", *x)))
    b = Journal(rclient, names, "actor-b", 30.0, on_dead_letter=lambda *x: told.append(("b", *x)))
    real, stalled = journal_mod.read_group, []

    def a_stalls(fields):  # A read the group; its lease runs out; B takes it over
        if not stalled:
            stalled.append(1)
            rclient.hset(names.episode_claims, gid, f"{a.owner} 0")
            assert b.take_over() is None
        return real(fields)

    monkeypatch.setattr(journal_mod, "read_group", a_stalls)
    with caplog.at_level("WARNING", logger="actor"):
        assert a.take_over() is None
    monkeypatch.setattr(journal_mod, "read_group", real)
    assert f"episode group {gid} was taken over by another actor meanwhile" in caplog.text
    assert [who for who, *_ in told] == ["b"] and rclient.xlen(names.dead) == 1
    assert not rclient.exists(names.episode(gid)) and rclient.hgetall(names.episode_claims) == {}
    _refused_journal(rclient, names, gid, "corrupt")  # the same group's journal again
    assert a.take_over() is None
    a.close()
    b.close()
    assert len(told) == 1 and rclient.xlen(names.dead) == 1
    assert not rclient.exists(names.episode(gid)) and rclient.hgetall(names.episode_claims) == {}


def test_a_refused_group_of_more_fields_than_an_entry_holds_is_dead_lettered_packed(rclient):
    """Past 3000 fields (what one XADD's arguments may hold in a script) the journal's
    fields go into the dead letter's ``data``, msgpack [name, value, ...], all of them."""
    names, gid = Names("test", "wide"), "actor-9:wide"
    fields = _refused_journal(rclient, names, gid, "corrupt")
    extra = {f"x{i}".encode(): b"v%d" % i for i in range(3500)}
    rclient.hset(names.episode(gid), mapping=extra)
    journal = Journal(rclient, names, "actor-1", 30.0)
    assert journal.take_over() is None
    journal.close()
    ((_, entry),) = rclient.xrange(names.dead)
    assert entry[b"journal"] == b"msgpack [name, value, ...] of 3503 fields in data"
    flat = msgspec.msgpack.decode(entry[b"data"])
    assert dict(zip(flat[::2], flat[1::2], strict=True)) == {**fields, **extra}
    assert not rclient.exists(names.episode(gid))


def _turn_delta(k: int, seq: int, **change) -> EpisodeDelta:
    """Episode ``k``'s delta ``seq`` of equal turns: 2 sampled ids (at version ``seq``),
    then 3 observation ids; ``change``: fields replaced."""
    start = 5 * seq
    fields = dict(
        schema=SCHEMA_VERSION,
        index=k,
        seq=seq,
        turns=seq + 1,
        start=start,
        ids=pack_i32([70 + seq, 71 + seq, 1, 2, 3]),
        mask=pack_u8([1, 1, 0, 0, 0]),
        logprobs=pack_f32([-0.5, -0.25]),
        versions=rle_encode([seq, seq]),
        offsets=pack_i32([start]),
        outcomes=["ok"],
        tool_calls=seq + 1,
    )
    return EpisodeDelta(**{**fields, **change})


def _group_fields(turns: int, **change) -> dict[bytes, bytes]:
    """A group of 2 episodes as HGETALL gives it, ``turns`` deltas each; ``change``:
    "<k>:<n>" -> the fields replaced in that delta (None: the delta deleted)."""
    from pipeline.tasks import Problem

    opened = EpisodeOpen(
        schema=SCHEMA_VERSION,
        group_id="actor-0:g",
        actor="actor-0",
        problem=Problem(id="p", question="q", answer="1"),
        prompt_ids=pack_i32([1, 2]),
        group_size=2,
    )
    fields = {b"open": encode(opened)}
    for k in range(2):
        for n in range(turns):
            what = change.get(f"{k}:{n}", {})
            if what is not None:
                fields[f"{k}:{n}".encode()] = encode(_turn_delta(k, n, **what))
    return fields


def test_the_journal_assembles_an_episode_from_its_deltas_in_order():
    taken = read_group(_group_fields(3))
    assert taken.refused == {} and taken.fields == {
        0: ["0:0", "0:1", "0:2"],
        1: ["1:0", "1:1", "1:2"],
    }
    st = taken.states[1]
    assert (st.index, st.deltas, st.turns, st.tool_calls, st.outcomes) == (1, 3, 3, 3, ["ok"] * 3)
    assert unpack_i32(st.ids).tolist() == [70, 71, 1, 2, 3, 71, 72, 1, 2, 3, 72, 73, 1, 2, 3]
    assert np.frombuffer(st.mask, np.uint8).tolist() == [1, 1, 0, 0, 0] * 3
    assert unpack_f32(st.logprobs).tolist() == [-0.5, -0.25] * 3
    assert rle_decode(st.versions).tolist() == [0, 0, 1, 1, 2, 2]
    assert unpack_i32(st.offsets).tolist() == [0, 5, 10]
    # an observation taken back (a last turn that sampled nothing): the next delta keeps
    # the ids before it and ends the episode
    end = dict(start=12, ids=b"", mask=b"", logprobs=b"", versions=b"", offsets=b"", turns=3)
    fields = _group_fields(4, **{"0:3": {**end, "outcomes": [], "done": True}})
    st = read_group(fields).states[0]
    assert st.done and st.deltas == 4 and len(st.mask) == 12 and st.turns == 3


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"0:1": None}, "episode 0 has deltas [0, 2]: delta 1 is missing (a gap in its turns)"),
        ({"0:1": {"schema": 3}}, "episode 0's delta 1: schema version 3, this build reads"),
        ({"0:1": {"extra": 1}}, "episode 0's delta 1: not a valid EpisodeDelta"),
        ({"0:1": {"index": 1}}, "episode 0's delta 1: it holds episode 1's delta 1"),
        ({"0:1": {"start": 7}}, "delta 1: it starts after id 7; the deltas before it hold 5"),
        ({"0:1": {"start": 1}}, "delta 1: it takes back sampled ids (it keeps 1 of 5 ids)"),
        ({"0:1": {"mask": pack_u8([1, 1, 0, 0])}}, "delta 1: it has 5 ids and 4 mask values"),
        (
            {"0:1": {"logprobs": pack_f32([-0.5])}},
            "delta 1: it has 1 log-probs and 2 versions for 2 sampled ids",
        ),
        ({"0:1": {"turns": 5}}, "delta 1: it says 5 turns; the deltas hold 2"),
        ({"0:1": {"offsets": pack_i32([7])}}, "delta 1: its turn offset 7 is not where"),
        ({"0:0": {"done": True}}, "delta 1: it follows the delta that ended the episode"),
    ],
)
def test_an_episode_whose_deltas_leave_a_gap_or_do_not_fit_is_refused_with_the_reason(
    change, reason
):
    """The episode is refused (it will restart), the group's other episode assembles."""
    if "extra" in (change.get("0:1") or {}):  # a field this build does not know
        fields = _group_fields(3)
        raw = msgspec.msgpack.decode(fields[b"0:1"])
        fields[b"0:1"] = msgspec.msgpack.encode({**raw, "extra": 1})
    else:
        fields = _group_fields(3, **change)
    taken = read_group(fields)
    assert sorted(taken.states) == [1] and sorted(taken.refused) == [0]
    assert reason in taken.refused[0], taken.refused[0]
    assert taken.fields[0] == [f.decode() for f in sorted(fields) if f.startswith(b"0:")]


@pytest.mark.parametrize(
    ("field", "reason"),
    [
        (b"2:0", "field '2:0' is not <episode>:<delta> of one of its 2 episodes"),
        (b"0", "field '0' is not <episode>:<delta>"),  # an older build's whole state
    ],
)
def test_a_group_with_a_field_of_no_episode_of_it_is_refused_with_the_reason(field, reason):
    fields = _group_fields(1)
    fields[field] = fields[b"0:0"]
    with pytest.raises(BadEntry, match=re.escape(reason)):
        read_group(fields)


def _scripted_runner(rclient, names: Names, turns: int, group_size: int, script):
    from tests.episode_builders import ScriptedEngine, smollm2_tokenizer

    cfg = env_config("tests.episode_builders:DurableEnv", max_turns=turns, max_tokens=4096)
    cfg.task.env_args = {"turns": turns}
    cfg.task.group_size = group_size
    cfg.task.episode.max_tool_calls = turns
    runner = EpisodeRunner(cfg, ScriptedEngine(script), smollm2_tokenizer(), DurableEnv, seed=0)
    runner.journal = Journal(rclient, names, "actor-0", 30.0)
    return runner


def test_an_episode_writes_what_each_turn_added_not_its_whole_state_again(rclient):
    """20 equal turns of one episode through the journal (scripted engine, DurableEnv):
    turn t's write is the size of turn 1's, whatever t (the episode writes O(T) bytes,
    not the O(T^2) of rewriting its whole state each turn); each lands as field 0:t, and
    the deltas assemble to the episode exactly."""
    names, turns = Names("test", "linear"), 20
    runner = _scripted_runner(rclient, names, turns, 1, [[72, 73, 74, 75]])
    sizes: list[int] = []
    write = runner.journal.write

    def measured(group_id, *args):  # the payload each turn writes, as sent
        sizes.append(len(encode(args[-1])))
        return write(group_id, *args)

    runner.journal.write = measured
    grp = runner.open_group(runner.tasks.sample(), 1, "actor-0:long")
    key = names.episode("actor-0:long")
    assert runner.drive([grp]) == [grp]
    runner.close()
    (ep,) = grp.episodes
    assert len(ep.offsets) == turns and len(sizes) == turns
    # equal turns (4 sampled ids, the same observation) write equal deltas: a few bytes
    # apart at most (msgpack's integers grow from 1 to 3 bytes past 127)
    assert max(sizes[:-1]) - min(sizes[:-1]) <= 8, sizes
    assert sizes[turns - 2] <= sizes[1] + 8 and sum(sizes) <= turns * (sizes[0] + 8), sizes
    landed = [rclient.hstrlen(key, f"0:{t}") for t in range(turns)]
    assert landed == sizes
    st = read_group(rclient.hgetall(key)).states[0]
    assert st.deltas == turns and unpack_i32(st.ids).tolist() == ep.ids
    assert np.frombuffer(st.mask, np.uint8).tolist() == ep.mask
    assert unpack_f32(st.logprobs).tolist() == ep.logprobs
    assert rle_decode(st.versions).tolist() == ep.versions
    assert unpack_i32(st.offsets).tolist() == ep.offsets and st.done


def test_a_missing_middle_turn_is_refused_with_the_reason_and_its_episode_restarts(
    rclient, tmp_path, caplog
):
    """Turns 0-2 of a group of 3 episodes written, the actor stopped; episode 0's delta
    1 deleted (a gap), episode 1's delta 2 made not to fit. The actor restarted refuses
    both with the reason (logged), restarts them from reset (their deltas deleted,
    counted in ``episodes_restarted``), resumes episode 2 from its deltas and publishes
    the group whole: nothing lost, by the account."""
    from actor.episodes import opened_as, publish_open_group

    names, metrics = Names("test", "gap"), str(tmp_path / "metrics.jsonl")
    pool = actor_pool(env_config(), rclient, names, metrics)
    first = _scripted_runner(rclient, names, 5, 3, [[72, 73, 74]])
    grp = first.open_group(first.tasks.sample(), 3, "actor-0:gap")
    opened_as(pool, grp)

    def in_turn_3() -> bool:
        return all(len(ep.offsets) >= 3 for ep in grp.episodes)

    assert first.drive([grp], should_stop=in_turn_3) is None
    first.close()
    key = names.episode("actor-0:gap")
    written = read_group(rclient.hgetall(key)).states
    assert [st.deltas for st in written.values()] == [3, 3, 3]
    rclient.hdel(key, "0:1")  # a missing middle turn
    bad = decode(rclient.hget(key, "1:2"), EpisodeDelta)
    rclient.hset(key, "1:2", encode(msgspec.structs.replace(bad, logprobs=bad.logprobs[:-4])))
    again = _scripted_runner(rclient, names, 5, 3, [[72, 73, 74]])
    with caplog.at_level("ERROR", logger="actor"):
        taken = again.take_over()
    assert taken is not None and taken.group_id == "actor-0:gap"
    assert (
        "episode group actor-0:gap: episode 0 cannot be resumed: episode 0 has deltas [0, 2]: "
        "delta 1 is missing (a gap in its turns); it restarts from reset"
    ) in caplog.text
    assert (
        "episode 1 cannot be resumed: episode 1's delta 2: it has 2 log-probs and 3 versions "
        "for 3 sampled ids" in caplog.text
    )
    assert [(ep.restarted, ep.resumed) for ep in taken.episodes] == [
        (True, False),
        (True, False),
        (False, True),
    ]
    assert sorted(rclient.hgetall(key)) == [b"2:0", b"2:1", b"2:2", b"open"]  # refused: gone
    opened_as(pool, taken)
    assert again.drive([taken]) == [taken]
    publish_open_group(pool, again, taken, Window(10))
    again.close()
    (group,) = _published(rclient, names)
    group.check()
    assert group.group_id == "actor-0:gap" and [s.turns() for s in group.samples] == [5, 5, 5]
    _prefix_kept(written[2], group.samples[2])
    status = pool.status.key
    assert int(rclient.hget(status, "episodes_restarted")) == 2
    assert int(rclient.hget(status, "episodes_resumed")) == 1
    terms = account(read_jsonl(metrics), in_flight(rclient, names), [], 3)
    assert terms["episode_groups_lost"] == 0 and terms["episode_groups_published"] == 1, terms
    assert terms["episode_groups_taken_over"] == 1 and terms["episodes_restarted"] == 2
    assert rclient.hgetall(names.episode_claims) == {} and not rclient.exists(key)


def test_the_streaming_loop_writes_turns_and_takes_over_a_stopped_actors_groups(rclient, tmp_path):
    """actor/episode_stream.py (the vllm loop's code, on the scripted streaming engine):
    stopped while groups are open (their first turns written, tools slow), its groups
    stay in the journal; the actor restarted (a new incarnation, its engine now at
    version 5) takes them over and publishes them: the turns written keep version 0,
    only the turns after take the new version."""
    from actor.episode_stream import stream_episodes
    from tests.episode_builders import StreamingScriptedEngine, smollm2_tokenizer

    tok = smollm2_tokenizer()
    names = Names("test", "stream-journal")
    rclient.set(names.trainer_version, 5)

    def actor(version: int, tool_s: float, slow_from: int = 0):
        engine = StreamingScriptedEngine([[72, 73], [74], [75]], stop_ids=[tok.eos_token_id])
        engine.version = version
        cfg = env_config("tests.episode_builders:DurableEnv", max_turns=3)
        cfg.task.env_args = {"turns": 3, "tool_s": tool_s, "slow_from": slow_from}
        cfg.actor.max_queue_groups, cfg.actor.max_lag, cfg.actor.vllm.in_flight = 100, 10, 2
        pool = actor_pool(cfg, rclient, names, str(tmp_path / "metrics.jsonl"))
        runner = EpisodeRunner(cfg, engine, tok, DurableEnv, seed=0)
        runner.journal = Journal(rclient, names, "actor-0", 30.0)
        loop = threading.Thread(
            target=stream_episodes,
            args=(pool, engine, runner, tok, Window(10), None, _Receiver()),
        )
        loop.start()
        return pool, runner, loop

    # turn 0's tool answers at once (written), turn 1's never in time
    pool, runner, loop = actor(0, tool_s=30.0, slow_from=1)
    wait_until(
        lambda: (
            len(_journal(rclient, names)) == 2
            and all(len(s) == 2 for s in _journal(rclient, names).values())
        ),
        timeout=20,
    )
    pool.stop.set()
    loop.join(timeout=30)
    runner.close()
    written = _journal(rclient, names)
    assert rclient.xlen(names.rollouts) == 0
    pool, runner, loop = actor(5, tool_s=0.0)  # restarted: takes both groups back at once
    wait_until(lambda: set(written) <= {g.group_id for g in _published(rclient, names)}, 20)
    pool.stop.set()
    loop.join(timeout=30)
    runner.close()
    for g in _published(rclient, names):
        if g.group_id not in written:
            continue
        g.check()
        for k, s in enumerate(g.samples):
            _prefix_kept(written[g.group_id][k], s)
            assert s.turns() == 3 and s.token_versions().tolist() == [0, 0, 5, 5]
    assert int(rclient.hget(pool.status.key, "episodes_resumed")) == 4


class _Receiver:
    applied = failed = 0


def test_an_environment_whose_restore_raises_ends_the_taken_over_episodes_as_infra(tiny, rclient):
    first = _runner(tiny, DurableEnv, rclient, "actor-0")
    gid = _stopped_after_one_turn(first)
    first.close()
    again = _runner(tiny, DurableEnv, rclient, "actor-0", raise_in_restore=True)
    grp = again.take_over()
    assert grp is not None and grp.group_id == gid
    assert again.drive([grp]) == [grp]
    again.close()
    assert again.env_errors["restore"] == 2
    for k, ep in enumerate(grp.episodes):  # ended on the turn written, marked infra
        sample = ep.to_sample(k)
        sample.check("episode")
        assert sample.infra_failure and sample.turns() == 1


def test_the_journal_runs_as_the_shipped_acls_actor_user(tmp_path):
    """deploy/redis/users.acl's actor user may run every journal script (open, write,
    renew, take over, forget, done); its operator reads the open groups for the account."""
    from pipeline.streams import connect
    from pipeline.tasks import Problem
    from tests.redis_builders import acl_server

    urls = acl_server(tmp_path)
    try:
        names = NAMES
        actor = connect(urls["actor"])
        first = Journal(actor, names, "actor-0", 0.3)
        first.open("actor-0:g", Problem(id="p", question="q", answer="1"), [1, 2], 2)
        assert first.write("actor-0:g", _turn_delta(0, 0)) and first.write(
            "actor-0:g", _turn_delta(1, 0)
        )
        time.sleep(0.3)  # a renewal round
        assert in_flight(connect(urls["operator"]), names)["episode_groups"] == ["actor-0:g"]
        first.close()
        time.sleep(0.4)  # its lease runs out
        # a group another build left, refused at take-over: dead-lettered as the actor
        actor.hset(names.episode_claims, "actor-9:old", "actor-9/dead 0")
        actor.hset(names.episode("actor-9:old"), "open", b"\x93garbage")
        other = Journal(actor, names, "actor-1", 30.0)
        taken = other.take_over()
        assert taken is not None and taken.opened.group_id == "actor-0:g"
        assert other.take_over() is None  # the refused group: dead-lettered, not taken
        ((_, dead),) = connect(urls["operator"]).xrange(names.dead)
        assert dead[b"group"] == b"actor-9:old" and dead[b"journal:open"] == b"\x93garbage"
        assert not actor.exists(names.episode("actor-9:old"))
        assert taken.states[0].turns == 1 and taken.fields == {0: ["0:0"], 1: ["1:0"]}
        assert other.forget("actor-0:g", taken.fields[1])  # episode 1 restarts
        assert sorted(actor.hgetall(names.episode("actor-0:g"))) == [b"0:0", b"open"]
        other.done("actor-0:g")
        other.close()
        assert actor.hgetall(names.episode_claims) == {}
    finally:
        urls["proc"].terminate()
        urls["proc"].wait()


def test_an_environment_that_says_resumable_without_state_and_restore_is_refused():
    from pipeline.envs import load_env

    with pytest.raises(ValueError) as info:
        load_env("tests.episode_builders:HalfResumableEnv")
    msg = str(info.value)
    assert "resumable = True" in msg and "state, restore" in msg
    assert load_env("calc").resumable and not load_env("pyexec").resumable
