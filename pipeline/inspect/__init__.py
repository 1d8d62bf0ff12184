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

Parts: ``target`` (where the run is), ``gather`` (the snapshot), ``render`` (the
terminal view), ``cli`` (arguments, the watch loop).
"""

from pipeline.inspect.cli import main, parse_args
from pipeline.inspect.gather import THROUGHPUT, pool_info, snapshot, stream_info
from pipeline.inspect.render import render
from pipeline.inspect.target import Target, discover_runs, pick_run, resolve

__all__ = [
    "THROUGHPUT",
    "Target",
    "discover_runs",
    "main",
    "parse_args",
    "pick_run",
    "pool_info",
    "render",
    "resolve",
    "snapshot",
    "stream_info",
]
