"""A pool process for the /health test of tests/test_prom.py: the real runtime
(pipeline/runtime.py ``start_pool`` with the preprocessor's role: its Redis client,
/metrics and /health with their server child, heartbeat, sd_notify) whose main loop
waits for a gate file before its first tick, as a pool waits for its model to load, so
the test sees "loading" for as long as it likes; then it ticks, writing its status at
each tick (a Redis call, as every pool's loop makes one), until SIGTERM.

``python -m tests.health_pool GATE --config CFG --name NAME [key=value ...]``
"""

from __future__ import annotations

import os
import sys
import time

from pipeline.runtime import start_pool


def main(gate: str, argv: list[str]) -> None:
    pool = start_pool("preprocessor", argv)
    while not os.path.exists(gate) and not pool.stop.is_set():
        time.sleep(0.05)  # "loading": no tick yet
    while not pool.tick():
        pool.status.set(state="idle")
        time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
