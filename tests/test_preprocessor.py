"""The preprocessor's packing and its counters: batches never mix sampling settings,
and status totals go on from where a killed process left them (real redis-server)."""

from __future__ import annotations

from types import SimpleNamespace

from omegaconf import OmegaConf

from pipeline.config import Config
from pipeline.messages import RolloutGroup, encode, pack_f32
from pipeline.streams import Consumer, Names, publish, retire_groups
from pipeline.telemetry import PoolStatus, read_statuses
from preprocessor.main import add_totals, process, to_batches, usable
from tests.message_builders import group

NAMES = Names("nsrl-pre", "run")


def test_batches_never_mix_sampling_settings():
    groups = [group("a", 0.7), group("b", 1.0), group("c", 0.7), group("d", 0.7, top_k=5)]
    batches = to_batches(groups, budget=10_000)  # one batch would hold them all
    by_settings = {(b.temperature, b.top_p, b.top_k): sorted(set(b.group_ids)) for b in batches}
    assert by_settings == {(0.7, 1.0, 0): ["a", "c"], (1.0, 1.0, 0): ["b"], (0.7, 1.0, 5): ["d"]}
    assert sum(len(b.samples) for b in batches) == 8  # every sample exactly once


def test_status_totals_survive_a_restart_of_the_process(rclient):
    first = SimpleNamespace(status=PoolStatus(rclient, NAMES, "preprocessor-0", "preprocessor"))
    add_totals(first, {"kept": 3, "dropped": 1, "teacher_kl_sum": 0.5})
    again = SimpleNamespace(status=PoolStatus(rclient, NAMES, "preprocessor-0", "preprocessor"))
    add_totals(again, {"kept": 2, "dropped": 0, "teacher_kl_sum": 0.25})
    st = read_statuses(rclient, NAMES)["preprocessor-0"]
    assert (int(st["kept"]), int(st["dropped"]), float(st["teacher_kl_sum"])) == (5, 1, 0.75)


def test_dropped_and_dead_lettered_groups_are_retired_once_across_a_restart(rclient):
    """Back-pressure counts produced - retired: a preprocessor that retired a read's
    no-signal and inconsistent groups and died before acknowledging the read re-reads
    them, and a restart must not retire them again (the actors' budget would drift)."""
    cfg = OmegaConf.structured(Config)
    pool = SimpleNamespace(cfg=cfg, client=rclient, names=NAMES, record=lambda **_: None)
    flat = group("flat", 1.0)
    for s in flat.samples:
        s.reward = 1.0  # every sample rewarded alike: no signal, dropped
    broken = group("broken", 1.0)
    broken.samples[0].logprobs = pack_f32([-1.0])  # 1 log-prob for 3 tokens: dead-lettered
    for g in (flat, broken, group("kept", 1.0)):
        publish(rclient, NAMES.rollouts, encode(g), group=g.group_id)

    def read_and_process() -> Consumer:
        c = Consumer(rclient, NAMES, NAMES.rollouts, "preprocessor", "preprocessor-0", RolloutGroup)
        entries = usable(pool, c, c.read(10))
        counts = process(pool, [], entries)
        assert [group.group_id for _, group in entries] == ["flat", "kept"]
        assert (counts["kept"], counts["dropped"]) == (1, 1)
        return c  # dies here: the read is never acknowledged

    read_and_process()
    assert int(rclient.get(NAMES.samples_retired)) == 4  # flat's 2 and broken's 2
    again = read_and_process()  # the restarted process re-reads its own pending entries
    assert int(rclient.get(NAMES.samples_retired)) == 4
    assert retire_groups(rclient, NAMES, [("flat", 2), ("other", 3)]) == 3  # a re-sent call
    assert int(rclient.get(NAMES.samples_retired)) == 7
    assert again.dead_lettered == 0  # broken was acknowledged with its dead letter
