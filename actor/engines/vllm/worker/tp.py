"""Tensor parallelism for the vLLM worker extension (``actor.vllm.tensor_parallel_size``).

vLLM runs one Worker process per TP rank, each holding its shard of the weights.
Every ``collective_rpc`` reaches every worker, and the engine core sends RPCs,
``execute_model`` and ``sample_tokens`` to all workers through one broadcast queue,
so every worker sees them in the same order. The extension builds on that::

    receive   TP rank 0 alone opens the transfer channel (trainer rank 0 -> this actor
              is unchanged); each bucket it receives is broadcast over a weights-only
              process group of the TP ranks (never vLLM's own communicator, which the
              forward passes use on the engine thread), with a header first (ok, index)
              so a failure on rank 0 fails every rank's staging at once; every rank
              checks the bucket's sum and scatters only its own shard (vllm_layout.py)
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


class TPSource:
    """A BucketSource for every TP rank: rank 0 reads ``inner`` (the transfer channel,
    or in-memory buckets) and broadcasts each bucket; the others receive it. A header
    (ok, index) goes first, so a failure on rank 0 reaches every rank as an error."""

    def __init__(self, inner: Any, group: Any, rank: int, device: torch.device):
        self.inner, self.group, self.rank, self.device = inner, group, rank, device

    def fetch(self, index: int, out: torch.Tensor, deadline: float) -> None:
        header = torch.tensor([0, index], dtype=torch.int64, device=self.device)
        error = None
        if self.rank == 0:
            try:
                self.inner.fetch(index, out, deadline)
                header[0] = 1
            except Exception as e:  # told to every rank below, then raised here
                error = e
        dist.broadcast(header, src=0, group=self.group)
        if error is not None:
            raise error
        ok, got = (int(x) for x in header.tolist())
        if not ok:
            raise RuntimeError(f"TP rank 0 failed to receive bucket {index}; see its log")
        if got != index:
            raise RuntimeError(f"TP ranks out of step: bucket {got} from rank 0, {index} here")
        dist.broadcast(out, src=0, group=self.group)


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
    }
