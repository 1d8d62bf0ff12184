"""The end of a batch job's run, as the launcher ends its own (deploy/slurm/run.sbatch):

    python -m pipeline.run.batch_end sync      # the trainer exited 0; actors still running
    python -m pipeline.run.batch_end summary   # every pool stopped

``sync`` gives the actors ``launch.final_sync_timeout_s`` to apply the trainer's last
version (:func:`pipeline.run.summary.wait_for_final_sync`): without it an actor still
joining the weight transfer when a short run's trainer finished was stopped before it
was sent any version, and the run failed "applied no weight version" (a Slurm
heterogeneous job of 6 steps, 2026-12-07). ``summary`` writes and prints
``summary.json`` with ``NONSTOP_OUTCOME`` and ``NONSTOP_WALL_S``. Both read the run
from the job's environment: ``NONSTOP_CONFIG``, ``NONSTOP_RUN``, ``NONSTOP_REDIS_URL``,
``NONSTOP_RUN_DIR``."""

from __future__ import annotations

import os
import sys

from pipeline.config import load_config
from pipeline.run.summary import wait_for_final_sync, write_summary
from pipeline.streams import Names, connect
from pipeline.streams.shards import Shards

USAGE = "usage: python -m pipeline.run.batch_end sync|summary (the run from NONSTOP_* variables)"


def main(argv: list[str]) -> int:
    if argv not in (["sync"], ["summary"]):
        print(USAGE, file=sys.stderr)
        return 2
    cfg = load_config(os.environ["NONSTOP_CONFIG"])
    cfg.run.name = os.environ.get("NONSTOP_RUN") or cfg.run.name  # the job's run name
    names = Names.of(cfg)
    client = connect(os.environ["NONSTOP_REDIS_URL"], attempts=3)
    if argv == ["sync"]:
        wait_for_final_sync(client, names, cfg, cfg.trainer.max_steps)
        return 0
    shards = Shards.of(cfg, client, names)  # redis.mode=cluster: its partitions
    outcome, wall_s = os.environ["NONSTOP_OUTCOME"], float(os.environ["NONSTOP_WALL_S"])
    summary = write_summary(os.environ["NONSTOP_RUN_DIR"], client, names, outcome, wall_s, shards)
    print(summary.render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
