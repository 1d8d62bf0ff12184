"""Shared by the benchmarks: percentiles, the device label, the table printer, the JSON
writer, and the machine's load over an interval (LoadProbe)."""

from __future__ import annotations

import json
import os
import platform
import resource
import signal
import subprocess
import time

import numpy as np
import torch


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


def device_name(device: str | torch.device = "cpu") -> str:
    """Where the measured work ran: the GPU's name for a CUDA device, else the CPU
    (a CPU measurement on a machine that also has a GPU says cpu)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device.index or 0)
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def busy_cpu_s() -> float:
    """CPU seconds every process on the machine has used since boot, all cores together
    (/proc/stat: user, nice, system, irq, softirq, steal; not idle or iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    out = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        out += r.ru_utime + r.ru_stime
    return out


class LoadProbe:
    """The machine's load over an interval: the 1/5/15-min load averages at both ends and
    the CPU the rest of the machine used (all processes, /proc/stat, less this process
    and its waited-for children, plus ``own_extra_s`` for own processes not waited for
    yet), in cores (CPU seconds per second of wall)."""

    def __init__(self) -> None:
        self.t0, self.load0 = time.monotonic(), os.getloadavg()
        self.busy0, self.own0 = busy_cpu_s(), own_cpu_s()

    def end(self, own_extra_s: float = 0.0) -> dict:
        wall = max(time.monotonic() - self.t0, 1e-9)
        busy = busy_cpu_s() - self.busy0
        own = own_cpu_s() - self.own0 + own_extra_s
        return {
            "load_avg_before": [round(x, 2) for x in self.load0],
            "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            "probe_wall_s": round(wall, 1),
            "own_cpu_cores": round(own / wall, 2),
            "other_cpu_cores": round(max(busy - own, 0.0) / wall, 2),
            "cores": os.cpu_count(),
        }


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP end a bench as Ctrl-C does: they raise SystemExit in the main
    thread, so every ``finally`` that stops what the bench started runs (the default
    action would kill the bench at once and orphan its launcher and pools). A second
    signal while it stops is reported and ignored."""

    def stopping(signum, _frame):
        print(f"bench: signal {signum} again; still stopping what it started", flush=True)

    def first(signum, _frame):
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, stopping)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, first)


def stop_process(proc, sig: int = signal.SIGINT, grace_s: float = 120.0) -> None:
    """Stop a process a bench started, if it still runs: ``sig`` (a launcher stops its
    pools and its Redis on SIGINT or SIGTERM and writes its summary), up to ``grace_s``
    for it to exit, then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        print(f"bench: pid {proc.pid} did not stop in {grace_s:g} s; killing it", flush=True)
        proc.kill()
        proc.wait()


def processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, user + system ticks, name) of every process now."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        out[int(pid)] = (int(fields[1]), int(fields[11]) + int(fields[12]), name)
    return out


def run_result_child(
    cmd: list[str], log_path: str, what: str, timeout_s: float
) -> tuple[dict, str]:
    """Run a bench's child process (``cmd``) with its output in ``log_path``; return the
    JSON of its last ``RESULT {json}`` line and the whole log. A child that runs past
    ``timeout_s``, fails or prints no result ends the bench naming ``what`` and the log;
    it is stopped either way."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{what} did not finish in {timeout_s:g} s: {log_path}") from None
        finally:
            stop_process(proc, grace_s=30)
    with open(log_path) as f:
        text = f.read()
    found = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        tail = "\n".join(text.splitlines()[-15:])
        raise SystemExit(f"{what} failed (exit {proc.returncode}); {log_path}:\n{tail}")
    return json.loads(found[-1][len("RESULT ") :]), text
