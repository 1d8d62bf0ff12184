"""What vLLM's polling queue readers take from a trainer on the same cores:
``python -m pipeline.bench queue_nap``.

Each measurement is a fresh process (``--child NAP``), as an actor's start is: it builds
the project's VLLMEngine (actor/engines/vllm/client.py) with
``actor.vllm.queue_nap_us=NAP`` (0: vLLM's own ``sched_yield`` between polls; the
default on the CPU build naps 200 us: actor/engines/vllm/worker/queue_nap.py) and runs,
beside it, a *burner*: a process with one torch thread multiplying 512x512 matrices, the
shape of the trainer's work. It measures

    burner_alone    the burner's matmuls/s before the engine generates
    burner_share    its rate while the engine generates, over its rate alone (1.0: the
                    engine took nothing from it)
    gen_s           seconds per generate call of ``--prompts`` x ``--max-tokens`` tokens
                    (EOS ignored), while the burner runs; ``--pause-s`` between calls,
                    as an actor held back by back-pressure idles between batches
    core_cpu, worker_cpu
                    cores used by vLLM's engine-core and worker processes while it
                    generated (CPU seconds over the wall)

Naps alternate, the order turned each repeat; medians with min-max per nap.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

from actor.orphans import ENV as DIE_WITH_PARENT
from pipeline.bench.common import (
    LoadProbe,
    device_name,
    print_table,
    processes,
    run_result_child,
    write_json,
)

RATE_EVERY = 50  # the burner notes (time, matmuls done) every this many matmuls


def burner(stop, out) -> None:
    """One torch thread multiplying matrices until ``stop``; sends its (time, count) marks."""
    import torch

    torch.set_num_threads(1)
    a, n, marks = torch.randn(512, 512), 0, []
    while not stop.is_set():
        a @ a
        n += 1
        if n % RATE_EVERY == 0:
            marks.append((time.time(), n))
    out.put(marks)


def rate(marks: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Matmuls per second between t0 and t1 from the burner's marks."""
    sel = [m for m in marks if t0 <= m[0] <= t1]
    if len(sel) < 2:
        why = f"the burner left {len(sel)} marks in {t1 - t0:.1f} s (it starts in a new process)"
        raise SystemExit(f"{why}: give it more time alone (--alone-s) or more calls (--calls)")
    return (sel[-1][1] - sel[0][1]) / (sel[-1][0] - sel[0][0])


def engine_processes(core: int | None = None) -> dict[str, int]:
    """The engine-core and worker pids of one vLLM engine under this process, ``core``'s
    where given, else the only one: the worker is the engine core's child
    (``{"VLLM::EngineCor": pid, "VLLM::Worker": pid}``, the kernel's 15-character
    names). Another engine's processes in the same process tree, one still exiting, are
    not counted."""
    procs = processes()

    def mine(pid: int) -> bool:
        while pid > 1:
            pid = procs.get(pid, (0,))[0]
            if pid == os.getpid():
                return True
        return False

    pairs = [
        (parent, w)
        for w, (parent, _, name) in procs.items()
        if name == "VLLM::Worker" and procs.get(parent, (0, 0, ""))[2] == "VLLM::EngineCor"
        if (parent == core if core is not None else mine(w))
    ]
    if len(pairs) != 1:
        which = f"engine core {core}" if core is not None else f"pid {os.getpid()}"
        raise RuntimeError(f"{len(pairs)} vLLM engine cores with a worker under {which}")
    core, worker = pairs[0]
    return {"VLLM::EngineCor": core, "VLLM::Worker": worker}


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(args) -> None:
    """One engine with ``--child`` as its nap, the burner beside it: one RESULT line."""
    os.environ.setdefault(DIE_WITH_PARENT, "1")  # its vLLM processes die with it
    from actor.engines.vllm.client import VLLMEngine
    from pipeline.config import VLLMConfig
    from pipeline.models import materialize_model

    settings = VLLMConfig(
        enforce_eager=True, max_model_len=512, cpu_kv_cache_gib=1.5, queue_nap_us=args.child
    )
    engine = VLLMEngine(
        materialize_model(args.model), None, temperature=1.0, top_p=1.0, top_k=0,
        settings=settings, dtype="float32", seed=0, update_mode="lock",
        transfer_timeout_s=60.0,
    )  # fmt: skip
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    proc = None
    try:
        prompts = [[1, *range(100 + i, 140 + i)] for i in range(args.prompts)]
        engine.generate(prompts, args.max_tokens)  # untimed: first-call caches
        procs = {pid: name for name, pid in engine_processes().items()}
        proc = ctx.Process(target=burner, args=(stop, out))
        proc.start()
        time.sleep(args.alone_s)
        before = {n: cpu_s(p) for p, n in procs.items()}
        t0, calls = time.time(), []
        for _ in range(args.calls):
            t = time.time()
            engine.generate(prompts, args.max_tokens)
            calls.append(time.time() - t)
            time.sleep(args.pause_s)
        t1 = time.time()
        used = {n: (cpu_s(p) - before[n]) / (t1 - t0) for p, n in procs.items()}
        stop.set()
        marks = out.get(timeout=60)
    finally:
        stop.set()
        if proc is not None:
            proc.join(30)
        engine.close()
    alone = rate(marks, marks[0][0] + 1.0, t0 - 0.5)
    print("RESULT " + json.dumps({
        "burner_alone": alone, "burner_share": rate(marks, t0, t1) / alone,
        "gen_s": statistics.median(calls), "calls": calls,
        "core_cpu": used.get("VLLM::EngineCor"), "worker_cpu": used.get("VLLM::Worker"),
    }))  # fmt: skip


