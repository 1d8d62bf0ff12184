"""One TP rank of a fake vLLM worker with the real extension, for tests/test_vllm_tp.py.

``python -m tests.tp_rank OUT.json`` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
set. Every rank gets the same calls in the same order, as vLLM's broadcast queue
delivers them (execute_model / sample_tokens / collective_rpc), holds its shard of a
tiny Llama's vLLM-layout weights, and writes what it saw to OUT.json (rank-suffixed).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from actor.engines.vllm.weight_updates import relay_buckets
from actor.engines.vllm.worker.extension import NonstopWorkerExtension
from pipeline.messages import encode
from tests.vllm_builders import FakeVllmModel, announcement, hf_model, hf_state, sched, shard


class Worker(NonstopWorkerExtension):
    """vLLM's Worker as the extension sees it, on one TP rank."""

    def __init__(self, model: FakeVllmModel, rank: int, size: int):
        self.model, self.rank = model, rank
        self.parallel_config = SimpleNamespace(tensor_parallel_size=size, pipeline_parallel_size=1)

    def get_model(self):
        return self.model

    def execute_model(self, scheduler_output):
        return None  # sampling follows

    def sample_tokens(self, grammar_output):
        return None


class FailingSource:
    """In-memory buckets whose bucket ``fail_at`` cannot be received."""

    def __init__(self, buckets, fail_at: int):
        self.buckets, self.fail_at = buckets, fail_at

    def fetch(self, index: int, out: torch.Tensor, deadline: float) -> None:
        if index == self.fail_at:
            raise ConnectionError(f"injected: bucket {index} lost on the way")
        out.copy_(self.buckets[index])


def wait_idle(worker, deadline_s: float = 30.0) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        status = worker.nonstop_poll([], False)
        if status["busy"] == 0:
            return status
        assert time.monotonic() < deadline, "the receiver thread did not finish"
        time.sleep(0.01)


def live_equals(worker, expected: dict[str, torch.Tensor]) -> bool:
    live = dict(worker.model.named_parameters())
    return all(torch.equal(live[n], t) for n, t in expected.items())


def step(worker, rid: str, first: bool) -> None:
    so = (
        sched(new=[(rid, 4, 0)], scheduled={rid: 4})
        if first
        else sched(cached=[(rid, 4)], scheduled={rid: 1})
    )
    worker.execute_model(so)
    worker.sample_tokens(None)


def main() -> None:
    out = sys.argv[1]
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=size)
    states = {v: hf_state(hf_model(v)) for v in (0, 1, 2, 3)}
    worker = Worker(FakeVllmModel(shard(states[0], rank, size)), rank, size)
    worker.nonstop_install(lock_timeout_s=5.0, transfer_timeout_s=20.0)
    seen: dict = {"rank": rank}

    # every broadcast on the weights group, by the thread that made it: the engine's
    # (this process's main thread, as vLLM's engine thread runs execute_model and RPCs)
    seen["broadcast_threads"] = threads = []
    broadcast = dist.broadcast

    def recording(tensor, src, group=None, **kw):
        if group is not None and group is worker._nonstop_group:
            threads.append(threading.current_thread().name)
        return broadcast(tensor, src, group=group, **kw)

    dist.broadcast = recording

    def stage(version: int, factory: str = "pipeline.transfer:TensorSource", **kw) -> dict:
        ann, flat = announcement(version, states[version])
        spec = {"factory": factory, "buckets": flat, **kw}  # every rank gets the same RPC
        failed = worker.nonstop_poll([], False)["failed"]
        worker.nonstop_update(encode(ann), spec, False)
        # the client's loop (VLLMWeights._stage_rpc), here on this rank's own polls: each
        # rank is ready for a bucket before its broadcast is asked for
        with contextlib.suppress(RuntimeError):  # a failed version: the poll below says
            relay_buckets(
                ann,
                lambda: worker.nonstop_poll([], False),
                lambda method, *args: getattr(worker, method)(*args),
                failed,
                time.monotonic() + 30,
            )
        return wait_idle(worker)

    # (a) stage version 1: rank 0 reads the buckets, every rank gets its shard
    status = stage(1)
    seen["staged_1"] = status["staged_version"]
    # (b) the swap asked for mid-step (between execute_model and sample_tokens) is armed
    # and applied at the next execute_model entry, on every rank alike
    rid = "req-0-abcdefgh"
    step(worker, rid, first=True)
    worker.execute_model(sched(cached=[(rid, 4)], scheduled={rid: 1}))  # step 2 begins
    worker.nonstop_swap(1)
    seen["live_mid_step"] = worker._nonstop.live_version  # still 0: the step goes on
    worker.sample_tokens(None)
    step(worker, rid, first=False)  # step 3: runs version 1
    seen["live_after"] = worker._nonstop.live_version
    seen["weights_1"] = live_equals(worker, shard(states[1], rank, size))
    seen["step_versions"] = worker._nonstop.steps.take(["req-0"])["req-0"]
    # a swap asked for between steps applies at once
    stage(2)
    worker.nonstop_swap(2)
    seen["live_between"] = worker._nonstop.live_version
    seen["weights_2"] = live_equals(worker, shard(states[2], rank, size))
    # (c) rank 0 loses bucket 2 of version 3: every rank fails, the weights stay version 2
    t0 = time.monotonic()
    status = stage(3, "tests.tp_rank:FailingSource", fail_at=2)
    seen["fail_s"] = time.monotonic() - t0
    seen["failed"], seen["error"] = status["failed"], status["last_error"]
    seen["staged_after_failure"] = status["staged_version"]
    seen["weights_2_kept"] = live_equals(worker, shard(states[2], rank, size))
    # the next try goes through
    seen["staged_3"] = stage(3)["staged_version"]
    worker.nonstop_swap(3)
    seen["weights_3"] = live_equals(worker, shard(states[3], rank, size))
    seen["info"] = worker._nonstop_info
    with open(f"{out}.{rank}", "w") as f:
        json.dump(seen, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
