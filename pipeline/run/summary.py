"""``summary.json``: what a finished (or stopped) run did, read from the pools'
status hashes and ``metrics.jsonl``, plus a readable rendering.

A run whose weights did not reach its actors is not "finished": when the trainer
finished but :func:`weight_problems` finds an actor that (per actor, from its
status hash; versions are the trainer's optimizer steps)

- applied no weight version although the trainer made one (trainer version > 0);
- failed more of the versions announced to it than it applied
  (``weight_versions_failed > weight_updates_applied``: fewer than half of what
  reached it went in). Only versions *announced to this actor* count: the
  publisher's skipped versions (replaced by a newer one before they were sent,
  the trainer's ``weight_versions_unreceived``) and those published before the
  actor joined were never announced to it, and a (re)joining actor is sent the
  current version at once, so neither a late join nor the publisher's skipping
  makes an actor look starved;
- ended on partial weights, or on an older version than the trainer's last one
  when that version did reach some actor (``<run>:published_version``, the newest
  some actor received whole, equals the trainer's version), after the launcher
  waited ``launch.final_sync_timeout_s`` for it. When the trainer's last version
  reached no actor (e.g. a relaunch whose trainer finishes on the data left in the
  streams before the actors have joined), an actor behind it is not stuck: nothing
  was there to receive;

the outcome is ``failed: weights did not reach the actors: ...`` naming each
one, and the launcher exits 1. The second rule is also checked live: the
progress line (pipeline/run/progress.py) shows such an actor while it happens.

When Redis cannot answer at the end (the whole machine shutting down, redis-server
included), :func:`write_summary` writes the summary from what is on disk instead
(:func:`build_disk_summary`: ``metrics.jsonl``, ``config.yaml``, ``checkpoints/``):
the trainer's steps, samples, rewards and checkpoint position, the groups the
actors published and where the records say they ended, restarts and the last
evaluation. ``redis_unavailable`` lists, in words, each part only Redis holds and so
left out (its fields are null or empty): the pools' statuses and counters, the
in-flight entries, the dead letters, the newest published version and with it the
check that the weights reached the actors; ``redis_error`` says why. A group the
records do not place is then counted ``unaccounted`` (in a stream, dead-lettered or
lost: only Redis can say), never ``lost``. Nothing in Redis is lost by this: the
AOF holds every acknowledged write, and the next launch on the run directory (or
``pipeline.inspect --run-dir``) reads it.

The :class:`Summary`'s fields, the parts only Redis fills (``WITHOUT_REDIS``) and the
text the launcher prints are in pipeline/run/summary_fields.py; this module reads the run
into them and writes ``summary.json``.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import asdict

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from pipeline import checkpoint
from pipeline.run.accounting import account, dead_letters, in_flight
from pipeline.run.summary_fields import NULL_WITHOUT_REDIS, WITHOUT_REDIS, Summary
from pipeline.streams import Names
from pipeline.streams.cluster import silent as cluster_silent
from pipeline.streams.shards import Shards
from pipeline.telemetry import read_jsonl, read_statuses, surviving_steps

REWARD_ERROR_PREFIX = "reward_errors."  # an actor's per-reason reward-error counters


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _config_str(run_dir: str, key: str, default: str) -> str:
    from omegaconf import OmegaConf

    path = os.path.join(run_dir, "config.yaml")
    value = OmegaConf.select(OmegaConf.load(path), key) if os.path.exists(path) else None
    return default if value is None else str(value)


def trainer_resume_position(run_dir: str) -> str | None:
    """Where a restarted trainer of the run in ``run_dir`` would read from: its latest
    checkpoint's position, the stream's start without one; None when trainer.resume is
    off (a restart then reads only new entries)."""
    if _config_str(run_dir, "trainer.resume", "True") == "False":
        return None
    latest = checkpoint.latest(os.path.join(run_dir, "checkpoints"))
    return str(checkpoint.load_state(latest)["entry_id"]) if latest else "0-0"


def _group_size(run_dir: str) -> int:
    from omegaconf import OmegaConf

    path = os.path.join(run_dir, "config.yaml")
    size = (
        OmegaConf.select(OmegaConf.load(path), "task.group_size") if os.path.exists(path) else None
    )
    if size is None:
        raise ValueError(f"{path} has no task.group_size; the summary needs the run's config")
    return int(size)


def trainer_setup(trainer: dict[str, str]) -> dict[str, str | int]:
    """What the trainer ran, from its status hash (trainer.backends.describe writes it)."""
    keys = ("backend", "zero_stage", "world_size", "dtype", "device")
    ints = ("zero_stage", "world_size")
    return {k: int(trainer[k]) if k in ints else trainer[k] for k in keys if k in trainer}


def reward_errors(statuses: dict[str, dict[str, str]]) -> tuple[int, dict[str, int]]:
    """(total, per reason) of the actors' reward errors."""
    total, reasons = 0, Counter()
    for st in statuses.values():
        if st.get("role") != "actor":
            continue
        total += int(st.get("reward_errors", 0))
        for k, v in st.items():
            if k.startswith(REWARD_ERROR_PREFIX):
                reasons[k[len(REWARD_ERROR_PREFIX) :]] += int(v)
    return total, dict(reasons)


