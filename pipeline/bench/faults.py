"""``python -m pipeline.bench faults --out FILE [--set KEY=VALUE ...]``: the CPU
pipeline on the tiny model under a schedule of faults, and an account of every
group.

Faults (seconds after the first trainer step): SIGKILL the actor, the
preprocessor and the trainer, SIGSTOP the preprocessor (the launcher's
watchdog must notice and restart it), restart the embedded redis-server
(SIGTERM: it writes its AOF out) and SIGKILL it (``redis_sigkill``: no chance
to flush; with ``redis.embedded_appendfsync=always`` every acknowledged write
is already on disk, and the launcher restarts it from its AOF). Each fault is
named in the JSON (``actor-0_sigkill``, ``redis_restart``, ``redis_sigkill``,
...) and checked to have taken effect: the hit process is gone (or stopped,
then gone) and a new pid reports in its status hash; the redis-server comes
back with a new pid and a new ``run_id``. ``--faults redis_sigkill,...`` runs
only the named faults of the schedule, 20 s apart.

``redis_primary_loss`` (``redis=ha`` runs only, ``--set redis=ha --faults
redis_primary_loss``; not in the default schedule): SIGKILL the primary the sentinels
name and delete its data directory, as if its machine were lost. It takes effect when
the sentinels have promoted the replica (another server, new ``run_id``, answering as
the primary); ``first_write_s`` is the time from the kill to the first write the new
primary acknowledged (a key of the run's, ``<run>:faults_probe``).

``cluster_primary_loss`` (``redis=cluster`` runs only, ``--set redis=cluster --faults
cluster_primary_loss``; not in the default schedule): SIGKILL the cluster primary that
serves the run's control keys (slot of ``{<run>}``; the partitions it also serves are
recorded) and delete its data directory. It takes effect when another node, its replica,
serves that slot; ``first_write_s`` is the time from the kill to the first write
acknowledged there (``<run>:faults_probe``, in that slot), ``first_durable_write_s`` to
the first one that also passed its WAIT (``redis.min_replicas_acked`` replicas: the lost
node back as the promoted node's replica), as the pools' work writes must.

After the last fault and ``--tail-steps`` steps, the run is drained: the actors
stop producing (the ``drain`` field of ``<run>:run``, actor/room.py), the
preprocessors and the trainer take what is in the streams and the pending lists,
and once nothing has moved for a few seconds an operator's Ctrl-C stops it. What is
left in flight must then be only the trainer's unfinished step (fewer than
``trainer.samples_per_step`` samples, each entry named by id and shown in the
trainer's pending list); anything in ``rollouts``, unread, or undecodable fails the run.

``metrics.jsonl`` and ``summary.json`` (in-flight entries and dead letters, read by
the launcher from Redis) are then checked against each other
(pipeline/run/accounting.py): every sample the actors recorded as published is found
again (trained or dropped in the trainer's records, dropped by a preprocessor,
dead-lettered, or in a stream); the run passes when nothing is lost, duplicated,
phantom or conflicting (each would be named by id in ``problems``), the drain
left only the trainer's unfinished step, every fault took effect and was
recovered from, and the check can fail: on the same records with one trained id
dropped from the trainer's record it names that id as lost (``broken_record_check``).
``--set trainer.backend=deepspeed --set trainer.world_size=2`` (any Hydra
override, repeatable) runs the same schedule on another configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from omegaconf import OmegaConf

from pipeline.bench.common import device_name, print_table, stop_process, write_json
from pipeline.run.accounting import account, in_flight, problems
from pipeline.streams import DRAIN_FIELD, Names, connect, wait_until
from pipeline.streams.durable import Durability, attach, set_value
from pipeline.telemetry import read_jsonl, read_statuses, surviving_steps

DEFAULT_SCHEDULE = (
    "5:kill:actor-0,15:kill:preprocessor-0,25:kill:trainer,40:stop:preprocessor-0,"
    "60:restart:redis,80:kill:redis"
)
SIGNALS = {"kill": "sigkill", "stop": "sigstop", "restart": "restart", "lose": "loss"}
EXTRA_FAULTS = {  # not in the default schedule
    "redis_primary_loss": ("lose", "redis_primary"),
    "cluster_primary_loss": ("lose", "cluster_primary"),
}
NEEDS_MODE = {  # a fault's target -> the redis.mode (and the --set that gives it) it needs
    "redis_primary": ("sentinel", "redis=ha"),
    "cluster_primary": ("cluster", "redis=cluster"),
}
RECOVERY_TIMEOUT_S = 180.0
DRAIN_TIMEOUT_S = 240.0  # for the preprocessors and the trainer to empty the streams
QUIET_S = 5.0  # nothing in the streams moved this long: drained


def run_overrides(run_dir: str, args) -> list[str]:
    return [
        "+exp=tiny",
        f"run_dir={run_dir}",
        "trainer.max_steps=100000",
        "trainer.checkpoint_every=2",
        f"launch.watchdog_s={args.watchdog_s}",
        "launch.max_restarts=5",
        "redis.claim_idle_s=5",
        "trainer.transfer_timeout_s=10",
        *args.set,
    ]


def check_before_launch(run_dir: str, args) -> None:
    """What can be known before anything starts: the run's config composes and passes the
    launcher's checks, and every planned fault fits its redis.mode (SystemExit naming the
    --set to add otherwise), so a bad invocation launches nothing."""
    from actor.measure_episodes import compose

    try:
        cfg = compose(run_overrides(run_dir, args))
    except Exception as e:  # hydra's and the config checks' own errors: say them plainly
        raise SystemExit(f"the run's config is refused ({type(e).__name__}): {e}") from None
    for _, _, target in args.plan:
        if target in NEEDS_MODE and cfg.redis.mode != NEEDS_MODE[target][0]:
            mode, setting = NEEDS_MODE[target]
            name = next(n for n, (_, t) in EXTRA_FAULTS.items() if t == target)
            raise SystemExit(
                f"{name} needs a {setting} run (redis.mode is {cfg.redis.mode}): add "
                f"--set {setting}"
            )


def launch(run_dir: str, args) -> subprocess.Popen:
    overrides = run_overrides(run_dir, args)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "launcher.out"), "w") as out:  # not a pipe: never fills
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline.launch", *overrides],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


def run_redis(run_dir: str):
    """The run's embedded Redis as ``pipeline.inspect --run-dir`` finds it: its URL
    (``rediss://`` with ``redis.tls=true``) and TLS files."""
    from pipeline.inspect.cli import parse_args
    from pipeline.inspect.target import resolve

    return resolve(parse_args(["--run-dir", run_dir]))


def wait_for_redis(run_dir: str, proc: subprocess.Popen, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the launcher exited ({proc.returncode}): {launcher_out(run_dir)}")
        try:
            target = run_redis(run_dir)
            return connect(target.url, attempts=3, tls=target.tls)
        except (OSError, ConnectionError, ValueError):  # ValueError: no redis/port yet
            time.sleep(0.2)
    raise TimeoutError("the launcher never started its redis-server")


def launcher_out(run_dir: str, chars: int = 3000) -> str:
    try:
        return Path(run_dir, "launcher.out").read_text(errors="replace")[-chars:]
    except OSError:
        return "(no launcher output)"


class LauncherExited(RuntimeError):
    """The run's launcher ended while the bench still needed it (a fault it could not
    recover from, or a restart budget used up): its exit code and last lines say why."""


def check_launcher_alive(proc: subprocess.Popen, run_dir: str, during: str) -> None:
    """Raise :class:`LauncherExited` naming ``during`` (the fault being recovered from)
    and the launcher's last lines when the run is over before the bench is done."""
    if proc.poll() is not None:
        raise LauncherExited(
            f"the launcher exited with code {proc.returncode} during {during}, before the "
            f"bench was done; the end of {run_dir}/launcher.out:\n{launcher_out(run_dir)}"
        )


def run_names(run_dir: str) -> Names:
    cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    return Names.of(cfg)


def count_steps(metrics: str) -> int:
    return sum(r.get("event") == "step" for r in read_jsonl(metrics))


def wait_steps(metrics: str, n: int, timeout_s: float, proc: subprocess.Popen) -> bool:
    target = count_steps(metrics) + n
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if count_steps(metrics) >= target:
            return True
        time.sleep(0.5)
    return False


# ------------------------------------------------------------------ faults and their effect


def pid_state(pid: int) -> str:
    """ "gone", "zombie" (dead, not yet reaped), "stopped" or "running"."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    state = stat.rsplit(")", 1)[1].split()[0]
    return {"Z": "zombie", "X": "gone", "T": "stopped", "t": "stopped"}.get(state, "running")


def redis_identity(run_dir: str, client) -> dict:
    return {
        "pid": int(Path(run_dir, "redis", "redis.pid").read_text()),
        "run_id": client.info("server")["run_id"],
    }


def primary_identity(client) -> dict:
    """The primary a sentinel client is connected to: pid, run_id, data directory."""
    server = client.info("server")
    return {
        "pid": int(server["process_id"]),
        "run_id": server["run_id"],
        "port": int(server["tcp_port"]),
        "dir": client.config_get("dir")["dir"],
    }


def lose_primary(fault: dict, run_dir: str, client, names: Names) -> None:
    """SIGKILL the primary and delete its data directory; then time the first write
    acknowledged after it (the client follows the failover through the sentinels)."""
    mode = OmegaConf.load(os.path.join(run_dir, "config.yaml")).redis.mode
    if mode != "sentinel":
        raise SystemExit(f"redis_primary_loss needs a redis=ha run (redis.mode is {mode})")
    before = primary_identity(client)
    fault.update(pid=before["pid"], run_id=before["run_id"], port=before["port"])
    os.kill(before["pid"], signal.SIGKILL)
    killed = time.monotonic()
    shutil.rmtree(before["dir"], ignore_errors=True)
    client.set(names.faults_probe, str(time.time()))  # retried until a primary takes it
    fault["first_write_s"] = round(time.monotonic() - killed, 2)


def slot_primary_identity(client, key: str) -> dict:
    """The cluster primary serving ``key``'s slot as the cluster client sees it: pid,
    run_id, port, data directory (asked on that node alone)."""
    node = client.get_node_from_key(key)
    direct = client.get_redis_connection(node)
    server = direct.info("server")
    return {
        "pid": int(server["process_id"]),
        "run_id": server["run_id"],
        "port": int(server["tcp_port"]),
        "dir": direct.config_get("dir")["dir"],
    }


def lose_cluster_primary(fault: dict, run_dir: str, client, names: Names) -> None:
    """SIGKILL the cluster primary serving the control keys and delete its data
    directory; then time the first write acknowledged in that slot (the cluster client
    follows the failover: pipeline/streams/cluster.py)."""
    cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    if cfg.redis.mode != "cluster":
        raise SystemExit(
            f"cluster_primary_loss needs a redis=cluster run (redis.mode is {cfg.redis.mode})"
        )
    before = slot_primary_identity(client, names.run_marker)
    node = client.get_node_from_key(names.run_marker)
    fault.update(pid=before["pid"], run_id=before["run_id"], port=before["port"])
    fault["partitions_there"] = [
        k
        for k in range(int(cfg.redis.shards))
        if client.get_node_from_key(names.part(k).rollouts).name == node.name
    ]
    durable = attach(connect(run_redis(run_dir).url), Durability.from_config(cfg))
    os.kill(before["pid"], signal.SIGKILL)
    killed = time.monotonic()
    shutil.rmtree(before["dir"], ignore_errors=True)
    client.set(names.faults_probe, str(time.time()))  # retried until a primary takes it
    fault["first_write_s"] = round(time.monotonic() - killed, 2)
    # as the pools write: counted once WAIT saw a replica (the lost node back as one)
    set_value(durable, names.faults_probe, str(time.time()))
    fault["first_durable_write_s"] = round(time.monotonic() - killed, 2)
    durable.close()


def inject(fault: dict, run_dir: str, client, names: Names) -> None:
    """Apply one fault; record what it hit (pid, and the server's run_id for redis)."""
    if fault["target"] == "redis_primary":
        return lose_primary(fault, run_dir, client, names)
    if fault["target"] == "cluster_primary":
        return lose_cluster_primary(fault, run_dir, client, names)
    if fault["target"] == "redis":
        before = redis_identity(run_dir, client)
        fault["pid"], fault["run_id"] = before["pid"], before["run_id"]
        # restart: SIGTERM (it writes out its AOF); kill: SIGKILL mid-run, nothing flushed
        # beyond what appendfsync already put on disk. The launcher restarts it from its AOF.
        os.kill(before["pid"], signal.SIGKILL if fault["kind"] == "kill" else signal.SIGTERM)
        return
    pid = int(read_statuses(client, names)[fault["target"]]["pid"])
    fault["pid"] = pid
    os.kill(pid, signal.SIGKILL if fault["kind"] == "kill" else signal.SIGSTOP)


def took_effect(fault: dict, run_dir: str, client, names: Names) -> bool:
    """The hit process stopped or died, and a new one (new pid; new run_id for
    redis) reports; fills ``fault["effect"]`` with what was seen."""
    effect = fault.setdefault("effect", {})
    if fault["target"] in ("redis_primary", "cluster_primary"):  # promoted: another server
        try:  # answers as the primary (of the control keys' slot in a cluster)
            if fault["target"] == "cluster_primary":
                now = slot_primary_identity(client, names.run_marker)
            else:
                now = primary_identity(client)
        except redis.RedisError:
            return False
        effect.update(old_pid_state=pid_state(fault["pid"]), new_pid=now["pid"])
        effect.update(new_run_id=now["run_id"], new_port=now["port"])
        effect["first_write_s"] = fault["first_write_s"]
        if "first_durable_write_s" in fault:
            effect["first_durable_write_s"] = fault["first_durable_write_s"]
        return now["port"] != fault["port"] and effect["old_pid_state"] in ("gone", "zombie")
    if fault["target"] == "redis":
        try:
            now = redis_identity(run_dir, client)
        except (OSError, ValueError, redis.RedisError):
            return False
        effect.update(old_pid_state=pid_state(fault["pid"]), new_pid=now["pid"])
        effect["new_run_id"] = now["run_id"]
        return (
            now["pid"] != fault["pid"]
            and now["run_id"] != fault["run_id"]
            and effect["old_pid_state"] in ("gone", "zombie")
        )
    state = pid_state(fault["pid"])
    if state == "stopped":
        effect["was_stopped"] = True
    effect["old_pid_state"] = state
    st = read_statuses(client, names).get(fault["target"], {})
    new_pid = int(st.get("pid", 0))
    effect["new_pid"] = new_pid if new_pid != fault["pid"] else None
    hit = state in ("gone", "zombie") and (fault["kind"] != "stop" or effect.get("was_stopped"))
    return hit and new_pid not in (0, fault["pid"])


def recovered(fault: dict, client, names: Names, metrics: str) -> bool:
    """Fresh progress from the hit pool (or any, for redis) and a trainer step since."""
    t = fault["at"]
    if not any(r.get("event") == "step" and r["time"] > t for r in read_jsonl(metrics)):
        return False
    if fault["target"] in ("redis", "redis_primary", "cluster_primary"):
        return True
    st = read_statuses(client, names).get(fault["target"], {})
    return int(st.get("pid", 0)) != fault["pid"] and float(st.get("progress", 0)) > t


def apply_fault(
    fault: dict, run_dir: str, client, names: Names, metrics: str, proc: subprocess.Popen
) -> None:
    inject(fault, run_dir, client, names)
    if fault["kind"] == "stop":  # seen stopped right away, before the watchdog kills it
        seen = wait_until(lambda: pid_state(fault["pid"]) == "stopped", timeout_s=2.0)
        fault.setdefault("effect", {})["was_stopped"] = seen
    print(f"t={fault['at']:.0f} {fault['name']} (pid {fault['pid']})")
    fault["effective"] = fault["recovery_s"] = None
    deadline = time.time() + RECOVERY_TIMEOUT_S
    while time.time() < deadline and proc.poll() is None:
        if fault["effective"] is None and took_effect(fault, run_dir, client, names):
            fault["effective"] = round(time.time() - fault["at"], 2)
        if fault["effective"] is not None and recovered(fault, client, names, metrics):
            fault["recovery_s"] = round(time.time() - fault["at"], 2)
            break
        time.sleep(0.2)
    print(f"  took effect after {fault['effective']}s, recovered in {fault['recovery_s']}s")
    print(f"  {fault['effect']}", flush=True)


# ------------------------------------------------------------------ drain and account


def run_shards(run_dir: str, client, names: Names):
    """The run's parts by its config.yaml: the partitions of the cluster ``client`` in
    redis.mode=cluster, else the one part (a Shards)."""
    from pipeline.streams.shards import Shards

    return Shards.of(OmegaConf.load(os.path.join(run_dir, "config.yaml")), client, names)


def drain(run_dir: str, client, names: Names, proc: subprocess.Popen) -> dict:
    """Stop the actors producing and wait until the preprocessors and the trainer have
    taken all they can: every actor says ``draining``, nothing is left in ``rollouts``,
    nothing in ``batches`` is unread, the trainer waits for data with less than a step
    of fresh samples (not in the middle of a step), and the entries left (its
    unfinished step, in its pending list) have not changed for QUIET_S seconds."""
    t0 = time.time()
    client.hset(names.run_marker, DRAIN_FIELD, str(t0))
    shards = run_shards(run_dir, client, names)
    per_step = int(OmegaConf.load(os.path.join(run_dir, "config.yaml")).trainer.samples_per_step)
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    last, since, actors, entries, trainer = None, time.monotonic(), {}, [], {}
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            statuses = read_statuses(client, names)
            entries = in_flight(client, names, shards)["entries"]
        except redis.RedisError:
            time.sleep(0.5)
            continue
        actors = {k: v.get("state") for k, v in statuses.items() if v.get("role") == "actor"}
        trainer = statuses.get("trainer", {})
        now = [(e["stream"], e["shard"], e["id"], e["where"]) for e in entries]
        settled = (
            bool(actors)
            and all(state == "draining" for state in actors.values())
            and all(e[0] == "batches" and e[3] != "unread" for e in now)
            and trainer.get("state") == "waiting for data"
            and int(trainer.get("buffered_samples", 0)) < per_step
        )
        if not settled or now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= QUIET_S:
            return {
                "drained": True,
                "drain_s": round(time.time() - t0, 2),
                "actors": actors,
                "trainer_holds": held_by_trainer(trainer),
            }
        time.sleep(0.5)
    print(
        f"not drained after {time.time() - t0:.0f}s: actors {actors}, trainer "
        f"{trainer.get('state')} holding {held_by_trainer(trainer)}, entries {entries}"
    )
    return {"drained": False, "drain_s": round(time.time() - t0, 2), "actors": actors}


def held_by_trainer(status: dict[str, str]) -> dict[str, int]:
    """The samples the trainer's unfinished step holds, by its own count (status hash)."""
    return {
        "fresh": int(status.get("buffered_samples", 0)),
        "stale": int(status.get("buffered_stale", 0)),
    }


def left_in_flight(
    records: list[dict], flight: dict, samples_per_step: int, trainer: dict[str, str]
) -> dict:
    """The entries still holding a sample that no surviving step trained or dropped, by
    stream, shard, entry id and where (``pending:<consumer>``, ``unread``, ...). After a
    drain that may only be the trainer's unfinished step: batches in its pending list
    whose samples are exactly those the trainer says its step holds (``trainer``: its
    status hash; fresh ones fewer than ``samples_per_step``, plus stale ones the step's
    record would drop); ``ok`` says so."""
    steps = surviving_steps(records)
    done = {sid for st in steps for sid in st.get("sample_ids", []) + st.get("stale_ids", [])}
    left = [e for e in flight.get("entries", []) if not e["ids"] or set(e["ids"]) - done]
    samples = sorted({sid for e in left for sid in e["ids"]} - done)
    only_partial_step = all(
        e["stream"] == "batches" and e["where"].startswith("pending:") and e["ids"] for e in left
    )
    held = held_by_trainer(trainer)
    return {
        "ok": only_partial_step
        and held["fresh"] < samples_per_step
        and len(samples) == held["fresh"] + held["stale"],
        "samples": len(samples),
        "trainer_holds": held,
        "entries": left,
    }


def account_run(run_dir: str, records: list[dict] | None = None) -> dict:
    """The account of a finished run from its own files (``records``: instead of its
    metrics.jsonl, e.g. a deliberately broken copy)."""
    if records is None:
        records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    summary = json.loads(Path(run_dir, "summary.json").read_text())
    if summary.get("redis_unavailable"):  # written from disk: no streams, no dead letters
        raise ValueError(
            f"{run_dir}/summary.json was written without redis ({summary.get('redis_error')}), "
            "so it holds no in-flight entries or dead letters to account with: launch the run "
            "again on this run directory (or start its redis-server) and account that summary"
        )
    cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    flight = summary["in_flight"]
    terms = account(records, flight, summary["dead_letter_entries"], int(cfg.task.group_size))
    terms.update(
        problems=problems(terms),
        in_flight_after_drain=left_in_flight(
            records, flight, int(cfg.trainer.samples_per_step), summary["pools"].get("trainer", {})
        ),
        in_flight_rollouts_groups=len(flight["rollouts_groups"]),
        in_flight_batches_samples=len(flight["batches_samples"]),
        in_flight_batches_ids=flight["batches_samples"],
        trainer_steps=summary["trainer_steps"],
        outcome=summary["outcome"],
        restarts=summary.get("restarts", {}),
        weight_publish_failures=summary.get("weight_publish_failures"),
        weight_versions_unreceived=summary.get("weight_versions_unreceived"),
        reward_errors=summary.get("reward_errors"),
    )
    return terms


def drop_one_trained_id(run_dir: str, result: dict) -> dict:
    """The check must be able to fail: the same account on the run's records with one
    trained id dropped from the trainer's record (from the latest surviving step with a
    sample not in a stream: a step after the last checkpoint has its batches still in
    the stream, for a resume); ``named`` says whether the problems name exactly that id
    as lost."""
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    flight = set(result.get("in_flight_batches_ids", []))
    # the same dicts as in ``records``: a change to one is a change to the records
    candidates = (
        (st, sid) for st in reversed(surviving_steps(records)) for sid in st["sample_ids"]
    )
    step, dropped = next(((st, sid) for st, sid in candidates if sid not in flight), (None, None))
    if dropped is None:
        return {"dropped": None, "problems": [], "named": False}
    step["sample_ids"].remove(dropped)
    said = account_run(run_dir, records)["problems"]
    return {"dropped": dropped, "problems": said, "named": said == [lost_line(dropped)]}


def lost_line(sample_id: str) -> str:
    return next(p for p in problems({"lost_ids": [sample_id]}))


def passed(result: dict) -> bool:
    return (
        not result["problems"]
        and result["groups_produced"] > 0
        and result["groups_trained"] > 0
        and result["drain"]["drained"]
        and result["in_flight_after_drain"]["ok"]
        and result["broken_record_check"]["named"]
        and result["all_effective"]
        and result["all_recovered"]
        and result["outcome"] == "interrupted"
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench faults")
    p.add_argument("--out", default="outputs/bench-faults.json")
    p.add_argument(
        "--schedule",
        default=DEFAULT_SCHEDULE,
        help="comma-separated SECONDS:kill|stop|restart:POOL|redis",
    )
    p.add_argument(
        "--faults",
        default=None,
        help="comma-separated fault names to run from the schedule (e.g. redis_sigkill), "
        "20 s apart; default: the whole schedule",
    )
    p.add_argument(
        "--tail-steps",
        type=int,
        default=10,
        help="trainer steps to wait for after the last fault, then drain and Ctrl-C the run",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra Hydra override for the run (repeatable)",
    )
    p.add_argument("--watchdog-s", type=float, default=15.0)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--timeout-s", type=float, default=900)
    args = p.parse_args(argv)
    args.plan = plan(args.schedule, args.faults)
    for item in args.set:
        if "=" not in item:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. trainer.world_size=2")
    return args


def plan(schedule: str, only: str | None) -> list[tuple[float, str, str]]:
    """The schedule as (seconds, kind, target); ``only``: just the named faults, 20 s apart."""
    items = []
    for item in schedule.split(","):
        parts = item.split(":")
        if len(parts) != 3 or parts[1] not in SIGNALS:
            raise SystemExit(f"--schedule item {item!r}: expected SECONDS:kill|stop|restart:POOL")
        items.append((float(parts[0]), parts[1], parts[2]))
    if only is None:
        return items
    wanted = [n for n in only.split(",") if n]
    known = {f"{t}_{SIGNALS[k]}": (k, t) for _, k, t in items} | EXTRA_FAULTS
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(
            f"--faults {','.join(unknown)}: not in the schedule; known: {sorted(known)}"
        )
    return [(5.0 + 20.0 * i, *known[n]) for i, n in enumerate(wanted)]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    run_dir = os.path.abspath(args.run_dir or tempfile.mkdtemp(prefix="nonstop-faults-"))
    load_start = os.getloadavg()
    check_before_launch(run_dir, args)
    proc = launch(run_dir, args)
    try:
        return run_and_report(run_dir, args, proc, load_start)
    except LauncherExited as e:  # the why is in its message: no traceback above it
        print(e, file=sys.stderr, flush=True)
        return 1
    finally:  # an error, Ctrl-C or SIGTERM (pipeline/bench/__main__.py): nothing left running
        stop_process(proc, signal.SIGINT, args.timeout_s)


def run_and_report(run_dir: str, args, proc: subprocess.Popen, load_start) -> int:
    client = wait_for_redis(run_dir, proc)
    names, metrics = run_names(run_dir), os.path.join(run_dir, "metrics.jsonl")
    if not wait_steps(metrics, 1, 300, proc):
        raise TimeoutError(f"no trainer step within 300 s: {launcher_out(run_dir)}")
    t0, faults = time.time(), []
    for at, kind, target in args.plan:
        while time.time() < t0 + at:
            time.sleep(0.1)
        name = f"{target}_{SIGNALS[kind]}"
        faults.append({"name": name, "at": time.time(), "kind": kind, "target": target})
        apply_fault(faults[-1], run_dir, client, names, metrics, proc)
        check_launcher_alive(proc, run_dir, faults[-1]["name"])
    tail_ok = wait_steps(metrics, args.tail_steps, 300, proc)
    check_launcher_alive(proc, run_dir, f"the {args.tail_steps} steps after the last fault")
    drained = drain(run_dir, client, names, proc)
    print(f"drain: {drained}", flush=True)
    proc.send_signal(signal.SIGINT)  # an operator's Ctrl-C ends the run; its summary follows
    proc.wait(timeout=args.timeout_s)
    print(launcher_out(run_dir, 1500))
    result = account_run(run_dir)
    recovery = [f["recovery_s"] for f in faults]
    result.update(
        device=device_name(),
        date=time.strftime("%Y-%m-%d"),
        run_dir=run_dir,
        overrides=args.set,
        appendfsync=OmegaConf.load(os.path.join(run_dir, "config.yaml")).redis.embedded_appendfsync,
        load_avg_start=[round(x, 2) for x in load_start],
        load_avg_end=[round(x, 2) for x in os.getloadavg()],
        faults_injected=len(faults),
        faults=faults,
        launcher_exit=proc.returncode,
        tail_steps_reached=tail_ok,
        drain=drained,
        all_effective=all(f["effective"] is not None for f in faults),
        all_recovered=all(r is not None for r in recovery),
        max_recovery_s=max((r for r in recovery if r is not None), default=None),
    )
    result["broken_record_check"] = drop_one_trained_id(run_dir, result)
    result["passed"] = passed(result)
    result["samples_left_after_drain"] = result["in_flight_after_drain"]["samples"]
    print_table([{k: result[k] for k in COLUMNS}], COLUMNS)
    for line in result["problems"]:
        print(line)
    write_json(args.out, result)
    return 0 if result["passed"] else 1


COLUMNS = [
    "faults_injected",
    "groups_produced",
    "groups_trained",
    "groups_stale",
    "groups_no_signal",
    "groups_dead_lettered",
    "groups_in_flight_at_end",
    "groups_lost",
    "groups_duplicated",
    "samples_redelivered_stale",
    "samples_left_after_drain",
    "max_recovery_s",
    "trainer_steps",
]
