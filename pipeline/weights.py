"""Weight-transfer building blocks shared by both ends: the bucket layout,
flattening, the exact checksum and the two-rank gloo group.

The protocol (see pipeline/weight_publisher.py and pipeline/weight_receiver.py)::

    trainer (WeightPublisher thread)              actor (WeightReceiver thread)
      reads  <run>:joins  (actor asks in)   <--     XADD joins {actor, nonce}
      builds a 2-rank gloo group per actor  <-->    builds its side (rank 1)
      XADD <run>:weights  announcement      -->     XREAD weights (version, layout, sums)
      broadcast bucket by bucket            -->     receive into a staging copy, check the
                                                    sums, swap under the per-forward-pass lock

Each actor has its own two-rank group, found through a TCPStore whose address
is in the run's Redis, so one dead or slow actor is dropped within the
deadline without touching the others, and a restarted actor joins again and
is sent the current version at once.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import time

import torch
import torch.distributed as dist

from pipeline.messages import BucketSpec, ParamSpec


def bucket_layout(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[BucketSpec]:
    """Group parameters, in order, into buckets of about ``bucket_bytes``."""
    buckets, current, numel = [], [], 0
    for name, p in named:
        if current and (numel + p.numel()) * p.element_size() > bucket_bytes:
            buckets.append(BucketSpec(numel=numel, params=current))
            current, numel = [], 0
        current.append(ParamSpec(name=name, shape=list(p.shape), offset=numel))
        numel += p.numel()
    if current:
        buckets.append(BucketSpec(numel=numel, params=current))
    return buckets


def flatten(params: dict[str, torch.Tensor], layout: list[BucketSpec]) -> list[torch.Tensor]:
    """Copy parameters into fresh flat bucket tensors."""
    return [torch.cat([params[s.name].detach().reshape(-1) for s in b.params]) for b in layout]


_INT_VIEW = {4: torch.int32, 2: torch.int16, 1: torch.int8, 8: torch.int64}


def checksum(buckets: list[torch.Tensor]) -> list[int]:
    """Exact, order-independent sum of each bucket's bit patterns."""
    return [int(b.view(_INT_VIEW[b.element_size()]).sum(dtype=torch.int64)) for b in buckets]


def pair_group(store: dist.Store, nonce: str, rank: int, host: str, timeout_s: float):
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore(nonce, store), rank, 2, opts)


def broadcast_buckets(group, buckets: list[torch.Tensor], deadline: float) -> None:
    """Broadcast every bucket from rank 0, all within one deadline (monotonic seconds)."""
    for bucket in buckets:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("weight transfer passed its deadline")
        group.broadcast(bucket, 0, datetime.timedelta(seconds=remaining)).wait()


def join_mac(secret: str, join: dict[str, str]) -> str:
    """HMAC of a join request: only holders of the run's secret get a transfer group."""
    msg = f"{join.get('epoch')}:{join.get('actor')}:{join.get('nonce')}".encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()
