"""The trainer pool over a real redis-server on the tiny model: what a step does
to log-probs, stale rejection, replay dedupe, dead-lettering of bad entries,
and the samples_retired count the actors' back-pressure reads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from actor.room import in_flight_groups
from pipeline.config import Config
from pipeline.messages import (
    TrainBatch,
    decode,
    encode,
    pack_f32,
)
from pipeline.run.accounting import account, in_flight
from pipeline.streams import REJECTED_HELD, Names, publish
from pipeline.telemetry import read_jsonl
from tests.trainer_builders import batch, run_step, sample
from trainer import checkpoint
from trainer.backends.torch_backend import TorchBackend
from trainer.collate import collate
from trainer.main import Trainer
from trainer.ranks import Ranks
from trainer.step import token_logprobs, train_step


def test_a_step_moves_logprobs_the_way_the_advantages_say(tiny):
    cfg = OmegaConf.structured(Config)
    cfg.trainer.lr = 1e-3
    one = Ranks(0, 1, 0, None)
    backend = TorchBackend(cfg, one, tiny, None)
    rng = np.random.default_rng(0)
    b = batch("g", [sample(0, 8, 0, 1.0, rng), sample(1, 8, 0, -1.0, rng)], rng)
    mb = collate(b, 0, torch.device("cpu"))
    with torch.no_grad():
        before = token_logprobs(backend.model, mb, None)
    # on-policy: the actor's log-probs are the model's own, so the ratio starts at 1
    b.samples[0].logprobs = pack_f32(before[0][mb.comp[0]].numpy())
    b.samples[1].logprobs = pack_f32(before[1][mb.comp[1]].numpy())
    metrics = train_step(backend, one, [b], 1, b, cfg.trainer, 0, mb.tokens)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    with torch.no_grad():
        after = token_logprobs(backend.model, mb, None)
    up = (after - before)[0][mb.comp[0]]
    down = (after - before)[1][mb.comp[1]]
    assert up.mean() > 0 and down.mean() < 0, (up, down)
    assert (up > 0).float().mean() >= 0.75 and (down < 0).float().mean() >= 0.75


def retired(trainer: Trainer) -> int:
    return int(trainer.pool.client.get(trainer.pool.names.key("samples_retired")))


def test_stale_samples_are_rejected_and_counted(make_trainer, rclient):
    trainer = make_trainer(samples_per_step=2, max_lag=1)
    trainer.state["version"] = 3
    rng = np.random.default_rng(1)
    stream = trainer.pool.names.batches
    old = batch("old", [sample(0, 6, 1, 1.0, rng), sample(1, 6, 1, -1.0, rng)], rng)
    fresh = batch("new", [sample(0, 6, 3, 1.0, rng), sample(1, 6, 2, -1.0, rng)], rng)
    publish(rclient, stream, encode(old))
    publish(rclient, stream, encode(fresh))
    m = run_step(trainer)
    assert m["stale"] == 2 and sorted(m["stale_ids"]) == ["old/0", "old/1"]
    # both 6 tokens long: the first of four ranges up to sampling.max_new_tokens (32)
    assert m["stale_by_length"] == {"1-8": 2, "9-16": 0, "17-24": 0, "25+": 0}
    assert m["sample_ids"] == ["new/0", "new/1"] and m["samples"] == 2
    assert trainer.state["stale_samples_dropped"] == 2
    assert retired(trainer) == 4  # two trained, two rejected
    status = trainer.pool.status
    assert rclient.hget(status.key, "stale_samples_dropped") == b"2"
    metrics_file = f"{trainer.pool.cfg.run_dir}/metrics.jsonl"
    steps = [r for r in read_jsonl(metrics_file) if r.get("event") == "step"]
    assert steps[-1]["stale_ids"] == m["stale_ids"]


def test_a_replayed_batch_is_not_trained_twice(make_trainer, rclient):
    trainer = make_trainer(samples_per_step=2)
    rng = np.random.default_rng(2)
    stream = trainer.pool.names.batches
    first = batch("a", [sample(0, 5, 0, 1.0, rng), sample(1, 5, 0, -1.0, rng)], rng)
    publish(rclient, stream, encode(first))
    assert run_step(trainer)["sample_ids"] == ["a/0", "a/1"]
    second = batch("b", [sample(0, 5, 1, 1.0, rng), sample(1, 5, 1, -1.0, rng)], rng)
    publish(rclient, stream, encode(first))  # delivered again, e.g. after a restart
    publish(rclient, stream, encode(second))
    m = run_step(trainer)
    assert m["sample_ids"] == ["b/0", "b/1"] and m["duplicates"] == 2
    assert trainer.state["samples_trained"] == 4
    assert trainer.state["duplicates_dropped"] == 2
    assert retired(trainer) == 4  # duplicates are not retired twice (back-pressure)


def test_an_inconsistent_entry_is_dead_lettered_and_training_goes_on(make_trainer, rclient):
    trainer = make_trainer(samples_per_step=2)
    rng = np.random.default_rng(3)
    stream, names = trainer.pool.names.batches, trainer.pool.names
    bad = batch("bad", [sample(0, 5, 0, 1.0, rng, lp=[-1.0, -1.0]), sample(1, 5, 0, 0, rng)], rng)
    good = batch("good", [sample(0, 5, 0, 1.0, rng), sample(1, 5, 0, -1.0, rng)], rng)
    publish(rclient, stream, encode(bad))
    publish(rclient, stream, encode(good))
    m = run_step(trainer)
    assert m["sample_ids"] == ["good/0", "good/1"] and m["dead_lettered"] == 2
    dead = rclient.xrange(names.dead)
    assert len(dead) == 1
    fields = dead[0][1]
    assert b"5 tokens but 2 logprobs" in fields[b"reason"]
    assert decode(fields[b"data"], TrainBatch).group_ids == ["bad", "bad"]
    assert fields[b"source"] == stream.encode()
    assert retired(trainer) == 4
    pending = rclient.xpending(stream, "trainer")["pending"]
    assert pending == 0  # both entries acknowledged


def test_a_batch_with_routes_for_a_dense_model_is_dead_lettered(make_trainer, rclient):
    trainer = make_trainer(samples_per_step=2)
    assert trainer.route_layout == []  # the tiny model is dense
    rng = np.random.default_rng(4)
    routed = batch("routed", [sample(0, 5, 0, 1.0, rng), sample(1, 5, 0, -1.0, rng)], rng)
    routed.route_layout = [2, 2, 8]
    for s in routed.samples:  # prompt 5 + completion 5 - 1 rows of valid routes
        s.routes = np.tile(np.array([0, 1], np.uint8), 9 * 2).tobytes()
    good = batch("good", [sample(0, 5, 0, 1.0, rng), sample(1, 5, 0, -1.0, rng)], rng)
    publish(rclient, trainer.pool.names.batches, encode(routed))
    publish(rclient, trainer.pool.names.batches, encode(good))
    m = run_step(trainer)
    assert m["sample_ids"] == ["good/0", "good/1"] and m["dead_lettered"] == 2
    (dead,) = rclient.xrange(trainer.pool.names.dead)
    assert b"the trainer's model has no mixture-of-experts router" in dead[1][b"reason"]


def test_resume_restores_the_dedupe_window_and_retired_count(make_trainer, rclient):
    trainer = make_trainer(samples_per_step=2, checkpoint_every=1)
    rng = np.random.default_rng(4)
    stream = trainer.pool.names.batches
    first = batch("a", [sample(0, 5, 0, 1.0, rng), sample(1, 5, 0, -1.0, rng)], rng)
    publish(rclient, stream, encode(first))
    run_step(trainer)
    trainer.publisher.close(timeout_s=1)
    again = make_trainer(samples_per_step=2, checkpoint_every=1)  # a restarted trainer
    assert again.state["version"] == 1 and "a/0" in again.state["recent_samples"]
    assert retired(again) == 2
    second = batch("b", [sample(0, 5, 1, 1.0, rng), sample(1, 5, 1, -1.0, rng)], rng)
    publish(rclient, stream, encode(first))
    publish(rclient, stream, encode(second))
    m = run_step(again)
    assert m["sample_ids"] == ["b/0", "b/1"] and m["duplicates"] == 2
    assert retired(again) == 4


def test_a_trainer_killed_before_its_first_checkpoint_loses_nothing(make_trainer, rclient):
    """Its steps are undone (no checkpoint): the next trainer re-reads the stream from the
    start, including an entry the dead one had read but not acknowledged."""
    dead = make_trainer(samples_per_step=2, checkpoint_every=10)
    rng = np.random.default_rng(5)
    stream = dead.pool.names.batches
    first = batch("a", [sample(0, 5, 0, 1.0, rng), sample(1, 5, 0, -1.0, rng)], rng)
    second = batch("b", [sample(0, 5, 0, 1.0, rng), sample(1, 5, 0, -1.0, rng)], rng)
    publish(rclient, stream, encode(first))
    run_step(dead)
    publish(rclient, stream, encode(second))
    assert len(dead.consumer.read(count=4)) == 1  # read, never acknowledged: it dies now
    dead.publisher.close(timeout_s=1)
    again = make_trainer(samples_per_step=2, checkpoint_every=10)
    assert again.state["version"] == 0 and retired(again) == 0
    assert run_step(again)["sample_ids"] == ["a/0", "a/1"]  # a step takes one entry at a time
    assert run_step(again)["sample_ids"] == ["b/0", "b/1"]  # the dead one's unacked entry
    assert retired(again) == 4
    records = read_jsonl(f"{again.pool.cfg.run_dir}/metrics.jsonl")
    assert {"event": "resume", "version": 0}.items() <= next(
        r for r in records if r.get("event") == "resume"
    ).items()


def test_a_trainer_killed_right_after_a_checkpoint_keeps_the_steps_record(
    make_trainer, rclient, monkeypatch
):
    """A checkpoint covers its step's entries (a restart resumes past them, never re-reading
    them), so the step's record must already be in metrics.jsonl when the trainer dies
    just after the save; else the accounting would count its groups as lost."""
    first = make_trainer(samples_per_step=2, checkpoint_every=1)
    rng = np.random.default_rng(8)
    names = first.pool.names
    publish(
        rclient,
        names.batches,
        encode(batch("a", [sample(0, 5, 0, 1.0, rng), sample(1, 5, 0, -1.0, rng)], rng)),
    )
    real_save = checkpoint.save

    class Killed(BaseException):
        pass

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise Killed  # SIGKILL between the save and anything after it

    monkeypatch.setattr(checkpoint, "save", save_then_die)
    with pytest.raises(Killed):
        run_step(first)
    monkeypatch.setattr(checkpoint, "save", real_save)
    first.publisher.close(timeout_s=1)
    publish(
        rclient,
        names.batches,
        encode(batch("b", [sample(0, 5, 1, 1.0, rng), sample(1, 5, 1, -1.0, rng)], rng)),
    )
    again = make_trainer(samples_per_step=2, checkpoint_every=1)
    assert again.state["version"] == 1  # resumed past "a": it is never read again
    assert run_step(again)["sample_ids"] == ["b/0", "b/1"]
    records = read_jsonl(f"{again.pool.cfg.run_dir}/metrics.jsonl")
    produced = [{"event": "group", "group": g} for g in ("a", "b")]
    terms = account(produced + records, in_flight(rclient, names), [], group_size=2)
    assert terms["groups_trained"] == 2 and terms["groups_lost"] == 0, terms
    # the first save died before its own record; the second one wrote it
    assert [r["step"] for r in records if r.get("event") == "checkpoint"] == [2]


def test_a_restarted_trainer_keeps_the_preprocessors_retirements(make_trainer, rclient):
    """samples_retired is shared: a restart takes back only the trainer's undone steps, never
    the no-signal drops and dead letters the preprocessors added (sync mode and the actors'
    back-pressure read it)."""
    names = Names("test", "trainer")
    rclient.incrby(names.samples_retired, 3)  # a preprocessor dropped a no-signal group
    first = make_trainer(samples_per_step=2, checkpoint_every=1)
    rng = np.random.default_rng(6)
    a = batch("a", [sample(0, 5, 0, 1.0, rng), sample(1, 5, 0, -1.0, rng)], rng)
    b = batch("b", [sample(0, 5, 1, 1.0, rng), sample(1, 5, 1, -1.0, rng)], rng)
    publish(rclient, names.batches, encode(a))
    run_step(first)  # checkpointed
    rclient.incrby(names.samples_retired, 5)  # the preprocessor again, while training
    first.pool.cfg.trainer.checkpoint_every = 100
    publish(rclient, names.batches, encode(b))
    run_step(first)  # not checkpointed: undone by the restart
    assert retired(first) == 3 + 2 + 5 + 2
    first.publisher.close(timeout_s=1)
    again = make_trainer(samples_per_step=2, checkpoint_every=1)
    assert again.state["version"] == 1
    assert retired(again) == 3 + 2 + 5  # only the undone step's 2 are taken back
    assert run_step(again)["sample_ids"] == ["b/0", "b/1"]
    assert retired(again) == 3 + 2 + 5 + 2


def test_a_backlog_does_not_grow_the_step(make_trainer, rclient):
    """With many micro-batches waiting, a step still takes samples_per_step samples (it
    overshoots by less than one micro-batch), so async and sync steps have one size."""
    trainer = make_trainer(samples_per_step=4)
    rng = np.random.default_rng(7)
    for g in "abcdefghijkl":  # 24 samples: room for 3 steps even if steps grew
        b = batch(g, [sample(0, 5, 0, 1.0, rng), sample(1, 5, 0, -1.0, rng)], rng)
        publish(rclient, trainer.pool.names.batches, encode(b))
    sizes = [run_step(trainer)["samples"] for _ in range(3)]
    assert sizes == [4, 4, 4]


def test_rejected_samples_held_by_a_waiting_step_are_not_in_flight(make_trainer, rclient):
    """A step short of fresh samples holds the stale ones it rejected until it retires
    them with the step. The actors' back-pressure must not count them: with them in
    flight, a full backlog of stale samples held actor and trainer waiting for each
    other for good (a math run on vLLM here: 23 stale samples held, backlog 9 of 8)."""
    trainer = make_trainer(samples_per_step=2, max_lag=1)
    trainer.state["version"] = 3
    names, rng = trainer.pool.names, np.random.default_rng(8)
    g = trainer.pool.cfg.task.group_size
    rclient.set(names.samples_produced, 3 * g)  # what the actors counted: 3 groups
    for name in ("old", "older"):  # 2 x 2 samples of version 1: stale at version 3
        old = batch(name, [sample(0, 6, 1, 1.0, rng), sample(1, 6, 1, -1.0, rng)], rng)
        publish(rclient, names.batches, encode(old))
    seen: dict[str, float] = {}

    def actor_side() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if rclient.hget(names.status("trainer"), REJECTED_HELD) == b"4":
                seen["in_flight"] = in_flight_groups(trainer.pool)
                break
            time.sleep(0.02)
        fresh = batch("new", [sample(0, 6, 3, 1.0, rng), sample(1, 6, 3, -1.0, rng)], rng)
        publish(rclient, names.batches, encode(fresh))

    helper = threading.Thread(target=actor_side)
    helper.start()
    m = run_step(trainer)  # waits for the fresh batch the helper sends
    helper.join()
    assert m["stale"] == 4 and m["samples"] == 2
    # while the step waited: the 4 rejected samples were not in flight, the rest were
    assert seen["in_flight"] == pytest.approx((3 * g - 4) / g)
    # retired with the step, and no longer subtracted: counted once either way
    assert rclient.hget(names.status("trainer"), REJECTED_HELD) == b"0"
    assert retired(trainer) == 6
    assert in_flight_groups(trainer.pool) == pytest.approx((3 * g - 6) / g)
