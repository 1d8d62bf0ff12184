"""The run summary's fields (``summary.json``), what only Redis fills, and the text the
launcher prints.

pipeline/run/summary.py reads the run (the pools' status hashes and the streams in Redis,
``metrics.jsonl``, ``config.yaml`` and ``checkpoints/`` on disk) into a
:class:`Summary`; this module holds its fields and renders it. A summary
written without Redis leaves the fields of :data:`WITHOUT_REDIS` null or empty,
and its rendering shows them as "-".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pipeline.run.cpu_meter import shares_text


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
    dead_lettered: int  # entries, every pool's (preprocessors and trainer)
    prm_scored_groups: int  # groups in which the step-reward scorer scored a step
    wall_seconds: float
    # the weight publisher's fields of the trainer's status (trainer/weight_publisher.py)
    weight_versions_unreceived: int = 0  # versions no actor received whole
    weight_publish_failures: int = 0
    actors_dropped: int = 0
    last_publish_error: str = ""
    reward_errors: int = 0  # rewards that raised (scored 0.0), summed over actors
    reward_error_reasons: dict[str, int] = field(default_factory=dict)
    # task.kind=env: the actors' episode counters summed (episodes, turns, multi_turn,
    # tool_calls, tool.<outcome>, infra_failures, episodes_spanning, episodes_resumed,
    # episodes_restarted, episode_groups_taken_over, episode_groups_dead_lettered,
    # env_errors); empty otherwise
    episodes: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    # where every produced group ended (pipeline/run/accounting.py)
    accounting: dict = field(default_factory=dict)
    in_flight_group_ids: list[str] = field(default_factory=list)  # rollouts and batches
    in_flight: dict[str, list[str]] = field(default_factory=dict)  # per stream
    dead_letter_entries: list[dict] = field(default_factory=list)
    pools: dict[str, dict[str, str]] = field(default_factory=dict)
    mode: str = "async"  # pipeline.mode: async (pipelined) or sync (phases alternate)
    actor_engine: str = "hf"  # actor.engine as resolved for the run (hf or vllm)
    last_eval: dict = field(default_factory=dict)  # the evaluator's last ``eval`` record
    first_eval: dict = field(default_factory=dict)  # its first (version 0: eval.at_start)
    # trainer steps not applied: loss or gradient not finite (trainer/main.py skip)
    nonfinite_steps: int = 0
    dead_lettered_by_role: dict[str, int] = field(default_factory=dict)
    # per actor: versions announced to it, and those it failed to apply (weight_receiver)
    weight_versions_offered: dict[str, int] = field(default_factory=dict)
    weight_versions_failed: dict[str, int] = field(default_factory=dict)
    newest_published_version: int | None = None
    weight_problems: list[str] = field(default_factory=list)  # summary.weight_problems, at the end
    # backend, zero_stage (deepspeed), world_size, dtype, device: summary.trainer_setup
    trainer_setup: dict[str, str | int] = field(default_factory=dict)
    # Redis could not answer at the end: the parts it alone holds, left out (null or
    # empty fields; summary.build_disk_summary), and the error; empty when Redis answered
    redis_unavailable: list[str] = field(default_factory=list)
    redis_error: str = ""
    # the launcher's last ``cpu`` record (pipeline/run/cpu_meter.py): per pool CPU seconds
    # and share (cores busy over the run), the cores, the wall it covers; {} without one
    cpu: dict = field(default_factory=dict)
    # the trainer's wait for data (``wait_s`` of its step records) over the steps after the
    # first (whose wait includes the start-up): ``steps``, ``wait_s``, ``step_s``,
    # ``idle_share`` = wait / (wait + step), ``longest_wait_s``; {} with fewer than 2 steps
    trainer_wait: dict = field(default_factory=dict)

    def render(self) -> str:
        s = self
        if self.redis_unavailable:  # a field Redis could not give is null: shown as "-"
            s = Summary(
                **{
                    k: "-" if v is None and k in NULL_WITHOUT_REDIS else v
                    for k, v in asdict(self).items()
                }
            )
        rows = [
            ("outcome", s.outcome),
            ("mode", s.mode),
            ("actor engine", s.actor_engine),
            ("trainer", " ".join(f"{k}={v}" for k, v in s.trainer_setup.items()) or "-"),
            ("trainer steps", s.trainer_steps),
            ("samples trained", s.samples_trained),
            (
                "pool restarts",
                ", ".join(f"{k}={v}" for k, v in sorted(s.restarts.items())) or "none",
            ),
            (
                "groups produced / trained / no-signal",
                f"{s.groups_produced} / {s.groups_trained} / {s.groups_dropped_no_signal}",
            ),
            ("weight updates published", s.weight_updates_published),
            (
                "unreceived / publish failures / actors dropped",
                f"{s.weight_versions_unreceived} / {s.weight_publish_failures} / "
                f"{s.actors_dropped}",
            ),
            ("last publish error", s.last_publish_error or "-"),
            (
                "weight updates applied (failed)",
                ", ".join(
                    f"{k}={v} ({s.weight_versions_failed.get(k, 0)})"
                    for k, v in sorted(s.weight_updates_applied.items())
                )
                or "-",
            ),
            (
                "weights not arriving",
                "-" if s.redis_unavailable else "; ".join(s.weight_problems) or "none",
            ),
            ("sequences spanning versions", s.sequences_spanning_versions),
            ("stale samples dropped", s.stale_samples_dropped),
            ("non-finite steps (not applied)", s.nonfinite_steps),
            (
                f"reward first/last {s.reward_window_steps} steps",
                f"{_fmt(s.reward_mean_first_window)} -> {_fmt(s.reward_mean_last_window)}",
            ),
            ("held-out greedy accuracy", _before_after(s.first_eval, s.last_eval)),
            ("held-out eval, last version", _eval_text(s.last_eval)),
            (
                "dead-lettered entries",
                f"{s.dead_lettered}"
                + (" (" if s.dead_lettered_by_role else "")
                + ", ".join(f"{k} {v}" for k, v in sorted(s.dead_lettered_by_role.items()))
                + (")" if s.dead_lettered_by_role else ""),
            ),
            (
                "reward errors",
                f"{s.reward_errors}"
                + "".join(f", {k}={v}" for k, v in sorted(s.reward_error_reasons.items())),
            ),
            *_episode_rows(s.episodes),
            _account_row(s.accounting),
            ("groups with PRM-scored steps", s.prm_scored_groups),
            ("cores busy over the run", shares_text(s.cpu.get("share"), s.cpu.get("cores"))),
            ("trainer waiting for data", _wait_text(s.trainer_wait)),
            ("wall seconds", f"{s.wall_seconds:.1f}"),
        ]
        if self.redis_unavailable:
            why = f"redis did not answer ({self.redis_error}); not in this summary: "
            rows.insert(1, ("from disk only", why + "; ".join(self.redis_unavailable)))
        width = max(len(k) for k, _ in rows)
        return "\n".join(["run summary"] + [f"  {k.ljust(width)}  {v}" for k, v in rows])


def _wait_text(w: dict) -> str:
    if not w:
        return "-"
    return (
        f"{100 * w['idle_share']:.1f}% of steps 2-{w['steps'] + 1} "
        f"({w['wait_s']:.1f} s waiting, {w['step_s']:.1f} s training), "
        f"longest wait {w['longest_wait_s']:.1f} s"
    )


def _episode_rows(e: dict) -> list[tuple[str, str]]:
    """task.kind=env: episodes, turns per episode, tool calls by outcome, infra failures,
    episodes that spanned versions (no rows for a run without episodes)."""
    if not e.get("episodes"):
        return []
    n = e["episodes"]
    kinds = ", ".join(
        f"{k.removeprefix('tool.')} {v}" for k, v in sorted(e.items()) if k.startswith("tool.")
    )
    return [
        (
            "episodes (multi-turn)",
            f"{n} ({e.get('multi_turn', 0)}), {e.get('turns', 0) / n:.2f} turns per episode",
        ),
        ("tool calls", f"{e.get('tool_calls', 0)}" + (f" ({kinds})" if kinds else "")),
        ("episodes with infra failures", str(e.get("infra_failures", 0))),
        ("episodes spanning versions", str(e.get("episodes_spanning", 0))),
        (
            "episodes taken over",
            f"{e.get('episode_groups_taken_over', 0)} groups: "
            f"{e.get('episodes_resumed', 0)} episodes resumed, "
            f"{e.get('episodes_restarted', 0)} restarted"
            # refused whole when taken over: in the dead letters (actor/journal.py)
            + (
                f"; {e['episode_groups_dead_lettered']} groups dead-lettered"
                if e.get("episode_groups_dead_lettered")
                else ""
            ),
        ),
        ("environment errors", str(e.get("env_errors", 0))),
    ]


def _account_row(terms: dict) -> tuple[str, str]:
    """The account's row; from disk only, the groups the records do not place are
    "unaccounted" (in a stream, dead-lettered or lost: only Redis can say)."""
    if "groups_unaccounted" in terms:
        keys = ("trained", "stale", "no_signal", "unaccounted")
        label = "groups trained/stale/no-signal/unaccounted (no redis)"
    else:
        keys = ("trained", "stale", "no_signal", "dead_lettered", "in_flight_at_end", "lost")
        label = "groups trained/stale/no-signal/dead/in flight/lost"
    return label, " / ".join(str(terms.get(f"groups_{k}", "-")) for k in keys)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _before_after(first: dict, last: dict) -> str:
    """``A -> B (vX -> vY)``: the held-out greedy accuracy at the first and last versions
    evaluated ("-" without an evaluator)."""
    if not first:
        return "-"
    a, b = first["greedy_accuracy"], last["greedy_accuracy"]
    return f"{a:.3f} -> {b:.3f} (v{first['version']} -> v{last['version']})"


def _eval_text(r: dict) -> str:
    if not r:
        return "-"
    return (
        f"v{r['version']}: greedy accuracy {r['greedy_accuracy']:.3f}, "
        f"mean reward {r['mean_reward']:.3f}, pass@{r['k']} {r['pass_at_k']:.3f}"
    )


# What only Redis holds, in words (``redis_unavailable``), with the Summary fields it
# fills: null (or empty) in a summary written from disk
WITHOUT_REDIS: dict[str, tuple[str, ...]] = {
    "pool statuses and counters (the trainer's, the preprocessors', the actors')": (
        "pools",
        "trainer_setup",
        "prm_scored_groups",
        "reward_errors",
        "reward_error_reasons",
        "episodes",
    ),
    "the weight publisher's and receivers' counters": (
        "weight_updates_published",
        "weight_versions_unreceived",
        "weight_publish_failures",
        "actors_dropped",
        "last_publish_error",
        "weight_updates_applied",
        "weight_versions_offered",
        "weight_versions_failed",
    ),
    "the newest published version, and so the check that the weights reached the actors": (
        "newest_published_version",
        "weight_problems",
    ),
    "the entries in flight (rollouts and batches not yet acknowledged)": (
        "in_flight_group_ids",
        "in_flight",
    ),
    "the dead letters": ("dead_lettered", "dead_lettered_by_role", "dead_letter_entries"),
}
NULL_WITHOUT_REDIS = {f for fields in WITHOUT_REDIS.values() for f in fields}
