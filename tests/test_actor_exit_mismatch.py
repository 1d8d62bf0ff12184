"""An actor that can never take the trainer's weights stops at once (issue 21): a real
actor process (tiny model, hf engine) against a real redis-server whose rendezvous says
the trainer sends over another ``weights.transport``. The weight receiver does not retry
(actor/weight_receiver.py PERMANENT); the actor exits with EXIT_MISMATCH and one line
naming both transports, which the launcher's supervisor does not restart."""

from __future__ import annotations

import os
import subprocess
import sys

from pipeline.runtime import EXIT_MISMATCH
from pipeline.streams import Names
from tests.config_builders import actor_config
from tests.launching import ROOT, tiny_cache


def test_a_transport_mismatch_stops_the_actor_with_exit_mismatch(tmp_path, redis_server, rclient):
    names = Names("nonstop", "tiny")
    rclient.delete(names.rendezvous)
    rclient.hset(
        names.rendezvous,
        mapping={"transport": "nccl", "epoch": "e1", "host": "127.0.0.1", "port": "1"},
    )
    env = dict(
        os.environ,
        NONSTOP_CACHE=tiny_cache(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
        NONSTOP_RUN_SECRET="s" * 32,
        NONSTOP_REDIS_URL=redis_server.url,
    )
    cmd = [sys.executable, "-m", "actor", "--config", actor_config(tmp_path, redis_server.url)]
    proc = subprocess.run(
        [*cmd, "--name", "actor-0", "weights.transport=gloo"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_MISMATCH, out[-3000:]
    last = [line for line in out.splitlines() if "cannot take the trainer's weights" in line]
    assert len(last) == 1, out[-3000:]
    assert "over 'nccl' but this actor expects 'gloo'" in last[0]
    assert out.count("weights refused") == 1  # no retry
    assert rclient.xlen(names.joins) == 0  # refused before asking to join
