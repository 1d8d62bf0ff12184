"""The replication state of a run for ``pipeline.inspect``.

- ``redis.mode=sentinel``: the sentinels that answer and the primary each names, the
  primary's replicas with their lag in bytes (``INFO replication``: the primary's
  ``master_repl_offset`` minus the offset each replica acknowledged) and its
  ``min-replicas-to-write`` view.
- ``redis.mode=cluster``: every primary with its slot ranges (``CLUSTER SLOTS``, which
  the operator's ACL user may run) and its replicas' lag in bytes, the same way, from
  each primary's own ``INFO replication``; a primary that does not answer says why.
"""

from __future__ import annotations

import redis

from pipeline.redisd.tls import TLSFiles
from pipeline.streams.cluster import is_cluster
from pipeline.streams.sentinel import ask_sentinels, is_sentinel, parse


def replication_snapshot(url: str, client: redis.Redis, tls: TLSFiles | None = None) -> dict | None:
    """None for a URL that is not a sentinel URL; else plain data (``--json`` prints
    it). ``client``: the run's client, connected to the primary the sentinels name;
    ``tls``: the client's files for ``rediss+sentinel://`` (None: NONSTOP_REDIS_TLS_*)."""
    if is_cluster(url):
        return cluster_replication(client)
    if not is_sentinel(url):
        return None
    parsed = parse(url)
    if parsed.tls:
        from pipeline.config import tls_files

        parsed.files = tls or tls_files(None)
    answers, errors = ask_sentinels(parsed, 2.0)
    sentinels = [
        {"address": name, "primary": f"{a[0]}:{a[1]}" if a else None, "error": None}
        for name, a in answers.items()
    ] + [{"address": name, "primary": None, "error": str(e)} for name, e in errors.items()]
    info = client.info("replication")
    host, port = client.connection_pool.get_master_address()
    offset, replicas = _replicas(info)
    return {
        "service": parsed.service,
        "primary": f"{host}:{port}",
        "role": info.get("role"),
        "repl_offset": offset,
        "good_replicas": info.get("min_slaves_good_slaves"),
        "replicas": replicas,
        "sentinels": sentinels,
    }


def _replicas(info: dict) -> tuple[int, list[dict]]:
    """A primary's ``INFO replication``: its offset, and its replicas with their lag."""
    offset = int(info.get("master_repl_offset", 0))
    replicas = []
    for key, value in sorted(info.items()):
        if key.startswith("slave") and isinstance(value, dict):
            replicas.append(
                {
                    "address": f"{value.get('ip')}:{value.get('port')}",
                    "state": value.get("state"),
                    "lag_bytes": offset - int(value.get("offset", 0)),
                    "lag_s": value.get("lag"),
                }
            )
    return offset, replicas


def cluster_replication(client) -> dict:
    """Every primary of the cluster ``client`` reaches, with its slots and replicas."""
    by_primary: dict[tuple[str, int], list[str]] = {}
    for (first, last), owner in sorted(client.cluster_slots().items()):
        host, port = owner["primary"][:2]
        ranges = by_primary.setdefault((str(host), int(port)), [])
        ranges.append(f"{first}-{last}" if first != last else str(first))
    primaries = []
    for (host, port), ranges in sorted(by_primary.items(), key=lambda kv: kv[1][0]):
        entry = {"address": f"{host}:{port}", "slots": ranges, "error": None}
        try:
            node = client.get_node(host, port)
            if node is None:
                raise redis.ConnectionError("not in the client's map of the cluster yet")
            info = client.get_redis_connection(node).info("replication")
            entry["role"] = info.get("role")
            entry["repl_offset"], entry["replicas"] = _replicas(info)
        except (redis.RedisError, OSError) as e:
            entry["error"] = str(e) or type(e).__name__
        primaries.append(entry)
    return {"cluster": True, "primaries": primaries}


def _replica_lines(replicas: list[dict], indent: str) -> list[str]:
    lines = []
    for r in replicas or [{"address": "none connected", "state": "-", "lag_bytes": "-"}]:
        lag_s = f", {r['lag_s']} s since its last ack" if r.get("lag_s") is not None else ""
        lines.append(
            f"{indent}replica {r['address']}: {r['state']}, lag {r['lag_bytes']} bytes{lag_s}"
        )
    return lines


def render_replication(rep: dict | None) -> list[str]:
    """The view's lines for :func:`replication_snapshot` ([] without one)."""
    if not rep:
        return []
    if rep.get("cluster"):
        lines = [f"replication (cluster): {len(rep['primaries'])} primaries"]
        for p in rep["primaries"]:
            slots = ", ".join(p["slots"])
            if p["error"] is not None:
                lines.append(f"  primary {p['address']} (slots {slots}): no answer ({p['error']})")
                continue
            lines.append(
                f"  primary {p['address']} (slots {slots}; role {p['role']}, "
                f"offset {p['repl_offset']})"
            )
            lines += _replica_lines(p["replicas"], "    ")
        return lines
    good = rep["good_replicas"]
    lines = [
        f"replication ({rep['service']}): primary {rep['primary']} (role {rep['role']}, "
        f"offset {rep['repl_offset']}"
        + (f", {good} replicas good for min-replicas-to-write)" if good is not None else ")")
    ]
    lines += _replica_lines(rep["replicas"], "  ")
    answering = [s for s in rep["sentinels"] if s["error"] is None]
    lines.append(f"  sentinels answering: {len(answering)} of {len(rep['sentinels'])}")
    for s in rep["sentinels"]:
        said = f"names {s['primary']}" if s["error"] is None else f"no answer ({s['error']})"
        lines.append(f"    {s['address']}: {said}")
    return lines
