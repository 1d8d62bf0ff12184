"""The actor's streaming loop (actor/stream.py) with the vllm engine on the fake AsyncLLM
(tests/vllm_fake.py: the real worker extension runs in its engine-core thread) and a
real redis-server: requests stay in flight across group boundaries, every group is
published whole with exact per-token versions, back-pressure holds new groups back and
lets them go, and a stop publishes no half group. The batch loop is the control."""

from __future__ import annotations

import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

import actor.main as actor_main
from actor import batch, stream
from actor.engines.vllm.client import VLLMEngine
from actor.weight_receiver import WeightReceiver
from pipeline.config import Config
from pipeline.messages import RolloutGroup, decode, rle_decode
from pipeline.models import materialize_model
from pipeline.runtime import Pool
from pipeline.streams import Names, wait_until
from pipeline.tasks import RewardErrors, make_task, score
from pipeline.telemetry import MetricsFile, PoolStatus, Window, read_jsonl
from tests import vllm_fake
from tests.vllm_builders import hf_model, hf_state, new_version, settings, vllm_layout

G, IN_FLIGHT, TOKENS = 4, 8, 8


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(
        materialize_model("tiny", str(tmp_path_factory.mktemp("m")))
    )


@pytest.fixture
def setup(rclient, tmp_path, tokenizer):
    cfg = OmegaConf.structured(Config)
    cfg.task.group_size, cfg.sampling.max_new_tokens = G, TOKENS
    cfg.actor.vllm.in_flight, cfg.actor.max_queue_groups = IN_FLIGHT, 1000
    cfg.sampling.prompts_per_batch = 3
    names = Names("test", f"stream-{time.time_ns()}")
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
    vllm_fake.AsyncLLM.model_tensors = vllm_layout(hf_state(hf_model(0)))
    vllm_fake.AsyncLLM.step_s = 0.01  # a group lasts ~80 ms: the actor keeps up
    engine = VLLMEngine(
        "unused-folder",
        tokenizer,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        # no prefix cache: a request reusing blocks of an older version stamps its first
        # token with that version (tests/test_vllm_engine.py), which the exact check
        # against the core's per-step record below would not expect
        settings=settings(in_flight=IN_FLIGHT, enable_prefix_caching=False),
        api=vllm_fake.API,
    )
    task = make_task("arithmetic", cfg.task.difficulty, None, 7)
    score("12", "12")  # the answer checker's first call imports it (~0.1 s): not in the timing
    yield SimpleNamespace(pool=pool, engine=engine, task=task, tok=tokenizer, tmp=tmp_path)
    engine.close()


def run_stream(s, until, timeout=30.0):
    """stream_groups in a thread until ``until()``; returns the groups it published."""
    out = {}
    receiver = SimpleNamespace(applied=0, failed=0)

    def go():
        out["n"] = stream.stream_groups(
            s.pool, s.engine, s.task, s.tok, Window(50), RewardErrors(), receiver
        )

    t = threading.Thread(target=go)
    t.start()
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        time.sleep(0.01)
    s.pool.stop.set()
    t.join(10)
    assert not t.is_alive()
    return out["n"]


def groups(s) -> list[RolloutGroup]:
    entries = s.pool.client.xrange(s.pool.names.rollouts)
    return [decode(f[b"data"], RolloutGroup) for _, f in entries]


def core():
    return vllm_fake.AsyncLLM.last.core


