"""The replication state of a ``redis.mode=sentinel`` run for ``pipeline.inspect``: the
sentinels that answer and the primary each names, the primary's replicas with their
lag in bytes (``INFO replication``: the primary's ``master_repl_offset`` minus the
offset each replica acknowledged) and its ``min-replicas-to-write`` view."""

from __future__ import annotations

import redis

from pipeline.redis_tls import TLSFiles
from pipeline.streams.sentinel import ask_sentinels, is_sentinel, parse


def replication_snapshot(url: str, client: redis.Redis, tls: TLSFiles | None = None) -> dict | None:
    """None for a URL that is not a sentinel URL; else plain data (``--json`` prints
    it). ``client``: the run's client, connected to the primary the sentinels name;
    ``tls``: the client's files for ``rediss+sentinel://`` (None: NONSTOP_REDIS_TLS_*)."""
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
    return {
        "service": parsed.service,
        "primary": f"{host}:{port}",
        "role": info.get("role"),
        "repl_offset": offset,
        "good_replicas": info.get("min_slaves_good_slaves"),
        "replicas": replicas,
        "sentinels": sentinels,
    }


def render_replication(rep: dict | None) -> list[str]:
    """The view's lines for :func:`replication_snapshot` ([] without one)."""
    if not rep:
        return []
    good = rep["good_replicas"]
    lines = [
        f"replication ({rep['service']}): primary {rep['primary']} (role {rep['role']}, "
        f"offset {rep['repl_offset']}"
        + (f", {good} replicas good for min-replicas-to-write)" if good is not None else ")")
    ]
    for r in rep["replicas"] or [{"address": "none connected", "state": "-", "lag_bytes": "-"}]:
        lag_s = f", {r['lag_s']} s since its last ack" if r.get("lag_s") is not None else ""
        lines.append(f"  replica {r['address']}: {r['state']}, lag {r['lag_bytes']} bytes{lag_s}")
    answering = [s for s in rep["sentinels"] if s["error"] is None]
    lines.append(f"  sentinels answering: {len(answering)} of {len(rep['sentinels'])}")
    for s in rep["sentinels"]:
        said = f"names {s['primary']}" if s["error"] is None else f"no answer ({s['error']})"
        lines.append(f"    {s['address']}: {said}")
    return lines
