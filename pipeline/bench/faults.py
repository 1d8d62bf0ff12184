"""``python -m pipeline.bench faults --out FILE``: the CPU pipeline on the tiny
model under a schedule of faults, and an account of every group.

Faults (seconds after the first trainer step): SIGKILL the actor, the
preprocessor and the trainer, SIGSTOP the preprocessor (the launcher's
watchdog must notice and restart it), and restart the embedded redis-server.
Afterwards ``metrics.jsonl`` and ``summary.json`` give, per group: produced by
an actor, packed into ``batches`` by a preprocessor, trained (in a step that
survived: steps undone by a trainer restart are discarded), rejected as stale,
or still in flight when the run ended. ``groups_lost`` counts groups that
reached ``batches`` and are none of those; ``groups_duplicated`` counts groups
with a sample trained twice.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from pipeline.bench.common import device_name, print_table, write_json
from pipeline.streams import Names, connect
from pipeline.telemetry import read_jsonl, read_statuses, surviving_steps

DEFAULT_SCHEDULE = (
    "5:kill:actor-0,15:kill:preprocessor-0,25:kill:trainer,40:stop:preprocessor-0,60:restart:redis"
)


def launch(run_dir: str, args) -> subprocess.Popen:
    overrides = [
        "+exp=tiny",
        f"run_dir={run_dir}",
        "trainer.max_steps=100000",
        "trainer.checkpoint_every=2",
        f"launch.watchdog_s={args.watchdog_s}",
        "launch.max_restarts=5",
        "redis.claim_idle_s=5",
        "trainer.transfer_timeout_s=10",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.launch", *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_redis(run_dir: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            port = Path(run_dir, "redis", "port").read_text().strip()
            auth = Path(run_dir, "redis", "auth").read_text().strip()
            return connect(f"redis://:{auth}@127.0.0.1:{port}/0", attempts=3)
        except (OSError, ConnectionError):
            time.sleep(0.2)
    raise TimeoutError("the launcher never started its redis-server")


def first_step_time(metrics: str, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        steps = [r for r in read_jsonl(metrics) if r.get("event") == "step"]
        if steps:
            return time.time()
        time.sleep(0.2)
    raise TimeoutError("no trainer step within the time limit")


def wait_steps(metrics: str, n: int, timeout_s: float) -> None:
    start = sum(r.get("event") == "step" for r in read_jsonl(metrics))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(r.get("event") == "step" for r in read_jsonl(metrics)) >= start + n:
            return
        time.sleep(0.5)


def inject(kind: str, target: str, run_dir: str, client, names: Names) -> str | None:
    """Apply one fault; return the pid it hit (None for redis)."""
    if target == "redis":
        pid = int(Path(run_dir, "redis", "redis.pid").read_text())
        os.kill(pid, signal.SIGTERM)  # a restart; the launcher brings it back from its AOF
        return None
    pid = read_statuses(client, names)[target]["pid"]
    os.kill(int(pid), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    return pid


def recovered(client, names: Names, metrics: str, fault: dict) -> bool:
    """The hit pool runs again (new pid, fresh progress) and the trainer has stepped since."""
    t = fault["at"]
    stepped = any(r.get("event") == "step" and r["time"] > t for r in read_jsonl(metrics))
    if fault["target"] == "redis":
        return stepped
    st = read_statuses(client, names).get(fault["target"], {})
    fresh = st.get("pid") != fault["pid"] and float(st.get("progress", 0)) > t
    return fresh and stepped


def account(run_dir: str) -> dict:
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    summary = json.loads(Path(run_dir, "summary.json").read_text())
    produced = {r["group"] for r in records if r.get("event") == "group"}
    batched = {g for r in records if r.get("event") == "batched" for g in r["groups"]}
    steps = surviving_steps(records)  # steps a trainer restart undid do not count
    trained = Counter(sid for s in steps for sid in s["sample_ids"])
    stale = {sid.rsplit("/", 1)[0] for s in steps for sid in s.get("stale_ids", [])}
    trained_groups = {sid.rsplit("/", 1)[0] for sid in trained}
    duplicated = {sid.rsplit("/", 1)[0] for sid, n in trained.items() if n > 1}
    in_flight = set(summary.get("in_flight_group_ids", []))
    lost = batched - trained_groups - stale - in_flight
    return {
        "groups_produced": len(produced),
        "groups_batched": len(batched),
        "groups_trained": len(trained_groups),
        "groups_stale": len(stale - trained_groups),
        "groups_in_flight_at_end": len(in_flight - trained_groups),
        "groups_lost": len(lost),
        "groups_duplicated": len(duplicated),
        "trained_not_produced": len(trained_groups - produced),
        "trainer_steps": summary["trainer_steps"],
        "outcome": summary["outcome"],
        "restarts": summary.get("restarts", {}),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench faults")
    p.add_argument("--out", default="outputs/bench-faults.json")
    p.add_argument(
        "--schedule",
        default=DEFAULT_SCHEDULE,
        help="comma-separated SECONDS:kill|stop|restart:POOL|redis",
    )
    p.add_argument(
        "--tail-steps",
        type=int,
        default=10,
        help="trainer steps to wait for after the last fault, then Ctrl-C the run",
    )
    p.add_argument("--watchdog-s", type=float, default=15.0)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--timeout-s", type=float, default=900)
    args = p.parse_args(argv)
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="nonstop-faults-")
    proc = launch(run_dir, args)
    client = wait_for_redis(run_dir)
    names = Names("nonstop", "tiny")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    t0 = first_step_time(metrics, 300)
    faults = []
    for item in args.schedule.split(","):
        at, kind, target = item.split(":")
        while time.time() < t0 + float(at):
            time.sleep(0.1)
        fault = {"at": time.time(), "kind": kind, "target": target}
        fault["pid"] = inject(kind, target, run_dir, client, names)
        print(f"t+{float(at):.0f}s {kind} {target} (pid {fault['pid']})", flush=True)
        faults.append(fault)
        deadline = time.time() + 180
        while time.time() < deadline and not recovered(client, names, metrics, fault):
            time.sleep(0.2)
        fault["recovery_s"] = (
            round(time.time() - fault["at"], 2) if time.time() < deadline else None
        )
        print(f"  recovered in {fault['recovery_s']}s", flush=True)
    wait_steps(metrics, args.tail_steps, timeout_s=300)
    proc.send_signal(signal.SIGINT)  # an operator's Ctrl-C ends the run; its summary follows
    out, _ = proc.communicate(timeout=args.timeout_s)
    print(out[-1500:])
    result = account(run_dir)
    recovery = [f["recovery_s"] for f in faults]
    result.update(
        device=device_name(),
        date=time.strftime("%Y-%m-%d"),
        run_dir=run_dir,
        faults_injected=len(faults),
        faults=faults,
        launcher_exit=proc.returncode,
        all_recovered=all(r is not None for r in recovery),
        max_recovery_s=max((r for r in recovery if r is not None), default=None),
    )
    print_table([{k: result[k] for k in COLUMNS}], COLUMNS)
    write_json(args.out, result)
    ok = (
        result["groups_lost"] == 0
        and result["groups_duplicated"] == 0
        and result["all_recovered"]
        and result["outcome"] == "interrupted"
    )
    return 0 if ok else 1


COLUMNS = [
    "faults_injected",
    "groups_produced",
    "groups_batched",
    "groups_trained",
    "groups_lost",
    "groups_duplicated",
    "max_recovery_s",
    "trainer_steps",
]
