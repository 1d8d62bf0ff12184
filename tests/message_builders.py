"""Wire messages built for tests (tests/test_preprocessor.py, tests/test_durable.py)."""

from __future__ import annotations

from pipeline.messages import SCHEMA_VERSION, RolloutGroup, Sample, pack_f32, pack_i32, pack_u8
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


def episode(index: int, turns: list[tuple[list[int], list[int]]], versions: list[int], **kw):
    """A Sample that is an episode: per turn (sampled ids, observation ids that follow;
    the last turn's observation is empty), ``versions`` one per sampled id; log-probs
    -0.5 per sampled id; one "ok" tool outcome per turn but the last ("")."""
    ids, mask, offsets = [], [], []
    for sampled, observed in turns:
        offsets.append(len(ids))
        ids += sampled + observed
        mask += [1] * len(sampled) + [0] * len(observed)
    n = sum(mask)
    return Sample(
        index=index,
        completion_ids=pack_i32(ids),
        logprobs=pack_f32([-0.5] * n),
        versions=rle(versions),
        reward=kw.pop("reward", 1.0),
        finished=True,
        loss_mask=pack_u8(mask),
        turn_offsets=pack_i32(offsets),
        tool_outcomes=["ok"] * (len(turns) - 1) + [""],
        **kw,
    )


def episode_group(gid: str, samples: list[Sample], prompt: list[int] | None = None):
    return RolloutGroup(
        schema=SCHEMA_VERSION,
        group_id=gid,
        actor="actor-0",
        problem_id="p",
        prompt_ids=pack_i32(prompt or [1, 2]),
        samples=samples,
        temperature=1.0,
    )
