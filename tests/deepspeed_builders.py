"""Running the trainer backends on several CPU ranks over gloo (tests/trainer_ranks.py is
one rank), shared by tests/test_deepspeed.py and tests/test_routing.py; no test lives
here. The tolerances are explained in tests/test_deepspeed.py's docstring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from pipeline.redisd.server import free_port
from tests.launching import tiny_cache

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4
WEIGHT_ATOL = 1e-4  # per element; why: tests/test_deepspeed.py's docstring


def start_ranks(out, model, backend, stage, world, *extra, tmp):
    """Start ``world`` ranks of tests/trainer_ranks.py; returns the processes."""
    port = str(free_port("127.0.0.1"))
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
            NONSTOP_CACHE=tiny_cache(Path(tmp) / "cache"),
            HF_HUB_OFFLINE="1",
        )
        cmd = [sys.executable, "-W", "ignore::FutureWarning", "-m", "tests.trainer_ranks"]
        cmd += [str(out), model, backend, str(stage), str(STEPS), *extra]
        log = open(Path(tmp) / f"{Path(out).stem}-rank{rank}.log", "w")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log))
    return procs


def run_ranks(out, model, backend, stage, world, *extra, tmp, timeout=240) -> dict:
    for attempt in (1, 2):
        procs = start_ranks(out, model, backend, stage, world, *extra, tmp=tmp)
        codes = [p.wait(timeout=timeout) for p in procs]
        logs = [(Path(tmp) / f"{Path(out).stem}-rank{r}.log").read_text() for r in range(world)]
        # the rendezvous port was free when chosen; another process may take it first
        if any(codes) and attempt == 1 and any("ddress already in use" in t for t in logs):
            continue
        assert not any(codes), f"exit codes {codes}\n" + "\n".join(t[-2500:] for t in logs)
        return json.loads(Path(out).read_text())
    raise AssertionError("unreachable")


def wait_for(path: Path, procs, timeout=240) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert all(p.poll() is None for p in procs), "a rank exited early"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return json.loads(path.read_text())


def assert_weights_match(got: str, reference: str, initial: str) -> None:
    """``got`` (a safetensors file) holds every parameter of ``reference`` under the same
    names, shapes and dtypes, each within WEIGHT_ATOL of it; and training moved every
    parameter of ``reference`` from ``initial`` (the model folder) by over 10x that
    tolerance, so the comparison can tell trained weights from untrained ones."""
    from safetensors.torch import load_file

    from pipeline.models import load_model

    a, b = load_file(got), load_file(reference)
    start = {n: p.detach() for n, p in load_model(initial)[0].named_parameters()}
    assert sorted(a) == sorted(b) == sorted(start), (sorted(a), sorted(b))
    for n in sorted(a):
        assert a[n].shape == b[n].shape and a[n].dtype == b[n].dtype, n
        moved = float((b[n] - start[n]).abs().max())
        assert moved > 10 * WEIGHT_ATOL, f"{n}: training moved it only {moved:.2e}"
        torch.testing.assert_close(
            a[n], b[n], rtol=0.0, atol=WEIGHT_ATOL, msg=lambda m, n=n: f"{n}: {m}"
        )
