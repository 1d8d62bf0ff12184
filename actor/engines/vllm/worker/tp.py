"""Tensor parallelism for the vLLM worker extension (``actor.vllm.tensor_parallel_size``).

vLLM runs one Worker process per TP rank, each holding its shard of the weights.
Every ``collective_rpc`` reaches every worker, and the engine core sends RPCs,
``execute_model`` and ``sample_tokens`` to all workers through one broadcast queue,
so every worker sees them in the same order. The extension builds on that::

    receive   TP rank 0 alone opens the transfer channel (trainer rank 0 -> this actor
              is unchanged) and reads each bucket on its receiver thread; the bucket is
              then broadcast over a weights-only process group of the TP ranks (never
              vLLM's own communicator) by ``nonstop_broadcast``, a call the client makes
              once every rank waits at that bucket (the client's ``relay_buckets``,
              actor/engines/vllm/weight_updates.py): it runs on
              each rank's engine thread, in the broadcast queue's order, so the weights
              group's collectives are ordered with the forward passes' on every rank
              (two NCCL communicators used concurrently in no common order can hang).
              A header (ok, index) goes first, so a failure on rank 0 fails every rank's
              staging at once; a failure elsewhere makes the client give the version up
              on every rank (``nonstop_abort_stage``); every rank checks the bucket's
              sum and scatters only its own shard (worker/layout.py)
    swap      ``nonstop_swap`` runs in the broadcast queue's order on every rank: between
              two steps it is applied at once; between a step's execute_model and its
              sample_tokens it is armed and applied at the next execute_model entry.
              Either way every rank swaps between the same two steps, so no step ever
              mixes versions across ranks
    poll      the engine merges the ranks' answers (:func:`merge_polls`): a version is
              staged or live only when it is on every rank

With one rank none of this is used: the receiver thread swaps under the lock.
A sequence in flight sees exactly what it sees with one rank: the new version from
its next step on, its KV cache kept.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch
import torch.distributed as dist


def tp_of(worker: Any) -> tuple[int, int]:
    """(TP rank, TP size) of a vLLM Worker (worker_base.py: ``parallel_config``,
    ``rank``). Pipeline parallelism is not built: refused with a clear error."""
    pc = worker.parallel_config
    if int(getattr(pc, "pipeline_parallel_size", 1)) != 1:
        raise ValueError(
            "pipeline parallelism is not supported by the nonstop worker extension; "
            "use actor.vllm.tensor_parallel_size alone"
        )
    size = int(pc.tensor_parallel_size)
    return int(worker.rank) % size, size


def weights_group(size: int, device: torch.device, timeout_s: float) -> Any:
    """A process group of the TP ranks for weights only (every rank calls this at
    once: nonstop_install is a collective_rpc). NCCL on CUDA, gloo on the CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    return dist.new_group(
        ranks=list(range(size)),
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class TPRelay:
    """A BucketSource for every TP rank whose broadcasts run on the engine thread.

    The receiver thread stages as with one rank (``fetch`` per bucket, then the sum
    check and the scatter); rank 0's ``fetch`` first reads the bucket from ``inner``
    (the transfer channel, or in-memory buckets). Then every rank's receiver thread
    waits at bucket ``index`` (``ready``) until the engine thread has run
    :meth:`broadcast` for it: the client calls ``nonstop_broadcast`` once every rank is
    ready (``relay_buckets``, actor/engines/vllm/weight_updates.py), and vLLM delivers
    that call to every worker in the same order relative to its steps, so the weights
    group's collectives never run concurrently with the forward passes' (NCCL documents
    two communicators used concurrently in no common order as able to hang). A header
    (ok, index) goes first, so a failure on rank 0 reaches every rank as an error."""

    def __init__(self, version: int, group: Any, rank: int, device: torch.device):
        self.version, self.group, self.rank = version, group, rank
        self.inner: Any = None  # rank 0: set by the receiver thread before its first fetch
        self.device, self.cuda = device, device.type == "cuda"
        self.cond = threading.Condition()
        self.ready = -1  # the bucket this rank's receiver thread waits at
        self.done = -1  # the last bucket broadcast
        self.out: torch.Tensor | None = None  # where bucket ``ready`` goes on this rank
        self.fetched_ok = False  # rank 0: bucket ``ready`` was read from ``inner``
        self.header_ok = False  # the last header: rank 0 had the bucket
        self.aborted = ""  # a reason: the client gave this version up
        self.event: Any = None  # CUDA: the fetch's (rank 0) or the broadcast's end

    # ---- the receiver thread
    def fetch(self, index: int, out: torch.Tensor, deadline: float) -> None:
        error = None
        if self.rank == 0:
            try:
                self.inner.fetch(index, out, deadline)
            except Exception as e:  # told to every rank by the header, then raised here
                error = e
        with self.cond:
            self.out, self.fetched_ok = out, error is None
            self.event = _recorded() if self.cuda else None  # the fetch's side-stream work
            self.ready = index
            self.cond.notify_all()
            while self.done < index and not self.aborted:
                if not self.cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(
                        f"TP rank {self.rank}: bucket {index} of version {self.version} was "
                        "not broadcast by the engine in time"
                    )
            self.out = None
            if self.aborted:
                raise RuntimeError(self.aborted)
            if self.cuda:  # the broadcast ran on the engine's stream
                torch.cuda.current_stream().wait_event(self.event)
        if error is not None:
            raise error
        if not self.header_ok:
            raise RuntimeError(f"TP rank 0 failed to receive bucket {index}; see its log")

    # ---- the engine thread (nonstop_broadcast / nonstop_abort_stage)
    def broadcast(self, index: int, numel: int, dtype: torch.dtype) -> None:
        """Bucket ``index`` from rank 0 to every rank on the weights group. Every rank
        takes part whatever its state (a rank not waiting at ``index`` receives into a
        scratch buffer), so the collectives always match across ranks."""
        with self.cond:
            here = self.ready == index and self.out is not None and self.done < index
            out = self.out if here else torch.empty(numel, dtype=dtype, device=self.device)
            ok = self.rank == 0 and here and self.fetched_ok
            if self.cuda and here and self.event is not None:
                torch.cuda.current_stream().wait_event(self.event)
        header_ok = broadcast_bucket(self.group, self.device, index, out, ok)
        with self.cond:
            self.header_ok = header_ok
            self.event = _recorded() if self.cuda else None
            if here:
                self.done = index
            else:  # its receiver thread would wait for a bucket that went by
                self.aborted = (
                    f"bucket {index} of version {self.version} was broadcast before TP rank "
                    f"{self.rank} was ready for it (it waited at bucket {self.ready})"
                )
            self.cond.notify_all()

    def abort(self, reason: str) -> None:
        with self.cond:
            self.aborted = reason
            self.cond.notify_all()


def _recorded() -> Any:
    event = torch.cuda.Event()
    event.record()
    return event


def broadcast_bucket(
    group: Any, device: torch.device, index: int, out: torch.Tensor, ok: bool
) -> bool:
    """Header (ok, index) from rank 0, then the bucket when rank 0 had it; returns
    whether it had."""
    header = torch.tensor([int(ok), index], dtype=torch.int64, device=device)
    dist.broadcast(header, src=0, group=group)
    sent, got = (int(x) for x in header.tolist())
    if got != index:
        raise RuntimeError(f"TP ranks out of step: bucket {got} from rank 0, {index} here")
    if sent:
        dist.broadcast(out, src=0, group=group)
    return bool(sent)


def merge_polls(answers: list[dict]) -> dict:
    """One ``nonstop_poll`` answer from every TP rank's (rank order)."""
    live = [a["live_version"] for a in answers]
    if len(set(live)) > 1:
        raise RuntimeError(
            "TP ranks disagree on the live weight version: "
            + ", ".join(f"rank {i}: {v}" for i, v in enumerate(live))
        )
    staged = [a["staged_version"] for a in answers]
    holds: dict[int, float] = {}
    for a in answers:
        for rec in a["swaps"]:
            holds[rec["version"]] = max(holds.get(rec["version"], 0.0), rec["hold_ms"])
    swaps = [{**rec, "hold_ms": holds[rec["version"]]} for rec in answers[0]["swaps"]]
    errors = [f"rank {i}: {a['last_error']}" for i, a in enumerate(answers) if a["last_error"]]
    return {
        "live_version": live[0],
        "staged_version": staged[0] if len(set(staged)) == 1 else None,
        "swaps": swaps,
        "failed": sum(a["failed"] for a in answers),
        "last_error": "; ".join(errors),
        "busy": sum(a["busy"] for a in answers),
        "orphan_holds": max(a["orphan_holds"] for a in answers),
        "channel": answers[0].get("channel"),  # rank 0 alone opens the transfer channel
        "step_records": answers[0].get("step_records"),
        "preemption": answers[0].get("preemption"),
        "versions": answers[0]["versions"],
        "routes": answers[0].get("routes", {}),  # the router is replicated: rank 0's
        "gaps": answers[0].get("gaps", []),  # rank 0's steps: every rank's are the same
        "tp_ready": _merged_ready([a.get("tp_ready") for a in answers]),
    }


def _merged_ready(readies: list[dict | None]) -> dict | None:
    """The bucket every rank waits at or beyond (the lowest), when all stage one version."""
    if any(r is None for r in readies) or len({r["version"] for r in readies}) != 1:
        return None
    return {"version": readies[0]["version"], "index": min(r["index"] for r in readies)}
