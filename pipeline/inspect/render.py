"""The terminal view of a snapshot: header, streams table, pools table, dead letters."""

from __future__ import annotations

import time
from typing import Any

from pipeline.inspect.gather import THROUGHPUT
from pipeline.inspect.replication import render_replication
from pipeline.streams import redact


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
        f"run {snap['run']}  redis {r['version']} at {redact(url)}  "
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
        reasons = p.get("reward_error_reasons") or {}
        if reasons:
            parts.append("(" + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ")")
        state = p["state"]
        if not p["alive"] and state not in ("finished", "stopped"):
            state += " (no heartbeat)"
        elif p["stalled"]:
            state += f" (no progress for {_age(p['progress_age_s'])})"
        errors = [e for e in (p["last_error"], p.get("last_publish_error")) if e]
        err = ("; ".join(errors) or "-").replace("\n", " ")[:80]
        age = _age(p["heartbeat_age_s"])
        rows.append([name, p["role"], state, age, _dash(p["version"]), ", ".join(parts), err])
    return rows


def render(snap: dict, prev: dict | None = None, url: str = "") -> str:
    """The terminal view of one snapshot (rates need the previous one)."""
    lines = _header(snap, url) + render_replication(snap.get("replication")) + [""]
    streams = dict(snap["streams"])
    for shard in snap.get("shards") or []:  # cluster partitions 1.., labelled
        streams |= {f"{n}@shard{shard['shard']}": s for n, s in shard["streams"].items()}
    lines += _table(
        ["STREAM", "LENGTH", "ADDED", "NEWEST", "GROUP", "LAG", "PENDING", "CONSUMERS"],
        _stream_rows(streams),
    )
    if snap.get("shards"):
        where = ", ".join(f"shard{s['shard']} {s['url']}" for s in snap["shards"])
        lines.append(f"(the rows without @ are partition 0; {where})")
        for name, t in snap["work_totals"].items():
            groups = ", ".join(
                f"{g} lag {v['lag']} pending {v['pending']}" for g, v in t["groups"].items()
            )
            lines.append(f"{name} over {1 + len(snap['shards'])} partitions: length {t['length']}"
                         + (f"; {groups}" if groups else ""))  # fmt: skip
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
