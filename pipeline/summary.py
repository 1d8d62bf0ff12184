"""``summary.json``: what a finished (or stopped) run did, read from the pools'
status hashes and ``metrics.jsonl``, plus a readable rendering."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field

import redis

from pipeline.messages import BadEntry, TrainBatch, decode
from pipeline.streams import Names
from pipeline.telemetry import read_jsonl, read_statuses, surviving_steps


@dataclass
class Summary:
    outcome: str
    trainer_steps: int
    samples_trained: int
    weight_updates_published: int
    weight_updates_applied: dict[str, int]
    sequences_spanning_versions: int
    stale_samples_dropped: int
    reward_mean_first_window: float | None
    reward_mean_last_window: float | None
    reward_window_steps: int
    groups_produced: int
    groups_trained: int
    groups_dropped_no_signal: int
    dead_lettered: int
    prm_scored_groups: int  # groups in which the step-reward scorer scored a step
    wall_seconds: float
    restarts: dict[str, int] = field(default_factory=dict)
    in_flight_group_ids: list[str] = field(default_factory=list)
    pools: dict[str, dict[str, str]] = field(default_factory=dict)

    def render(self) -> str:
        rows = [
            ("outcome", self.outcome),
            ("trainer steps", self.trainer_steps),
            ("samples trained", self.samples_trained),
            (
                "pool restarts",
                ", ".join(f"{k}={v}" for k, v in sorted(self.restarts.items())) or "none",
            ),
            (
                "groups produced / trained / no-signal",
                f"{self.groups_produced} / {self.groups_trained} / {self.groups_dropped_no_signal}",
            ),
            ("weight updates published", self.weight_updates_published),
            (
                "weight updates applied",
                ", ".join(f"{k}={v}" for k, v in sorted(self.weight_updates_applied.items()))
                or "-",
            ),
            ("sequences spanning versions", self.sequences_spanning_versions),
            ("stale samples dropped", self.stale_samples_dropped),
            (
                f"reward first/last {self.reward_window_steps} steps",
                f"{_fmt(self.reward_mean_first_window)} -> {_fmt(self.reward_mean_last_window)}",
            ),
            ("dead-lettered entries", self.dead_lettered),
            ("groups with PRM-scored steps", self.prm_scored_groups),
            ("wall seconds", f"{self.wall_seconds:.1f}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(["run summary"] + [f"  {k.ljust(width)}  {v}" for k, v in rows])


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def build_summary(
    run_dir: str, client: redis.Redis, names: Names, outcome: str, wall_s: float
) -> Summary:
    statuses = read_statuses(client, names)
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    steps = surviving_steps(records)
    window = max(1, min(5, len(steps) // 2))
    rewards = [r["reward_mean"] for r in steps]
    trainer = statuses.get("trainer", {})
    by_role = lambda role: {k: v for k, v in statuses.items() if v.get("role") == role}  # noqa: E731
    actors, preps = by_role("actor"), by_role("preprocessor")
    return Summary(
        outcome=outcome,
        trainer_steps=int(trainer.get("step", 0)),
        samples_trained=int(trainer.get("samples_trained", 0)),
        weight_updates_published=int(trainer.get("weight_updates_published", 0)),
        weight_updates_applied={
            k: int(v.get("weight_updates_applied", 0)) for k, v in actors.items()
        },
        sequences_spanning_versions=int(trainer.get("sequences_spanning_versions", 0)),
        stale_samples_dropped=int(trainer.get("stale_samples_dropped", 0)),
        reward_mean_first_window=_mean(rewards[:window]),
        reward_mean_last_window=_mean(rewards[-window:]),
        reward_window_steps=window,
        groups_produced=len({r["group"] for r in records if r.get("event") == "group"}),
        groups_trained=len({g for r in steps for g in r.get("groups", [])}),
        groups_dropped_no_signal=sum(int(v.get("dropped", 0)) for v in preps.values()),
        dead_lettered=sum(int(v.get("dead_lettered", 0)) for v in preps.values())
        + int(trainer.get("dead_lettered", 0)),
        prm_scored_groups=sum(int(v.get("prm_scored_groups", 0)) for v in preps.values()),
        wall_seconds=round(wall_s, 2),
        restarts=dict(
            Counter(
                r["target"]
                for r in records
                if r.get("pool") == "launcher" and r.get("event") == "restart"
            )
        ),
        in_flight_group_ids=groups_in_flight(client, names),
        pools=statuses,
    )


def groups_in_flight(client: redis.Redis, names: Names) -> list[str]:
    """Groups in ``batches`` entries the trainer has not acknowledged (unread or pending)."""
    try:
        group = next(g for g in client.xinfo_groups(names.batches) if g["name"] == b"trainer")
    except (redis.ResponseError, StopIteration):
        return []
    last = group["last-delivered-id"].decode()
    pending = {
        p["message_id"].decode()
        for p in client.xpending_range(names.batches, "trainer", "-", "+", 100000)
    }
    out: set[str] = set()
    for entry_id, fields in client.xrange(names.batches):
        if _newer(entry_id.decode(), last) or entry_id.decode() in pending:
            try:
                out.update(decode(fields[b"data"], TrainBatch).group_ids)
            except (BadEntry, KeyError):
                continue
    return sorted(out)


def _newer(a: str, b: str) -> bool:
    return tuple(map(int, a.split("-"))) > tuple(map(int, b.split("-")))


def write_summary(
    run_dir: str, client: redis.Redis, names: Names, outcome: str, wall_s: float
) -> Summary:
    summary = build_summary(run_dir, client, names, outcome, wall_s)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(asdict(summary), f, indent=2)
    return summary