EPISODE_COUNTERS = ("episodes", "turns", "multi_turn", "tool_calls", "infra_failures")
EPISODE_COUNTERS += ("episodes_spanning", "episodes_resumed", "episodes_restarted")
EPISODE_COUNTERS += ("episode_groups_taken_over", "episode_groups_dead_lettered", "env_errors")


def episode_counters(statuses: dict[str, dict[str, str]]) -> dict[str, int]:
    """The actors' episode counters (actor/episodes.py), summed; empty without episodes."""
    total: Counter = Counter()
    for st in statuses.values():
        if st.get("role") != "actor":
            continue
        for k, v in st.items():
            if k in EPISODE_COUNTERS or k.startswith("tool."):
                total[k] += int(v)
    return dict(total)


def dead_lettered_by_role(statuses: dict[str, dict[str, str]], dead: list[dict]) -> dict[str, int]:
    """Dead-lettered entries per role (preprocessor, trainer): the larger of the pools'
    own counters (HINCRBY in their status hashes: they survive the dead-letter stream's
    cap, redis.dead_letter_maxlen) and the entries still in that stream."""
    counted, listed = Counter(), Counter(d["role"] or "other" for d in dead)
    for st in statuses.values():
        if st.get("role") in ("preprocessor", "trainer"):
            counted[st["role"]] += int(st.get("dead_lettered", 0))
    return {r: max(counted[r], listed[r]) for r in sorted(set(counted) | set(listed))}


def weight_problems(
    statuses: dict[str, dict[str, str]], newest_published: int | None = None, at_end: bool = True
) -> list[str]:
    """One line per actor whose weights are not arriving (the rules in this module's
    docstring); ``at_end=False`` (the live progress line) checks only the failed-versions
    rule, since during a run the first version may simply not have arrived yet."""
    trainer_v = status_version(statuses.get("trainer", {})) or 0
    problems = []
    for name, st in sorted(statuses.items()):
        if st.get("role") != "actor":
            continue
        applied = int(st.get("weight_updates_applied", 0))
        failed = int(st.get("weight_versions_failed", 0))
        offered = int(st.get("weight_versions_offered", 0))
        version = status_version(st)  # None: partial weights (an in-place update failed)
        why = st.get("last_error", "")
        if failed > applied:
            line = f"{name} applied {applied} weight versions; {failed} of {offered} sent failed"
        elif at_end and applied == 0 and trainer_v > 0:
            line = f"{name} applied no weight version (trainer at v{trainer_v})"
        elif at_end and version is None:
            line = f"{name} ended on partial weights (an in-place update failed)"
        elif at_end and newest_published == trainer_v and version < newest_published:
            line = f"{name} ended on v{version}; the newest published is v{newest_published}"
        else:
            continue
        problems.append(line + (f" (last error: {why[:200]})" if why and failed else ""))
    return problems


def wait_for_final_sync(client, names: Names, cfg, target: int) -> None:
    """Give the actors ``launch.final_sync_timeout_s`` to apply the trainer's last version
    before they are stopped (the launcher, and deploy/slurm/run.sbatch through
    pipeline/run/batch_end.py): an actor still joining when a short run's trainer
    finished is sent that version at once, and only one that does not get it in that
    time fails :func:`weight_problems`."""
    deadline = time.monotonic() + cfg.launch.final_sync_timeout_s
    while time.monotonic() < deadline:
        actors = {k: v for k, v in read_statuses(client, names).items() if v["role"] == "actor"}
        if actors and all((status_version(v) or 0) >= target for v in actors.values()):
            return
        time.sleep(0.2)


def status_version(st: dict[str, str]) -> int | None:
    """A status hash's ``version``: 0 when not written yet, None when it says ``None``
    (an engine holding partial weights after a failed in-place update)."""
    value = st.get("version", "0")
    return int(value) if value.lstrip("-").isdigit() else None


def newest_published(client: redis.Redis, names: Names) -> int | None:
    """The newest version some actor received whole (the weight publisher's key)."""
    value = client.get(names.published_version)
    return int(value) if value is not None else None


