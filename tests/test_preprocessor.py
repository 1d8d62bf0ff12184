"""The preprocessor's packing and its counters: batches never mix sampling settings,
and status totals go on from where a killed process left them (real redis-server)."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.messages import SCHEMA_VERSION, RolloutGroup, Sample, pack_f32, pack_i32
from pipeline.messages import rle_encode as rle
from pipeline.streams import Names
from pipeline.telemetry import PoolStatus, read_statuses
from preprocessor.main import add_totals, to_batches

NAMES = Names("nsrl-pre", "run")


def group(gid: str, temperature: float, top_p: float = 1.0, top_k: int = 0) -> RolloutGroup:
    samples = [
        Sample(
            index=i,
            completion_ids=pack_i32([7, 8, 9]),
            logprobs=pack_f32([-1.0] * 3),
            versions=rle([0] * 3),
            reward=float(i),
            finished=True,
        )
        for i in range(2)
    ]
    return RolloutGroup(
        schema=SCHEMA_VERSION,
        group_id=gid,
        actor="actor-0",
        problem_id="p",
        prompt_ids=pack_i32([1, 2]),
        samples=samples,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
    )


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
