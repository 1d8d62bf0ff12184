"""Wire messages built for tests (tests/test_preprocessor.py, tests/test_durable.py)."""

from __future__ import annotations

from pipeline.messages import SCHEMA_VERSION, RolloutGroup, Sample, pack_f32, pack_i32
from pipeline.messages import rle_encode as rle


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