def _cpu_fields(record: dict) -> dict:
    return {k: record[k] for k in ("wall_s", "cores", "cpu_s", "share")}


def trainer_wait(steps: list[dict]) -> dict:
    """The trainer's idle share from its step records' ``wait_s`` and ``step_s``, over the
    steps after the first (the first one's wait holds the pools' start-up)."""
    later = [r for r in steps[1:] if "wait_s" in r and "step_s" in r]
    if not later:
        return {}
    wait, busy = sum(r["wait_s"] for r in later), sum(r["step_s"] for r in later)
    return {
        "steps": len(later),
        "wait_s": round(wait, 2),
        "step_s": round(busy, 2),
        "idle_share": round(wait / (wait + busy), 4) if wait + busy > 0 else 0.0,
        "longest_wait_s": round(max(r["wait_s"] for r in later), 2),
    }


def from_run_dir(run_dir: str, records: list[dict], terms: dict) -> dict:
    """The Summary fields both summaries (with Redis and without) take from the run
    directory: the config's mode and engine, the last evaluation, the reward over the
    first and last steps that survive in ``records``, the launcher's restarts, and the
    group account ``terms`` (pipeline/run/accounting.py)."""
    steps = surviving_steps(records)
    window = max(1, min(5, len(steps) // 2))
    rewards = [r["reward_mean"] for r in steps]
    evals = [r for r in records if r.get("event") == "eval"]
    restarts = Counter(
        r["target"] for r in records if r.get("pool") == "launcher" and r.get("event") == "restart"
    )
    return dict(
        mode=_config_str(run_dir, "pipeline.mode", "async"),
        actor_engine=_config_str(run_dir, "actor.engine", "hf"),
        last_eval=max(evals, key=lambda r: r["version"], default={}),
        first_eval=min(evals, key=lambda r: r["version"], default={}),
        nonfinite_steps=sum(r.get("event") == "nonfinite_step" for r in records),
        cpu=next((_cpu_fields(r) for r in reversed(records) if r.get("event") == "cpu"), {}),
        trainer_wait=trainer_wait(steps),
        reward_mean_first_window=_mean(rewards[:window]),
        reward_mean_last_window=_mean(rewards[-window:]),
        reward_window_steps=window,
        restarts=dict(restarts),
        groups_produced=terms["groups_produced"],
        groups_trained=terms["groups_trained"],
        groups_dropped_no_signal=terms["groups_no_signal"],
        accounting=terms,
    )


def build_summary(
    run_dir: str,
    client: redis.Redis,
    names: Names,
    outcome: str,
    wall_s: float,
    shards: Shards | None = None,
) -> Summary:
    """``shards``: the run's parts (redis.mode=cluster: its partitions, whose rollouts and
    batches are in flight; ``Shards.of(cfg, client, names)``), None for one part."""
    statuses = read_statuses(client, names)
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    trainer = statuses.get("trainer", {})
    by_role = lambda role: {k: v for k, v in statuses.items() if v.get("role") == role}  # noqa: E731
    actors, preps = by_role("actor"), by_role("preprocessor")
    flight = in_flight(client, names, shards, trainer_resume_position(run_dir))
    dead = dead_letters(client, names)
    terms = account(records, flight, dead, _group_size(run_dir))
    errors, reasons = reward_errors(statuses)
    published_v = newest_published(client, names)
    problems = weight_problems(statuses, published_v)
    if outcome == "finished" and problems:
        outcome = "failed: weights did not reach the actors: " + "; ".join(problems)
    return Summary(
        **from_run_dir(run_dir, records, terms),
        trainer_setup=trainer_setup(trainer),
        outcome=outcome,
        weight_versions_offered={
            k: int(v.get("weight_versions_offered", 0)) for k, v in actors.items()
        },
        weight_versions_failed={
            k: int(v.get("weight_versions_failed", 0)) for k, v in actors.items()
        },
        newest_published_version=published_v,
        weight_problems=problems,
        trainer_steps=int(trainer.get("step", 0)),
        samples_trained=int(trainer.get("samples_trained", 0)),
        weight_updates_published=int(trainer.get("weight_updates_published", 0)),
        weight_updates_applied={
            k: int(v.get("weight_updates_applied", 0)) for k, v in actors.items()
        },
        sequences_spanning_versions=int(trainer.get("sequences_spanning_versions", 0)),
        stale_samples_dropped=int(trainer.get("stale_samples_dropped", 0)),
        dead_lettered=sum(dead_lettered_by_role(statuses, dead).values()),
        dead_lettered_by_role=dead_lettered_by_role(statuses, dead),
        prm_scored_groups=sum(int(v.get("prm_scored_groups", 0)) for v in preps.values()),
        wall_seconds=round(wall_s, 2),
        weight_versions_unreceived=int(trainer.get("weight_versions_unreceived", 0)),
        weight_publish_failures=int(trainer.get("weight_publish_failures", 0)),
        actors_dropped=int(trainer.get("actors_dropped", 0)),
        last_publish_error=trainer.get("last_publish_error", ""),
        reward_errors=errors,
        reward_error_reasons=reasons,
        episodes=episode_counters(statuses),
        in_flight_group_ids=sorted(
            set(flight["rollouts_groups"])
            | {s.rsplit("/", 1)[0] for s in flight["batches_samples"]}
        ),
        in_flight=flight,
        dead_letter_entries=dead,
        pools=statuses,
    )


def build_disk_summary(run_dir: str, outcome: str, wall_s: float, why: str) -> Summary:
    """The summary from the run directory alone (``metrics.jsonl``, ``config.yaml``,
    ``checkpoints/``) when Redis cannot answer (``why``): see the module doc. The
    trainer's counters come from its surviving ``step`` records; the account places
    each published group by the records only, the rest ``groups_unaccounted``."""
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    steps = surviving_steps(records)
    terms = account(records, {}, [], _group_size(run_dir))
    # nothing in flight or dead-lettered is known: a group the records do not place is
    # unaccounted, not lost, and the lost ids are those unplaced
    for key in ("groups_dead_lettered", "groups_in_flight_at_end", "dead_letters"):
        terms.pop(key)
    terms["groups_unaccounted"] = terms.pop("groups_lost")
    terms["unaccounted_ids"] = terms.pop("lost_ids")
    terms["samples_unaccounted"] = terms.pop("samples_lost")
    terms.pop("groups_lost_ids")
    summary = Summary(
        **from_run_dir(run_dir, records, terms),
        outcome=outcome,
        trainer_steps=max((int(r["step"]) for r in steps), default=0),
        samples_trained=sum(int(r.get("samples", 0)) for r in steps),
        sequences_spanning_versions=sum(int(r.get("spanning", 0)) for r in steps),
        stale_samples_dropped=sum(int(r.get("stale", 0)) for r in steps),
        wall_seconds=round(wall_s, 2),
        redis_unavailable=list(WITHOUT_REDIS),
        redis_error=why,
        # filled below: null, or empty where the field is a list or mapping
        dead_lettered=None,
        prm_scored_groups=None,
        weight_updates_published=None,
        weight_updates_applied={},
    )
    for name in NULL_WITHOUT_REDIS:
        value = getattr(summary, name)
        setattr(summary, name, type(value)() if isinstance(value, list | dict) else None)
    return summary


def silent(client: redis.Redis, timeout_s: float) -> str | None:
    """None when ``client``'s server answers a PING within ``timeout_s`` (one try, on a
    connection of its own with the client's address, credentials and TLS), else why.
    A Redis Cluster client (redis.mode=cluster): every primary it finds answers."""
    if isinstance(client, RedisCluster):
        return cluster_silent(client, timeout_s)
    pool = client.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs.update(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    kwargs["retry"] = Retry(NoBackoff(), 0)
    conn = pool.connection_class(**kwargs)
    try:
        conn.connect()
        conn.send_command("PING")
        conn.read_response()
        return None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        return " ".join(str(e).split())[:300] or type(e).__name__
    finally:
        conn.disconnect()


def write_summary(
    run_dir: str,
    client: redis.Redis,
    names: Names,
    outcome: str,
    wall_s: float,
    shards: Shards | None = None,
    probe_s: float = 3.0,
) -> Summary:
    """Write ``summary.json`` from Redis and the run directory; when Redis does not
    answer (its client gives up after its own short retries), from the run directory
    alone (:func:`build_disk_summary`, ``redis_unavailable`` naming what is missing).
    Redis is asked first with a ``probe_s`` deadline: a server that is gone refuses at
    once, and one that hangs is not waited for the client's 30 s socket deadline."""
    why = silent(client, probe_s)
    try:
        if why is None:
            summary = build_summary(run_dir, client, names, outcome, wall_s, shards)
    except (redis.ConnectionError, redis.TimeoutError) as e:
        why = " ".join(str(e).split())[:300] or type(e).__name__
    if why is not None:
        summary = build_disk_summary(run_dir, outcome, wall_s, why)
    path = os.path.join(run_dir, "summary.json")
    with open(path + ".tmp", "w") as f:
        json.dump(asdict(summary), f, indent=2)
    os.replace(path + ".tmp", path)  # a stop mid-write leaves the previous one whole
    return summary
