"""What both loads of the scale bench share: the samples they send (``sample_pool``), the
probes of CPU and scheduling of a process (``/proc``), pinning to cores."""

from __future__ import annotations

import json
import os

VOCAB = 151936  # Qwen2.5 vocabulary: token ids of the 1.5B shape
SATURATED_IDLE = 0.05  # a redis-server main thread idle less than this share is saturated


def sample_pool(rng, n: int, group_size: int, tokens: int) -> list[list]:
    """``n`` groups' worth of samples of real shape, reused (fresh group ids) on send."""
    from pipeline.messages import Sample, pack_f32, pack_i32, rle_encode

    out = []
    for _ in range(n):
        samples = []
        for i in range(group_size):
            t = int(rng.integers(tokens // 2, tokens * 3 // 2 + 1))
            split = int(rng.integers(t // 2, t))  # a weight update landed mid-sequence
            samples.append(
                Sample(
                    index=i,
                    completion_ids=pack_i32(rng.integers(0, VOCAB, t)),
                    logprobs=pack_f32(-rng.exponential(1.0, t)),
                    versions=rle_encode([0] * split + [1] * (t - split)),
                    reward=float(i % 2),  # group-relative signal: never dropped
                    finished=True,
                )
            )
        out.append(samples)
    return out


def cpu_seconds(pid: int) -> float:
    """CPU seconds of a live process, all its threads (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_cpu_seconds(pid: int) -> float:
    """CPU seconds of a live redis-server: every thread's time on a CPU (schedstat, ns)
    and the children it waited for (its AOF rewrites; /proc/PID/stat, clock ticks)."""
    total = 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone, or a thread ended between the listing and the read
        return total
    return total + (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def main_thread_sched(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of a process's main thread
    (/proc/PID/task/PID/schedstat); Redis executes commands on that thread."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        run_ns, wait_ns, _ = f.read().split()
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


def cpu_busy_each() -> list[float]:
    """Busy CPU seconds since boot per core (/proc/stat cpuN lines)."""
    out = []
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                v = [int(x) for x in line.split()[1:9]]
                out.append((v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK"))
    return out


def parse_cpus(text: str | None) -> set[int] | None:
    if not text:
        return None
    try:
        cpus = {int(x) for x in text.split(",")}
    except ValueError:
        raise ValueError(f"CPU list {text!r}: give core ids like 0 or 0,1") from None
    if not cpus <= set(range(os.cpu_count() or 1)):
        raise ValueError(f"CPU list {text!r}: this machine has cores 0-{os.cpu_count() - 1}")
    return cpus


def pin(pid: int, cpus: set[int] | None) -> None:
    """Every thread of ``pid`` onto ``cpus`` (taskset -a)."""
    if cpus:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cpus)


def _level_of(path: str, k: int) -> dict | None:
    try:
        with open(path) as f:
            levels = json.load(f)
    except (OSError, ValueError):
        return None
    return levels[k] if len(levels) > k else None
