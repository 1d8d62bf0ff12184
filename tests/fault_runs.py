"""Running the faults bench from tests and checking its account (tests/test_faults.py,
tests/test_redis_ha.py), and a proxy that drops one reply (tests/test_durable.py)."""

import contextlib
import copy
import json
import os
import socket
import subprocess
import sys
import threading

from pipeline.bench.faults import account_run, passed
from pipeline.telemetry import read_jsonl, surviving_steps
from tests.launching import tiny_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_fault_took_effect(fault: dict) -> None:
    effect = fault["effect"]
    assert fault["effective"] is not None, fault
    assert effect["old_pid_state"] in ("gone", "zombie"), fault  # the hit process died
    assert effect["new_pid"] not in (None, 0, fault["pid"]), fault  # and another came back
    if fault["kind"] == "stop":
        assert effect["was_stopped"], fault  # SIGSTOP held it before the watchdog killed it
    if fault["target"] == "redis":
        assert effect["new_run_id"] != fault["run_id"], fault  # a new server process


def run_faults_bench(tmp_path, *extra: str):
    out, run_dir = tmp_path / "faults.json", tmp_path / "run"
    env = dict(os.environ, NONSTOP_CACHE=tiny_cache(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.bench", "faults", "--out", str(out)]
        + ["--run-dir", str(run_dir), "--tail-steps", "5", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for fault in result["faults"]:
        check_fault_took_effect(fault)
    assert result["all_recovered"], result["faults"]
    return proc, result, run_dir


def check_account(result: dict, run_dir) -> dict:
    """The account, recomputed here from the run's own files; then the same check on
    those records with one trained id dropped from the trainer's record must fail."""
    records = read_jsonl(str(run_dir / "metrics.jsonl"))
    terms = account_run(str(run_dir))
    produced = {r["group"] for r in records if r.get("event") == "group"}
    assert terms["groups_produced"] == len(produced) == result["groups_produced"] > 0
    # named in the failure: which groups, and what is wrong with each
    assert terms["problems"] == [] == result["problems"], (
        terms["problems"][:10],
        result["problems"][:10],
    )
    assert terms["groups_trained"] > 0 and terms["groups_lost"] == 0
    assert result["drain"]["drained"], result["drain"]
    left = terms["in_flight_after_drain"]
    assert left["ok"], left  # at most the trainer's unfinished step, in its pending list
    assert all(e["where"] == "pending:trainer" for e in left["entries"]), left

    # the trainer's record loses one trained id: the check names it as lost
    flight = set(json.loads((run_dir / "summary.json").read_text())["in_flight"]["batches_samples"])
    broken = copy.deepcopy(records)
    # the latest step with a sample no longer in a stream (a step after the last
    # checkpoint has its batches still in the stream); the same dicts as in ``broken``
    step, dropped = next(
        (st, sid)
        for st in reversed(surviving_steps(broken))
        for sid in st["sample_ids"]
        if sid not in flight
    )
    step["sample_ids"].remove(dropped)
    bad = account_run(str(run_dir), broken)
    assert bad["problems"] == [
        f"lost: {dropped} (published by an actor; not trained, dropped, dead-lettered or in a "
        "stream)"
    ]
    assert passed(result) and not passed(result | bad)
    assert result["broken_record_check"]["named"], result["broken_record_check"]
    return terms


class ReplyDropper:
    """A TCP proxy to a real redis-server that, when armed, lets one command through
    and closes the client's connection instead of passing the reply back: what a
    client sees when redis-server dies between applying a command and replying.
    ``hold``: instead, every reply from then on is swallowed and the connection kept
    open (the client waits for a reply that never comes, e.g. until it is killed)."""

    def __init__(self, port: int, hold: bool = False):
        self.target, self.armed, self.hold = port, threading.Event(), hold
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src, dst, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if replies and self.armed.is_set():
                    if self.hold:
                        continue  # applied; the reply held back, the connection open
                    self.armed.clear()
                    break  # the command was applied; its reply never arrives
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # shutdown wakes the other direction's blocked recv
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
