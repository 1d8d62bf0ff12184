"""Trimming by consumption: a work stream loses only the entries every consumer group
has read and acknowledged (XTRIM MINID to the lowest id some group still needs).
"""

from __future__ import annotations

import redis

from pipeline.streams.names import id_tuple


def consumed_floor(client: redis.Redis, stream: str) -> str | None:
    """The lowest id some group still needs (unread or pending); None if no group."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return None
    if not groups:
        return None
    floor: tuple[int, int] | None = None
    for g in groups:
        last = id_tuple(g["last-delivered-id"])
        need = (last[0], last[1] + 1)
        pending = client.xpending(stream, g["name"])
        if pending["pending"]:
            need = min(need, id_tuple(pending["min"]))
        floor = need if floor is None else min(floor, need)
    return f"{floor[0]}-{floor[1]}"


def trim_consumed(client: redis.Redis, stream: str, keep_from: str | None = None) -> int:
    """XTRIM MINID to what every group has acknowledged (and below ``keep_from``)."""
    floor = consumed_floor(client, stream)
    if floor is None:
        return 0
    if keep_from is not None and id_tuple(keep_from) < id_tuple(floor):
        floor = keep_from
    return client.xtrim(stream, minid=floor, approximate=False)