def run_child(args, nap: int, log_path: str) -> dict:
    cmd = [sys.executable, "-m", "pipeline.bench.queue_nap", "--child", str(nap)]
    cmd += ["--model", args.model, "--prompts", str(args.prompts), "--calls", str(args.calls)]
    cmd += ["--max-tokens", str(args.max_tokens), "--alone-s", str(args.alone_s)]
    cmd += ["--pause-s", str(args.pause_s)]
    probe = LoadProbe()
    out, _ = run_result_child(cmd, log_path, f"nap {nap}", args.child_timeout_s)
    out["load"] = probe.end()
    return out


def summarize(runs: list[dict], naps: list[int]) -> list[dict]:
    rows = []
    for nap in naps:
        mine = [r for r in runs if r["nap_us"] == nap]
        row: dict = {"nap_us": nap, "runs": len(mine)}
        for key in ("burner_share", "gen_s", "core_cpu", "worker_cpu"):
            vals = [r[key] for r in mine if r[key] is not None]
            row[key] = statistics.median(vals) if vals else None
            row[f"{key}_range"] = f"{min(vals):.3f}-{max(vals):.3f}" if vals else "-"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench queue_nap")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--naps", default="0,200", help="microseconds, comma-separated (0: vLLM's)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16, help="per call (+exp=math: 16 in flight)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--calls", type=int, default=3, help="timed generate calls per start")
    p.add_argument("--alone-s", type=float, default=8.0, help="the burner alone, first")
    p.add_argument("--pause-s", type=float, default=1.0, help="idle between two calls")
    p.add_argument("--child-timeout-s", type=float, default=600.0)
    day = datetime.date.today().isoformat()
    p.add_argument("--out", default=f"bench/results/queue-nap-cpu-{day}.json")
    args = p.parse_args(argv)
    if args.child is not None:
        child(args)
        return 0
    try:
        naps = [int(n) for n in args.naps.split(",") if n]
    except ValueError:
        p.error(f"--naps {args.naps!r}: whole microseconds, comma-separated (e.g. 0,200)")
    if not naps or min(naps) < 0:
        p.error(f"--naps {args.naps!r}: whole microseconds >= 0, comma-separated")
    runs = []
    with tempfile.TemporaryDirectory(prefix="queue-nap-") as logs:
        for r in range(args.repeats):
            for nap in naps[r % len(naps) :] + naps[: r % len(naps)]:
                out = run_child(args, nap, os.path.join(logs, f"{nap}-{r}.log"))
                out.update(nap_us=nap, repeat=r)
                runs.append(out)
                print(
                    f"repeat {r + 1}/{args.repeats} nap {nap} us: burner kept "
                    f"{out['burner_share']:.0%} of its rate, generate {out['gen_s']:.2f} s, "
                    f"engine core {out['core_cpu']:.2f} cores, worker {out['worker_cpu']:.2f}",
                    flush=True,
                )
    rows = summarize(runs, naps)
    print_table(rows, ["nap_us", "runs", "burner_share", "burner_share_range", "gen_s",
                       "gen_s_range", "core_cpu", "core_cpu_range", "worker_cpu",
                       "worker_cpu_range"])  # fmt: skip
    write_json(args.out, {
        "bench": "queue_nap", "date": day, "device": device_name(),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "rows": rows, "runs": runs,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
