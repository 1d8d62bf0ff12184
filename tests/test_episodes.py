"""Episodes on the wire and through the consumers: a Sample whose completion holds
several turns with observation ids between them. Its loss mask is 1 exactly on the
sampled ids, the per-token arrays cover those only, every layout rule is checked, a
broken episode is dead-lettered with the reason (real redis-server) and the
preprocessor's and trainer's forward passes read the observation ids but score and
train only the sampled ones (tiny random model)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipeline.config import Config
from pipeline.logprobs import completion_logprobs
from pipeline.messages import (
    SCHEMA_VERSION,
    BadEntry,
    RolloutGroup,
    TrainBatch,
    decode,
    encode,
    pack_f32,
    pack_i32,
    pack_u8,
    rle_encode,
    unpack_f32,
)
from pipeline.models import load_model
from pipeline.streams import Consumer, Names, publish
from preprocessor.main import process, usable
from preprocessor.scoring import group_logprobs
from preprocessor.shaping import set_advantages
from tests.message_builders import episode, episode_group, group
from tests.trainer_builders import run_step
from trainer.collate import collate

NAMES = Names("nsrl-ep", "run")
# turn 0 samples 3 ids, then 4 boundary/observation ids; turn 1 samples 2 ids
TURNS = [([11, 12, 13], [40, 41, 42, 43]), ([14, 15], [])]
VERSIONS = [3, 3, 4, 5, 5]  # a swap inside turn 0, another between the turns


def test_an_episode_round_trips_with_arrays_on_its_sampled_ids_only():
    ep = episode(0, TURNS, VERSIONS)
    g = episode_group("e", [ep])
    g.check()
    back = decode(encode(g), RolloutGroup).samples[0]
    assert back.tokens().tolist() == [11, 12, 13, 40, 41, 42, 43, 14, 15]
    assert back.sampled().astype(int).tolist() == [1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert back.n_sampled() == 5 and back.turns() == 2
    assert back.turn_starts().tolist() == [0, 7]
    assert back.token_versions().tolist() == VERSIONS
    assert len(unpack_f32(back.logprobs)) == 5
    assert back.tool_outcomes == ["ok", ""]


def test_a_single_turn_sample_is_the_one_turn_episode_and_writes_no_episode_field():
    single = group("s", 1.0).samples[0]
    payload = encode(single)
    for name in (b"loss_mask", b"turn_offsets", b"tool_outcomes", b"infra_failure", b"routes"):
        assert name not in payload  # nor Keep Routing's (schema 3) when not recorded
    assert single.turns() == 1 and single.n_sampled() == 3
    assert single.sampled().all() and single.turn_starts().tolist() == [0]
    assert SCHEMA_VERSION >= 2


def _spoil(field, value):
    def apply(s):
        setattr(s, field, value)

    return apply


@pytest.mark.parametrize(
    "spoil, reason",
    [
        (  # the mask marks an observation id sampled: its runs no longer start at the turns
            _spoil("loss_mask", pack_u8([1, 1, 1, 1, 0, 0, 0, 1, 1])),
            r"has 6 sampled tokens but 5 logprobs",
        ),
        (
            _spoil("loss_mask", pack_u8([1, 1, 1, 0, 0, 1, 0, 1, 1])),
            r"turn_offsets \[0, 7\] but its loss_mask's sampled runs start at \[0, 5, 7\]",
        ),
        (
            _spoil("loss_mask", pack_u8([1] * 3 + [0] * 4 + [1])),
            "9 completion ids but a loss_mask of 8",
        ),
        (_spoil("loss_mask", pack_u8([1, 1, 1, 0, 0, 0, 0, 1, 2])), "loss_mask value other than 0"),
        (  # a version on an observation token: one version more than sampled ids
            _spoil("versions", rle_encode(VERSIONS + [5])),
            "has 5 sampled tokens but 6 versions: .* none on observation tokens",
        ),
        (_spoil("logprobs", pack_f32([-0.5] * 9)), "5 sampled tokens but 9 logprobs"),
        (_spoil("turn_offsets", pack_i32([0, 12])), r"turn offset outside its 9 completion ids"),
        (
            _spoil("turn_offsets", pack_i32([0, 8])),
            r"turn_offsets \[0, 8\] but .* start at \[0, 7\]",
        ),
        (_spoil("turn_offsets", b""), "has loss_mask but no turn_offsets"),
        (_spoil("loss_mask", b""), "has turn_offsets but no loss_mask"),
        (_spoil("tool_outcomes", ["ok"]), "2 turns but 1 tool_outcomes"),
        (_spoil("tool_outcomes", ["ok", "exploded"]), "turn 1 has tool outcome 'exploded'"),
        (_spoil("ref_logprobs", pack_f32([-1.0] * 9)), "5 sampled tokens but 9 ref_logprobs"),
        (_spoil("mask_counts", pack_i32([1] * 9)), "sampling mask has 9 counts"),
    ],
)
def test_an_episode_that_breaks_its_layout_fails_its_check(spoil, reason):
    ep = episode(0, TURNS, VERSIONS)
    ep.mask_ids, ep.mask_counts = pack_i32(range(5)), pack_i32([1] * 5)
    episode_group("e", [ep]).check()  # whole, it passes
    spoil(ep)
    with pytest.raises(BadEntry, match=reason):
        episode_group("e", [ep]).check()


def test_an_episode_must_open_and_close_on_a_sampled_id():
    tail = episode(0, [([11, 12], [40, 41])], [0, 0])  # ends on its observation
    with pytest.raises(BadEntry, match="ends on an observation token"):
        tail.check("sample e/0")
    head = episode(0, TURNS, VERSIONS)
    head.completion_ids = pack_i32([40] + head.tokens().tolist())
    head.loss_mask = pack_u8([0] + head.sampled().astype(int).tolist())
    head.turn_offsets = pack_i32([1, 8])
    with pytest.raises(BadEntry, match="starts with an unsampled token"):
        head.check("sample e/0")


def test_a_broken_episode_is_dead_lettered_with_the_reason_and_the_pool_goes_on(rclient):
    cfg = OmegaConf.structured(Config)
    pool = SimpleNamespace(cfg=cfg, client=rclient, names=NAMES, record=lambda **_: None)
    broken = episode_group(
        "broken", [episode(0, TURNS, VERSIONS + [5]), episode(1, TURNS, VERSIONS, reward=0.0)]
    )
    good = episode_group(
        "good", [episode(0, TURNS, VERSIONS), episode(1, TURNS, VERSIONS, reward=0.0)]
    )
    for g in (broken, good):
        publish(rclient, NAMES.rollouts, encode(g), group=g.group_id)
    c = Consumer(rclient, NAMES, NAMES.rollouts, "preprocessor", "preprocessor-0", RolloutGroup)
    entries = usable(pool, c, c.read(10))
    assert [g.group_id for _, g in entries] == ["good"]
    (dead,) = rclient.xrange(NAMES.dead)
    assert b"broken/0 has 5 sampled tokens but 6 versions" in dead[1][b"reason"]
    counts = process(pool, [], entries)
    assert counts["kept"] == 1
    (entry,) = rclient.xrange(NAMES.batches)
    batch = decode(entry[1][b"data"], TrainBatch)
    batch.check(vocab_size=100)
    assert [s.n_sampled() for s in batch.samples] == [5, 5]


def test_infra_failed_episodes_are_left_out_of_the_advantage_statistics():
    samples = [episode(k, TURNS, VERSIONS, reward=r) for k, r in enumerate([1.0, 0.0, 0.0, 0.0])]
    samples[2].infra_failure = True  # its sandbox died: not a wrong answer
    assert set_advantages(samples, {}, {})
    adv = [s.advantage for s in samples]
    assert adv[2] == 0.0
    # the statistics of the three others alone: rewards [1, 0, 0]
    assert adv[0] == pytest.approx(2 / np.sqrt(2), rel=1e-4)
    assert adv[1] == adv[3] == pytest.approx(-1 / np.sqrt(2), rel=1e-4)
    alone = [episode(0, TURNS, VERSIONS, reward=1.0), episode(1, TURNS, VERSIONS, reward=0.0)]
    alone[1].infra_failure = True
    assert not set_advantages(alone, {}, {})  # one counted episode: no signal


def test_collate_trains_only_the_sampled_ids_of_an_episode(tiny):
    ep = episode(0, TURNS, VERSIONS)
    ep.logprobs = pack_f32([-1.0, -2.0, -3.0, -4.0, -5.0])
    single = group("s", 1.0).samples[0]
    batch = TrainBatch(
        schema=SCHEMA_VERSION,
        batch_id="b",
        group_ids=["e", "s"],
        prompt_ids=[pack_i32([1, 2]), pack_i32([1, 2, 3])],
        samples=[ep, single],
        temperature=1.0,
    )
    batch.check(vocab_size=100)
    mb = collate(batch, 0, torch.device("cpu"))
    assert mb.comp[0].int().tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert mb.comp[1].int().tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    assert mb.actor_lp[0][mb.comp[0]].tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert mb.ids[0].tolist() == [1, 2, 11, 12, 13, 40, 41, 42, 43, 14, 15]
    assert mb.tokens == 8


def test_reference_logprobs_of_an_episode_are_the_whole_sequence_forward_on_its_sampled_ids(
    tiny,
):
    model, _ = load_model(tiny)
    prompt = [1, 2, 3]
    eps = [
        episode(0, TURNS, VERSIONS),
        episode(1, [([21], [44, 45]), ([22, 23], [46]), ([24], [])], [0, 0, 0, 0]),
    ]
    g = episode_group("e", eps, prompt)
    (lps,) = group_logprobs(model, [g], budget=10_000, pad_id=0)
    for ep, got in zip(eps, lps, strict=True):
        full = torch.tensor([prompt + ep.tokens().tolist()])
        comp = torch.zeros_like(full, dtype=torch.bool)
        comp[0, len(prompt) :] = torch.from_numpy(ep.sampled())
        with torch.no_grad():
            want = completion_logprobs(model, full, torch.ones_like(full), comp, 1.0)[comp]
        assert len(got) == ep.n_sampled()
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


def test_inspect_shows_an_actors_episode_counters():
    from pipeline.inspect import pool_info, render

    actor = {"role": "actor", "state": "generating", "heartbeat": "999", "episodes_open": "8"}
    actor |= {"episodes": "12", "turns": "30", "tool_calls": "18", "tool.ok": "15"}
    actor |= {"tool.timeout": "2", "tool.malformed": "1", "infra_failures": "1"}
    actor |= {"episodes_spanning": "3", "multi_turn": "10"}
    pools = {"actor-0": pool_info(actor, 1000.0, 30)}
    snap = {
        "run": "nonstop:x",
        "time": 1000.0,
        "redis": {"version": "7", "used_memory": "1M", "maxmemory_policy": "noeviction"},
        "trainer_version": 1,
        "published_version": 1,
        "samples_in_flight": 0,
        "streams": {},
        "pools": pools,
        "dead_letters": {"count": 0, "reported_by_pools": 0, "recent": []},
    }
    text = render(snap)
    for shown in (
        "episodes in flight 8",
        "episodes 12",
        "turns 30",
        "tool calls 18",
        "tool timeout 2",
        "tool malformed 1",
        "infra failures 1",
        "episodes spanning versions 3",
    ):
        assert shown in text, text


def test_the_trainer_dead_letters_a_broken_episode_and_trains_the_good_ones(make_trainer, rclient):
    trainer = make_trainer(samples_per_step=2)
    stream, names = trainer.pool.names.batches, trainer.pool.names

    def episodes_batch(bid: str, offsets=None) -> TrainBatch:
        eps = [episode(k, TURNS, VERSIONS, reward=float(k)) for k in range(2)]
        for k, ep in enumerate(eps):
            ep.advantage = 1.0 - 2 * k
        if offsets is not None:  # a turn offset past the end of the completion
            eps[0].turn_offsets = pack_i32(offsets)
        return TrainBatch(
            schema=SCHEMA_VERSION,
            batch_id=bid,
            group_ids=[bid, bid],
            prompt_ids=[pack_i32([1, 2])] * 2,
            samples=eps,
            temperature=1.0,
        )

    publish(rclient, stream, encode(episodes_batch("bad", offsets=[0, 30])))
    publish(rclient, stream, encode(episodes_batch("good")))
    m = run_step(trainer)
    assert m["sample_ids"] == ["good/0", "good/1"] and m["dead_lettered"] == 2
    assert m["tokens"] == 10  # 5 sampled tokens each: observation ids are not trained
    (dead,) = rclient.xrange(names.dead)
    assert b"bad/0 has a turn offset outside its 9 completion ids" in dead[1][b"reason"]
