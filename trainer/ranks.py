"""The trainer's ranks: who this process is, and how rank 0 hands each step's
micro-batches to the others.

::

    reads   RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (the launcher,
            systemd, Slurm or torchrun set them; world size 1 needs none)
    writes  nothing outside the process group
    blocks  in gloo collectives, each bounded by trainer.collective_timeout_s
    listens rank 0: the group's store on MASTER_ADDR:MASTER_PORT, every rank: its gloo
            devices on the interface of its address towards MASTER_ADDR; nothing else

Rank 0 alone reads the batches stream. For every optimizer step it sends one
:class:`Plan` to all ranks over a gloo group: the encoded (msgspec) TrainBatch
payloads, each rank training on every W-th one. Payloads are msgpack bytes in
a uint8 tensor, never pickle. While rank 0 waits for data it sends empty
plans now and then, so the other ranks' deadlines measure a dead peer and not
a quiet stream.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist

from pipeline.messages import TrainBatch, decode


class Plan(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What every rank does next: wait (no batches), stop, or train a step."""

    version: int  # the version this step produces minus one (the current one)
    batches: list[bytes] = []  # encoded TrainBatch, all ranks' share
    tokens: int = 0  # loss tokens in all of them (token_mean divides by them)
    samples: int = 0  # sequences in all of them (the other loss aggregations)
    stop: bool = False


_PLAN_ENCODER = msgspec.msgpack.Encoder()
_PLAN_DECODER = msgspec.msgpack.Decoder(Plan)


@dataclass
class Ranks:
    rank: int
    world_size: int
    local_rank: int
    group: object | None  # gloo group for plans and metrics (None: one rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_rank(configured_world_size: int) -> tuple[int, int, int]:
    """(rank, world size, local rank) from the environment, checked against the config."""
    world = int(os.environ.get("WORLD_SIZE", configured_world_size))
    if world != configured_world_size:
        raise ValueError(
            f"WORLD_SIZE={world} in the environment but trainer.world_size="
            f"{configured_world_size}; start as many ranks as trainer.world_size says"
        )
    rank = int(os.environ.get("RANK", 0))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world})")
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def init_ranks(world_size: int, device: str, timeout_s: float, need_dist: bool) -> Ranks:
    """Join the default process group (nccl on CUDA, else gloo) when there are several
    ranks or the backend needs torch.distributed; a gloo group carries the plans."""
    rank, world, local = env_rank(world_size)
    if world == 1 and not need_dist:
        return Ranks(0, 1, 0, None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ and world > 1:
        raise ValueError("MASTER_PORT is not set: the launcher sets it for each rank")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        listen_on_master_addr()
        store = rendezvous_store(rank, world, timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=timeout) if world > 1 else None
    return Ranks(rank, world, local, group)


def listen_on_master_addr() -> None:
    """The gloo groups torch makes itself (the default one, ``new_group``) listen on the
    interface that holds this rank's address towards MASTER_ADDR, not on whatever this
    host's name resolves to (``GLOO_SOCKET_IFNAME``; one set by the operator wins)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    from pipeline.listeners import gloo_interface
    from pipeline.transfer.channel import local_address

    host, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "0") or 0)
    os.environ["GLOO_SOCKET_IFNAME"] = gloo_interface(local_address(host, port or 1))


def rendezvous_store(rank: int, world: int, timeout_s: float):
    """The process group's store at MASTER_ADDR:MASTER_PORT. Rank 0 serves it on that
    address only (torch's own would listen on every interface); the others connect.
    Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) torchrun's agent serves it,
    and every rank connects."""
    host = os.environ["MASTER_ADDR"]
    port = int(os.environ.get("MASTER_PORT", "0") or 0)
    timeout = datetime.timedelta(seconds=timeout_s)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if rank == 0 and not agent:
        from pipeline.listeners import serve_store

        store, port = serve_store(
            host, timeout_s, port, world_size=world, wait_for_workers=False, multi_tenant=True
        )
        os.environ["MASTER_PORT"] = str(port)  # DeepSpeed reads it
        return store
    return dist.TCPStore(host, port, world, is_master=False, timeout=timeout, multi_tenant=True)


def _broadcast_bytes(ranks: Ranks, payload: bytes | None) -> bytes:
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=ranks.group)
    buf = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload is not None and ranks.is_main
        else torch.empty(int(size), dtype=torch.uint8)
    )
    if int(size):
        dist.broadcast(buf, src=0, group=ranks.group)
    return buf.numpy().tobytes()


def share_plan(ranks: Ranks, plan: Plan | None) -> Plan:
    """Rank 0 passes its plan, the others None; every rank returns rank 0's plan."""
    if ranks.world_size == 1:
        assert plan is not None
        return plan
    data = _broadcast_bytes(ranks, _PLAN_ENCODER.encode(plan) if ranks.is_main else None)
    return _PLAN_DECODER.decode(data)


def my_share(ranks: Ranks, plan: Plan) -> tuple[list[TrainBatch], int]:
    """This rank's micro-batches (every W-th) and the slot count every rank runs."""
    mine = [decode(b, TrainBatch) for b in plan.batches[ranks.rank :: ranks.world_size]]
    slots = -(-len(plan.batches) // ranks.world_size)
    return mine, slots


def sum_across(ranks: Ranks, values: list[float]) -> list[float]:
    """Element-wise sum of a few floats over all ranks (step metrics)."""
    if ranks.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=ranks.group)
    return t.tolist()


def barrier(ranks: Ranks) -> None:
    if ranks.world_size > 1:
        dist.barrier(group=ranks.group)


def close(ranks: Ranks) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