def test_requests_stay_in_flight_while_groups_are_published(setup, monkeypatch):
    s = setup
    swapped, at_stop, warm = threading.Event(), {}, {}
    stop_at = [18]

    def until():
        n = s.pool.client.xlen(s.pool.names.rollouts)
        if n >= 6 and not warm:  # the actor's first publishes are slow (first decode,
            # score, XADD): the engine may run dry once before the first refill
            warm.update(gaps=core().empty_gaps, steps=len(core().active_log), groups=n)
        if n >= 8 and not swapped.is_set():
            swapped.set()
            new_version(s.engine, 1, seed=1)  # while requests are in flight
            # staging takes seconds under load while the actor goes on publishing: stop
            # only once groups begun after the swap had time to come out (IN_FLIGHT / G
            # groups were in flight at the swap; one CI run hit n >= 18 before any did)
            stop_at[0] = max(18, s.pool.client.xlen(s.pool.names.rollouts) + 2 * IN_FLIGHT // G + 2)
        if n >= stop_at[0]:
            at_stop.update(gaps=core().empty_gaps, steps=list(core().active_log), groups=n)
            return True
        return False

    published = run_stream(s, until)
    got = groups(s)
    assert published == len(got) >= 18
    # once the actor was warm, the engine did not run dry at group boundaries, though the
    # actor scored and published 12 or more groups meanwhile (the batch loop runs dry at
    # every batch: the control below). A refill that waited for a publish shows as a dry
    # spell per group; a scheduling stall of the actor's thread on a loaded 2-core machine
    # (a ~30 ms deschedule; a clean-clone CI run beside other tests saw 4 in 169 groups)
    # shows as a rare one: one per 20 groups is allowed, at least one. The steps ran with
    # every slot busy (a finished request's replacement joins at the next step, as in vLLM)
    after = at_stop["groups"] - warm["groups"]
    dry = at_stop["gaps"] - warm["gaps"]
    assert after >= 10 and dry <= max(1, after // 20), (warm, at_stop["gaps"], after)
    steps = at_stop["steps"][warm["steps"] :]
    assert sum(running == IN_FLIGHT for running, _ in steps) >= 0.8 * len(steps), steps
    truth = core().truth
    versions_seen = set()
    for group in got:
        assert len(group.samples) == G  # whole groups only
        for sample in group.samples:
            versions = rle_decode(sample.versions)
            assert len(versions) == len(sample.tokens()) <= TOKENS  # EOS may end it sooner
            assert sample.finished or len(versions) == TOKENS
            versions_seen.update(versions)
    # per-token versions are exactly the steps' versions (checked against the core's record)
    stamped = Counter(tuple(rle_decode(x.versions)) for g in got for x in g.samples)
    extra = stamped - Counter(tuple(v) for v in truth.values())
    assert not extra, extra
    assert versions_seen == {0, 1}
    # stopping aborted the open groups: nothing left in the engine, nothing half published
    assert s.engine.open_units == 0
    time.sleep(0.1)
    assert not core().running and not core().waiting


def test_the_batch_loop_leaves_the_engine_empty_while_it_publishes(setup):
    """The control: generate_step waits for the whole batch, so the engine is empty
    while the actor scores and publishes (what streaming removes)."""
    s = setup
    for _ in range(2):
        batch.generate_step(s.pool, s.engine, s.task, s.tok, Window(50), RewardErrors())
    assert s.pool.client.xlen(s.pool.names.rollouts) == 6
    assert core().empty_spins > 0  # the engine sat empty between the two batches
    assert core().empty_gaps >= 1


def test_back_pressure_holds_groups_back_and_lets_them_go(setup, monkeypatch):
    s = setup
    s.pool.cfg.actor.max_queue_groups = 3
    monkeypatch.setattr(stream, "REPORT_S", 0.2)
    client, names = s.pool.client, s.pool.names
    state = {}

    def until():
        n = client.xlen(names.rollouts)
        if "held" not in state and n >= 3:
            time.sleep(0.5)  # nobody consumes: the actor must stop submitting
            state["held"] = client.xlen(names.rollouts)
            state["status"] = client.hgetall(names.status("actor-0"))
            state["empty_in_flight"] = s.engine.in_flight_now
            client.incrby(names.samples_retired, state["held"] * G)  # the trainer caught up
        return "held" in state and client.xlen(names.rollouts) >= state["held"] + 3

    run_stream(s, until)
    # at most the open groups finish once the backlog is full (3 - 1 + open_target)
    assert 3 <= state["held"] <= 3 - 1 + stream.open_target(s.pool.cfg)
    assert state["empty_in_flight"] == 0
    assert state["status"][b"state"] == b"waiting"
    assert client.xlen(names.rollouts) >= state["held"] + 3  # resumed after retirement
    turns = [r for r in read_jsonl(str(s.tmp / "metrics.jsonl")) if r.get("event") == "turn"]
    assert turns and all(r["mode"] == "async" for r in turns)
    assert any(r["wait_s"] > 0.1 for r in turns)  # the engine sat empty while held back


def test_an_actor_held_back_exits_when_its_engine_core_dies(setup):
    """Held back (a full backlog, nothing running), the actor's loop ticks on; if vLLM's
    engine core dies then, nothing fails a request, so the hold itself must notice:
    stream_groups raises naming the dead engine (the actor exits and is restarted)
    instead of answering /health 200 with an engine that can never generate."""
    s = setup
    s.pool.cfg.actor.max_queue_groups = 2
    client, names = s.pool.client, s.pool.names
    out = {}

    def go():
        try:
            stream.stream_groups(
                s.pool, s.engine, s.task, s.tok, Window(50), RewardErrors(),
                SimpleNamespace(applied=0, failed=0),
            )  # fmt: skip
        except RuntimeError as e:
            out["error"] = str(e)

    t = threading.Thread(target=go)
    t.start()
    try:
        held = lambda: client.xlen(names.rollouts) >= 2 and s.engine.open_units == 0  # noqa: E731
        assert wait_until(held, 30)
        assert t.is_alive()  # held back, not failing
        vllm_fake.AsyncLLM.last.errored = True  # the engine core exits
        t.join(10)
        assert not t.is_alive() and "engine core died" in out.get("error", ""), out
    finally:
        s.pool.stop.set()
        t.join(10)
        vllm_fake.AsyncLLM.last.errored = False  # the fixture closes the engine


def test_groups_finished_while_the_actor_publishes_count_against_the_backlog(setup, monkeypatch):
    """A deterministic reproduction of groups escaping back-pressure: each publish waits
    until every submitted group has finished in the engine, so groups are always
    finished but not yet published when the actor next looks for room. They are neither
    open in the engine nor in the backlog; counted nowhere, they let the actor submit a
    whole new set of groups past a full backlog (8 published with room for 3 + 4 - 1)."""
    s = setup
    s.pool.cfg.actor.max_queue_groups = 3
    target = stream.open_target(s.pool.cfg)
    publish = stream.publish_group

    def publish_when_all_finished(*args, **kw):
        assert wait_until(lambda: s.engine.open_units == 0, 10)
        publish(*args, **kw)

    monkeypatch.setattr(stream, "publish_group", publish_when_all_finished)
    client, names = s.pool.client, s.pool.names
    held = {}

    def until():  # nobody consumes: once 3 groups are out, every later one must have
        # been submitted before the backlog was full
        if client.xlen(names.rollouts) >= 3 and "t" not in held:
            held["t"] = time.monotonic()
        return "t" in held and time.monotonic() - held["t"] > 1.0

    run_stream(s, until)
    assert 3 <= client.xlen(names.rollouts) <= 3 - 1 + target


def test_a_restarted_actor_keeps_counting_its_weight_updates(setup):
    """The status hash outlives the actor process: a restart resumes the counters, so
    summary.json does not lose the updates applied before it."""
    s = setup
    s.pool.status.set(weight_updates_applied=5, weight_updates_failed=2)
    restarted = PoolStatus(s.pool.client, s.pool.names, "actor-0", "actor")  # a new process
    assert restarted.key == s.pool.status.key
    receiver = WeightReceiver(s.pool.client, s.pool.names, "actor-0", s.engine, 5.0, "secret")
    actor_main.resume_counters(s.pool, receiver)
    assert (receiver.applied, receiver.failed) == (5, 2)


def test_aborting_at_once_after_submitting_leaves_nothing_behind(setup):
    """A stop right after a submit: requests not started yet are cancelled before they
    run, the others are aborted in the engine; nothing hangs or stays in the core."""
    s = setup
    for round_ in range(5):
        for k in range(4):
            s.engine.submit((round_, k), [[1, 2, 3, 4, 5]] * G, TOKENS)
        if round_ % 2:
            time.sleep(0.02)  # some requests running by now
        t0 = time.monotonic()
        assert s.engine.abort_open() == 4
        assert time.monotonic() - t0 < 5
        assert s.engine.open_units == 0 and s.engine.take(timeout=0.05) == []
    deadline = time.monotonic() + 5
    while (core().running or core().waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not core().running and not core().waiting
    assert s.engine.in_flight_now == 0
    outs = s.engine.generate([[1, 2, 3]] * 3, TOKENS)  # the engine still works
    assert [len(o.tokens) <= TOKENS and len(o.versions) == len(o.tokens) for o in outs] == [
        True
    ] * 3
