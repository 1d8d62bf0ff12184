"""CPU time per pool on this machine, read from /proc by the launcher.

::

    reads   /proc/<pid>/stat of every process whose process group is a pool's (the
            launcher starts each pool in a session of its own, so its group id is the
            pool's pid; vLLM's engine core and a tool's sandbox are in it too)
    writes  nothing itself: the supervisor writes its ``cpu`` records to metrics.jsonl,
            the progress line shows the recent shares, summary.json the run's
    blocks  never (one pass over /proc, a few ms)

A process's CPU seconds (user + system) are kept from the last time it was seen: one
that exits between two samples loses at most one interval's CPU. A share is CPU
seconds per second of wall time, in cores: 1.0 is one core busy all the time.
"""

from __future__ import annotations

import os
import time

TICK = os.sysconf("SC_CLK_TCK")


def read_stat(pid: str) -> tuple[int, int, float] | None:
    """(process group, start time in ticks, CPU seconds) of ``pid``, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # after "pid (comm) ": state is field 0
    pgrp, utime, stime, start = int(fields[2]), int(fields[11]), int(fields[12]), int(fields[19])
    return pgrp, start, (utime + stime) / TICK


def cores() -> int:
    """The CPUs this process may run on (its affinity), as the pools may."""
    return len(os.sched_getaffinity(0))


class CpuMeter:
    """Cumulative CPU seconds per pool; ``sample`` with the pools' group ids."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.seen: dict[tuple[int, int], tuple[str, float]] = {}  # (pid, start) -> pool
        self.last: tuple[float, dict[str, float]] | None = None
        self.recent: dict[str, float] = {}  # pool -> share over the last interval

    def sample(self, groups: dict[str, int]) -> None:
        """One pass over /proc; ``groups``: pool name -> its process group id."""
        pool_of = {pgid: name for name, pgid in groups.items()}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            stat = read_stat(entry)
            if stat is not None and stat[0] in pool_of:
                self.seen[(int(entry), stat[1])] = (pool_of[stat[0]], stat[2])
        now, totals = time.monotonic(), self.totals()
        if self.last is not None and now - self.last[0] >= 1.0:
            dt, before = now - self.last[0], self.last[1]
            self.recent = {p: max(s - before.get(p, 0.0), 0.0) / dt for p, s in totals.items()}
        if self.last is None or now - self.last[0] >= 1.0:
            self.last = (now, totals)

    def totals(self) -> dict[str, float]:
        """CPU seconds per pool since the meter started (every process it saw)."""
        out: dict[str, float] = {}
        for pool, cpu_s in self.seen.values():
            out[pool] = out.get(pool, 0.0) + cpu_s
        return out

    def record(self) -> dict:
        """The ``cpu`` record: per pool CPU seconds and share of the run so far, the
        wall seconds and the cores the pools may use."""
        wall = max(time.monotonic() - self.t0, 1e-9)
        totals = self.totals()
        return {
            "wall_s": round(wall, 1),
            "cores": cores(),
            "cpu_s": {p: round(s, 1) for p, s in sorted(totals.items())},
            "share": {p: round(s / wall, 3) for p, s in sorted(totals.items())},
        }


def shares_text(shares: dict[str, float], n_cores: int) -> str:
    """``1.84/2 (actor-0 0.95, trainer 0.80, ...)``: cores busy of the machine's, then
    each pool's, busiest first; "-" without a share."""
    if not shares:
        return "-"
    busiest = sorted(shares.items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{p} {s:.2f}" for p, s in busiest)
    return f"{sum(shares.values()):.2f}/{n_cores} ({parts})"
