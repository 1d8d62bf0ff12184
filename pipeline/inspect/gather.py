"""One snapshot of a run, as plain data (what ``--json`` prints): streams with
their groups' lag and pending entries, pools' status hashes with ages, counters
and errors, the dead letters.

::

    reads   XINFO STREAM / GROUPS / CONSUMERS of every stream of the run, the pools'
            status hashes, the run's version and sample keys, INFO server/memory
    writes  nothing
"""

from __future__ import annotations

import time
from typing import Any

import redis

from pipeline.streams import SHARDED, Names, redact
from pipeline.telemetry import read_statuses

# Streams every run has (or will have); others found under the run's prefix are shown too.
KNOWN_STREAMS = Names.STREAMS
EPISODE_TOOL_KINDS = ("ok", "malformed", "unknown_tool", "oversized", "error", "timeout", "budget")
# Counters worth showing per role, in order, with a short label; the rest go to "other".
THROUGHPUT = {
    "actor": (
        ("groups_produced", "groups"),
        ("tokens", "tokens"),
        ("tokens_per_s", "tok/s"),
        ("weight_updates_applied", "updates"),
        ("weight_updates_failed", "failed updates"),
        ("reward_mean", "reward"),
        ("reward_errors", "reward errors"),
        # task.kind=env (actor/episodes.py; absent otherwise)
        ("episodes_open", "episodes in flight"),
        ("episodes", "episodes"),
        ("turns", "turns"),
        ("multi_turn", "multi-turn"),
        ("tool_calls", "tool calls"),
        *((f"tool.{kind}", f"tool {kind}") for kind in EPISODE_TOOL_KINDS),
        ("infra_failures", "infra failures"),
        ("episodes_spanning", "episodes spanning versions"),
        ("episodes_resumed", "episodes resumed"),
        ("episodes_restarted", "episodes restarted"),
        ("episode_groups_taken_over", "groups taken over"),
        ("env_errors", "environment errors"),
        ("behind", "behind"),
        ("backlog", "backlog"),
    ),
    "preprocessor": (
        ("kept", "kept"),
        ("dropped", "dropped"),
        ("batches", "batches"),
        ("dead_lettered", "dead"),
    ),
    "trainer": (
        ("step", "step"),
        ("samples_trained", "samples"),
        ("stale_samples_dropped", "stale"),
        ("weight_updates_published", "published"),
        ("weight_versions_unreceived", "unreceived"),
        ("weight_publish_failures", "publish failures"),
        ("actors_dropped", "actors dropped"),
        ("reward_mean", "reward"),
        ("loss", "loss"),
        ("buffered_samples", "buffered"),
    ),
}
_IDENTITY = {"role", "state", "heartbeat", "progress", "version", "pid", "started", "last_error"}
_IDENTITY |= {"last_publish_error"}
REWARD_ERROR_PREFIX = "reward_errors."  # an actor's per-reason reward-error counters


def _raw(field: str) -> bool:
    """A dead letter's binary field: the payload, or a refused episode journal's field."""
    return field == "data" or field.startswith("journal:")


def _s(value: Any) -> Any:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _id_ms(entry_id: Any) -> int | None:
    entry_id = _s(entry_id)
    if not entry_id or entry_id == "0-0":
        return None
    return int(str(entry_id).split("-")[0])


def _undelivered(client: redis.Redis, key: str, last_delivered: str, cap: int = 10_000) -> int:
    """Entries after ``last_delivered`` (when XINFO cannot give the lag itself)."""
    return len(client.xrange(key, min=f"({last_delivered}", max="+", count=cap))


def stream_info(client: redis.Redis, key: str, now: float) -> dict:
    out: dict[str, Any] = {"key": key, "exists": bool(client.exists(key)), "groups": []}
    if not out["exists"]:
        out.update(length=0, entries_added=0, last_id=None, last_entry_age_s=None)
        return out
    info = client.xinfo_stream(key)
    last_id = _s(info.get("last-generated-id"))
    last_ms = _id_ms(last_id)
    out.update(
        length=int(info["length"]),
        entries_added=int(info.get("entries-added", info["length"])),
        last_id=last_id,
        last_entry_age_s=None if last_ms is None else round(max(now - last_ms / 1000, 0.0), 3),
    )
    for g in client.xinfo_groups(key):
        name, last_delivered = _s(g["name"]), _s(g["last-delivered-id"])
        lag = g.get("lag")
        consumers = [
            {
                "name": _s(c["name"]),
                "pending": int(c["pending"]),
                "idle_s": round(int(c["idle"]) / 1000, 3),
            }
            for c in client.xinfo_consumers(key, name)
        ]
        out["groups"].append(
            {
                "name": name,
                "consumers": consumers,
                "pending": int(g["pending"]),
                "lag": int(lag) if lag is not None else _undelivered(client, key, last_delivered),
                "entries_read": g.get("entries-read"),
                "last_delivered_id": last_delivered,
            }
        )
    return out


