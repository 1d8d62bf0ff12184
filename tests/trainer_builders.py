"""Trainer builders shared by the tests: a Sample and a TrainBatch of random tokens (a
seeded numpy Generator), and one trainer step run to its end. The fixtures they go with,
``tiny`` and ``make_trainer``, are in tests/conftest.py. No test lives here."""

from __future__ import annotations

from pipeline.messages import (
    SCHEMA_VERSION,
    Sample,
    TrainBatch,
    pack_f32,
    pack_i32,
    rle_encode,
)
from trainer.main import Trainer


def sample(index: int, n: int, version: int, advantage: float, rng, lp=None) -> Sample:
    return Sample(
        index=index,
        completion_ids=pack_i32(rng.integers(10, 90, n)),
        logprobs=pack_f32(lp if lp is not None else -rng.uniform(3, 5, n)),
        versions=rle_encode([version] * n),
        reward=max(advantage, 0.0),
        finished=True,
        advantage=advantage,
    )


def batch(group: str, samples: list[Sample], rng) -> TrainBatch:
    return TrainBatch(
        schema=SCHEMA_VERSION,
        batch_id=group,
        group_ids=[group] * len(samples),
        prompt_ids=[pack_i32(rng.integers(10, 90, 5)) for _ in samples],
        samples=samples,
        temperature=1.0,
    )


def run_step(trainer: Trainer) -> dict:
    plan = trainer.next_plan()
    assert not plan.stop and plan.batches
    return trainer.step(plan)  # records the step
