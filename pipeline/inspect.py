"""``python -m pipeline.inspect``: what is flowing through a live run, from its Redis.

::

    reads   every stream of the run (XINFO STREAM / GROUPS / CONSUMERS), the pools'
            status hashes <prefix>:<run>:status:<pool>, the run's version keys
    writes  nothing (read-only: safe against a production run)
    blocks  never; one snapshot per call, or one per --watch interval

Per stream: length, entries ever added, age of the newest entry, each consumer
group's lag (entries not yet delivered) and pending entries (delivered, not
acknowledged). Per pool: role, state, heartbeat age, policy version, its
throughput counters and last error. The dead-letter count. ``--json`` prints
the same snapshot as one JSON object (one per line with ``--watch``).

Where the run is::

    python -m pipeline.inspect --run-dir outputs/<timestamp>            # embedded redis
    python -m pipeline.inspect --run-dir /shared/run                    # a deploy/slurm run
    python -m pipeline.inspect --url redis://:PASS@host:6379/0 --run math
    NONSTOP_REDIS_URL=... python -m pipeline.inspect --config /etc/nonstop-rl/config.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import redis

from pipeline.streams import Names, _redact, connect
from pipeline.telemetry import read_statuses

# Streams every run has (or will have); others found under the run's prefix are shown too.
KNOWN_STREAMS = ("rollouts", "batches", "weights", "joins", "dead")
# Counters worth showing per role, in order, with a short label; the rest go to "other".
THROUGHPUT = {
    "actor": (
        ("groups_produced", "groups"),
        ("tokens", "tokens"),
        ("tokens_per_s", "tok/s"),
        ("weight_updates_applied", "updates"),
        ("weight_updates_failed", "failed updates"),
        ("reward_mean", "reward"),
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
        ("reward_mean", "reward"),
        ("loss", "loss"),
        ("buffered_samples", "buffered"),
    ),
}
_IDENTITY = {"role", "state", "heartbeat", "progress", "version", "pid", "started", "last_error"}


@dataclass
class Target:
    url: str
    prefix: str
    run: str


# ------------------------------------------------------------------ where the run is


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _config_names(path: str) -> tuple[str | None, str | None]:
    """(redis.prefix, run.name) from a saved config.yaml, without the full schema."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    return OmegaConf.select(cfg, "redis.prefix"), OmegaConf.select(cfg, "run.name")


def discover_runs(client: redis.Redis) -> list[tuple[str, str]]:
    """Every (prefix, run) that has a pool status hash in this Redis."""
    found = set()
    for key in client.scan_iter(match="*:status:*", count=500):
        parts = key.decode().split(":")
        if len(parts) >= 4 and parts[-2] == "status":
            found.add((":".join(parts[:-3]), parts[-3]))
    return sorted(found)


def resolve(args: argparse.Namespace) -> Target:
    """The Redis URL, prefix and run name from the arguments (errors say what to pass)."""
    prefix, run, url = args.prefix, args.run, args.url
    config = args.config
    if args.run_dir:
        rd = args.run_dir
        if not os.path.isdir(rd):
            raise ValueError(f"--run-dir {rd} is not a directory")
        url_f = os.path.join(rd, "redis", "url")  # written by the Slurm scripts (deploy/slurm)
        port_f, auth_f = os.path.join(rd, "redis", "port"), os.path.join(rd, "redis", "auth")
        if url is None and os.path.exists(url_f):
            url = _read(url_f)
        elif url is None:
            if not os.path.exists(port_f):
                raise ValueError(
                    f"{port_f} does not exist: {rd} has no embedded redis-server; "
                    "pass --url redis://... for a run on an external Redis"
                )
            auth = _read(auth_f) if os.path.exists(auth_f) else ""
            url = f"redis://:{auth}@127.0.0.1:{_read(port_f)}/0"
        if config is None and os.path.exists(os.path.join(rd, "config.yaml")):
            config = os.path.join(rd, "config.yaml")
    if config:
        if not os.path.exists(config):
            raise ValueError(f"--config {config} does not exist")
        cfg_prefix, cfg_run = _config_names(config)
        prefix, run = prefix or cfg_prefix, run or cfg_run
    url = url or os.environ.get("NONSTOP_REDIS_URL")
    if not url:
        raise ValueError(
            "no Redis to inspect: pass --run-dir DIR, --url redis://... or set NONSTOP_REDIS_URL"
        )
    return Target(url=url, prefix=prefix or "", run=run or "")


def pick_run(client: redis.Redis, target: Target) -> Target:
    """Fill in prefix/run when not given: the only run with pools in this Redis."""
    if target.prefix and target.run:
        return target
    runs = [
        (p, r)
        for p, r in discover_runs(client)
        if (not target.prefix or p == target.prefix) and (not target.run or r == target.run)
    ]
    if len(runs) == 1:
        return Target(target.url, *runs[0])
    if not runs and target.run:  # no pool has started yet: inspect what is there
        return Target(target.url, target.prefix or "nonstop", target.run)
    listing = ", ".join(f"--prefix {p} --run {r}" for p, r in runs) or "none"
    raise ValueError(f"pass --run (and --prefix) to choose a run; runs with pools here: {listing}")


# ------------------------------------------------------------------ the snapshot


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
    counters = {k: _number(v) for k, v in fields.items() if k not in _IDENTITY}
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
    }