def _number(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def _age_of(fields: dict[str, str], key: str, now: float) -> float | None:
    return round(max(now - float(fields[key]), 0.0), 3) if key in fields else None


def pool_info(fields: dict[str, str], now: float, stale_after_s: float) -> dict:
    """One pool's status hash, with ages: ``heartbeat`` (the process is alive) and,
    where the pool writes it, ``progress`` (its main loop last moved)."""
    age, progress_age = _age_of(fields, "heartbeat", now), _age_of(fields, "progress", now)
    state = fields.get("state", "starting")
    done = state in ("finished", "stopped")
    alive = age is not None and age <= stale_after_s
    role = fields.get("role", "?")
    labels = dict(THROUGHPUT.get(role, ()))
    counters = {
        k: _number(v)
        for k, v in fields.items()
        if k not in _IDENTITY and not k.startswith(REWARD_ERROR_PREFIX)
    }
    reasons = {
        k.removeprefix(REWARD_ERROR_PREFIX): _number(v)
        for k, v in fields.items()
        if k.startswith(REWARD_ERROR_PREFIX)
    }
    return {
        "role": role,
        "state": state,
        "alive": alive,
        "stalled": alive and not done and (progress_age or 0.0) > stale_after_s,
        "heartbeat_age_s": age,
        "progress_age_s": progress_age,
        "version": _number(fields["version"]) if "version" in fields else None,
        "pid": _number(fields["pid"]) if "pid" in fields else None,
        "throughput": {k: counters[k] for k in labels if k in counters},
        "other": {k: v for k, v in counters.items() if k not in labels},
        "last_error": fields.get("last_error") or None,
        "last_publish_error": fields.get("last_publish_error") or None,
        "reward_error_reasons": reasons,
    }


def shard_snapshot(shards: list[tuple], now: float) -> list:
    """The work streams (rollouts, batches) of partitions 1.. of redis.mode=cluster:
    ``shards`` holds (where, client, names) for each (:func:`cluster_partitions`: its
    own stream names; ``where``: its slot and node, shown as ``url``)."""
    out = []
    for k, (where, c, part) in enumerate(shards, start=1):
        streams = {n: stream_info(c, getattr(part, n), now) for n in SHARDED}
        out.append({"shard": k, "url": redact(where), "streams": streams})
    return out


def cluster_partitions(client: redis.Redis, names: Names) -> list[tuple]:
    """redis.mode=cluster: (where, client, names) of partitions 1.. (partition 0 is shown
    as the plain rows), as many as the cluster holds rollouts or batches streams for
    (``<prefix>:{<run>.p<k>}:...``); ``where``: the partition, its slot and node."""
    found = set()
    for key in client.scan_iter(match=f"{names.prefix}:{{{names.run}.p*}}:*", count=500):
        tag = _s(key).split("{", 1)[1].split("}", 1)[0]
        number = tag.rsplit(".p", 1)[1]
        if number.isdigit():
            found.add(int(number))
    out = []
    for k in range(1, max(found, default=0) + 1):
        part = names.part(k)
        node = client.get_node_from_key(part.rollouts)
        where = f"partition {k}, slot {client.keyslot(part.rollouts)} on {node.name}"
        out.append((where, client, part))
    return out


def work_totals(streams: dict, shards: list) -> dict:
    """Per work stream, over every partition: length, and per group lag and pending."""
    out = {}
    for name in SHARDED:
        parts = [streams[name]] + [s["streams"][name] for s in shards]
        groups: dict[str, dict[str, int]] = {}
        for p in parts:
            for g in p["groups"]:
                t = groups.setdefault(g["name"], {"lag": 0, "pending": 0})
                t["lag"] += g["lag"] or 0
                t["pending"] += g["pending"]
        out[name] = {"length": sum(p["length"] for p in parts), "groups": groups}
    return out


def snapshot(
    client: redis.Redis,
    names: Names,
    stale_after_s: float = 30.0,
    shards: list[tuple[str, redis.Redis, Names]] | None = None,
) -> dict:
    """Everything the view shows, as plain data (this is what --json prints).
    ``shards``: (where, client, names) of cluster partitions 1..
    (:func:`cluster_partitions`), whose work streams are added."""
    now = time.time()
    server = client.info("server")
    memory = client.info("memory")
    streams = {}
    found = {
        _s(k).removeprefix(names.base + ":")
        for k in client.scan_iter(match=names.key("*"), count=500, _type="stream")
    }
    for name in list(KNOWN_STREAMS) + sorted(found - set(KNOWN_STREAMS)):
        streams[name] = stream_info(client, names.stream(name), now)
    pools = {
        name: pool_info(fields, now, stale_after_s)
        for name, fields in sorted(read_statuses(client, names).items(), key=_pool_order)
    }
    trainer_v, published_v, produced, retired = client.mget(
        names.trainer_version,
        names.published_version,
        names.samples_produced,
        names.samples_retired,
    )
    extra = shard_snapshot(shards or [], now)
    dead = streams["dead"]
    recent_dead = [
        {_s(k): _s(v) for k, v in fields.items() if not _raw(_s(k))} | {"id": _s(eid)}
        for eid, fields in (client.xrevrange(dead["key"], count=3) if dead["exists"] else [])
    ]
    return {
        "run": names.base,
        "time": now,
        "redis": {
            "version": server.get("redis_version"),
            "used_memory": memory.get("used_memory_human"),
            "maxmemory_policy": memory.get("maxmemory_policy"),
        },
        "trainer_version": int(trainer_v) if trainer_v is not None else None,
        "published_version": int(published_v) if published_v is not None else None,
        "samples_in_flight": int(produced or 0) - int(retired or 0) if produced else None,
        "streams": streams,
        "shards": extra,
        "work_totals": work_totals(streams, extra) if extra else None,
        "pools": pools,
        "dead_letters": {
            "count": dead["length"],
            "added": dead["entries_added"],
            "reported_by_pools": sum(
                int(p["throughput"].get("dead_lettered", p["other"].get("dead_lettered", 0)))
                for p in pools.values()
            ),
            "recent": recent_dead,
        },
    }


def _pool_order(item: tuple[str, dict]) -> tuple:
    order = {"trainer": 0, "preprocessor": 1, "actor": 2}
    name, fields = item
    digits = "".join(c for c in name if c.isdigit())
    return order.get(fields.get("role", ""), 3), name.rstrip("0123456789"), int(digits or 0), name