def snapshot(client: redis.Redis, names: Names, stale_after_s: float = 30.0) -> dict:
    """Everything the view shows, as plain data (this is what --json prints)."""
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
        names.key("trainer_version"),
        names.key("published_version"),
        names.key("samples_produced"),
        names.key("samples_retired"),
    )
    dead = streams["dead"]
    recent_dead = [
        {_s(k): _s(v) for k, v in fields.items() if _s(k) != "data"} | {"id": _s(eid)}
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


# ------------------------------------------------------------------ rendering


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    return [line(header), *map(line, rows)]


def _rates(snap: dict, prev: dict | None) -> dict[str, dict[str, float]]:
    """Per pool, per numeric counter, the rate since the previous snapshot (watch mode)."""
    if not prev:
        return {}
    dt = snap["time"] - prev["time"]
    out: dict[str, dict[str, float]] = {}
    if dt <= 0:
        return out
    for name, p in snap["pools"].items():
        before = prev["pools"].get(name, {}).get("throughput", {})
        for key in ("groups_produced", "tokens", "samples_trained", "step", "kept", "batches"):
            if key in p["throughput"] and key in before:
                out.setdefault(name, {})[key] = (p["throughput"][key] - before[key]) / dt
    return out


def _dash(v: Any) -> str:
    return "-" if v is None else _fmt(v)


def _header(snap: dict, url: str) -> list[str]:
    r, clock = snap["redis"], time.strftime("%H:%M:%S", time.localtime(snap["time"]))
    return [
        f"run {snap['run']}  redis {r['version']} at {_redact(url)}  "
        f"mem {r['used_memory']}  policy {r['maxmemory_policy']}  {clock}",
        f"trainer version {_dash(snap['trainer_version'])}  "
        f"published {_dash(snap['published_version'])}  "
        f"samples in flight {_dash(snap['samples_in_flight'])}",
    ]


def _stream_rows(streams: dict) -> list[list[str]]:
    rows = []
    for name, s in streams.items():
        first = [name, str(s["length"]), str(s["entries_added"]), _age(s["last_entry_age_s"])]
        if not s["exists"]:
            first[1:] = ["-", "-", "(not created yet)"]
        if not s["groups"]:
            rows.append(first + ["-", "", "", ""])
        for i, g in enumerate(s["groups"]):
            consumers = ", ".join(
                f"{c['name']}(pending {c['pending']}, idle {_age(c['idle_s'])})"
                for c in g["consumers"]
            )
            cells = first if i == 0 else [""] * 4
            rows.append(cells + [g["name"], str(g["lag"]), str(g["pending"]), consumers or "-"])
    return rows


def _pool_rows(pools: dict, rates: dict) -> list[list[str]]:
    rows = []
    for name, p in pools.items():
        labels = dict(THROUGHPUT.get(p["role"], ()))
        parts = [f"{labels[k]} {_fmt(v)}" for k, v in p["throughput"].items()]
        parts += [f"{labels.get(k, k)}/s {v:.2f}" for k, v in rates.get(name, {}).items()]
        state = p["state"]
        if not p["alive"] and state not in ("finished", "stopped"):
            state += " (no heartbeat)"
        elif p["stalled"]:
            state += f" (no progress for {_age(p['progress_age_s'])})"
        err = (p["last_error"] or "-").replace("\n", " ")[:60]
        age = _age(p["heartbeat_age_s"])
        rows.append([name, p["role"], state, age, _dash(p["version"]), ", ".join(parts), err])
    return rows


def render(snap: dict, prev: dict | None = None, url: str = "") -> str:
    """The terminal view of one snapshot (rates need the previous one)."""
    lines = _header(snap, url) + [""]
    lines += _table(
        ["STREAM", "LENGTH", "ADDED", "NEWEST", "GROUP", "LAG", "PENDING", "CONSUMERS"],
        _stream_rows(snap["streams"]),
    )
    lines.append("")
    if snap["pools"]:
        lines += _table(
            ["POOL", "ROLE", "STATE", "HEARTBEAT", "VERSION", "THROUGHPUT", "LAST ERROR"],
            _pool_rows(snap["pools"], _rates(snap, prev)),
        )
    else:
        lines.append("no pool has reported yet (no status hashes)")
    d = snap["dead_letters"]
    lines += ["", f"dead letters: {d['count']} in stream, {d['reported_by_pools']} by pools"]
    for e in d["recent"]:
        who = f"{e.get('source')} by {e.get('consumer')}"
        lines.append(f"  {e.get('id')} from {who}: {e.get('reason')}")
    return "\n".join(lines)


# ------------------------------------------------------------------ command line

CLEAR = "\x1b[H\x1b[2J"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.inspect",
        description="Streams, consumer groups and pools of a live nonstop-rl run.",
    )
    p.add_argument(
        "--run-dir", help="a run directory (its redis/url or redis/port+auth, and config.yaml)"
    )
    p.add_argument("--url", help="redis://[:PASS@]host:port/db (default: $NONSTOP_REDIS_URL)")
    p.add_argument("--config", help="a config.yaml to take redis.prefix and run.name from")
    p.add_argument("--prefix", help="redis.prefix of the run (default: from config, or found)")
    p.add_argument("--run", help="run.name (default: from config, or the only run found)")
    p.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=float,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--stale-after",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a heartbeat older than this marks a pool as not alive (default 30)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        target = resolve(args)
        client = connect(target.url, attempts=3)
        target = pick_run(client, target)
    except (ValueError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = Names(target.prefix, target.run)
    prev = None
    try:
        while True:
            try:
                snap = snapshot(client, names, args.stale_after)
                text = json.dumps(snap) if args.json else render(snap, prev, target.url)
                prev = snap
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if args.watch is None:
                    print(f"error: redis unreachable: {e}", file=sys.stderr)
                    return 1
                text = f"redis unreachable ({e}); retrying every {args.watch}s"
            if args.watch is not None and not args.json:
                sys.stdout.write(CLEAR)  # a live terminal view: clear the screen, redraw
            print(text, flush=True)
            if args.watch is None:
                return 0
            time.sleep(max(args.watch, 0.05))
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
