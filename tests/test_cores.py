"""trainer.torch_threads=auto (trainer/cores.py): the trainer's threads follow what the
other pools on its host keep busy, read from their real status hashes in redis-server."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from actor.room import cores_claimed
from pipeline.config import Config, validate
from pipeline.streams import CORES_CLAIMED, Names
from pipeline.telemetry import PoolStatus, read_statuses
from trainer.cores import CoreShare, cores


@pytest.fixture
def share(rclient):
    names = Names("test", "cores")
    cfg = OmegaConf.structured(Config)
    cfg.actor.engine = "vllm"
    statuses = {
        name: PoolStatus(rclient, names, name, role)
        for name, role in (
            ("trainer", "trainer"),
            ("actor-0", "actor"),
            ("evaluator", "evaluator"),
            ("preprocessor-0", "preprocessor"),
        )
    }
    threads = torch.get_num_threads()
    me = statuses["trainer"]
    s = CoreShare(cfg, lambda: read_statuses(rclient, names), me.set, "trainer")
    s.cores = 4  # as on a 4-CPU host, whatever this one has
    yield s, statuses
    torch.set_num_threads(threads)


def fresh(s: CoreShare) -> int:
    s.checked = 0.0  # read the statuses again now
    return s.apply()


def claimed(rclient, st) -> bytes | None:
    return rclient.hget(st["trainer"].key, CORES_CLAIMED)


def test_the_trainer_takes_the_cores_the_other_pools_leave(share, rclient):
    s, st = share
    st["actor-0"].set(state="waiting")  # held back by back-pressure: takes none
    st["evaluator"].set(state="waiting for a checkpoint")
    st["preprocessor-0"].set(state="idle")
    assert fresh(s) == 4 and torch.get_num_threads() == 4
    assert claimed(rclient, st) == b"1"  # the idle actor's core: it waits for the step
    s.release()
    assert claimed(rclient, st) == b"0"
    st["actor-0"].set(state="generating")  # a vLLM CPU engine: one thread
    assert fresh(s) == 3 and torch.get_num_threads() == 3
    assert claimed(rclient, st) == b"0"  # no idle actor's core taken
    st["evaluator"].set(state="evaluating v0")
    st["preprocessor-0"].set(state="working")
    assert fresh(s) == 1  # 4 - 1 - 1 - 1
    st["actor-0"].set(state="waiting")
    assert fresh(s) == 2
    assert s.take_mean() == pytest.approx((4 + 3 + 1 + 2) / 4)
    assert s.take_mean() == 2  # nothing applied since: the current count


def test_an_evaluator_niced_below_the_trainer_takes_none_of_its_cores(share):
    """pipeline.nice.evaluator above the trainer's: the evaluator runs on what the
    trainer leaves, so the trainer counts it as taking nothing (checked to fail with
    the nice rule removed: 3 threads, not 4)."""
    s, st = share
    st["actor-0"].set(state="waiting")
    st["preprocessor-0"].set(state="idle")
    st["evaluator"].set(state="evaluating v0")
    assert fresh(s) == 3
    s.cfg.pipeline.nice.evaluator = 19
    assert fresh(s) == 4
    s.cfg.pipeline.nice.trainer = 19  # as nice as the trainer: it competes again
    assert fresh(s) == 3


def test_pools_on_another_host_or_long_dead_take_nothing(share, rclient):
    s, st = share
    st["actor-0"].set(state="generating")
    st["evaluator"].set(state="evaluating v0")
    assert fresh(s) == 2
    rclient.hset(st["actor-0"].key, "host", "another-node")  # a Slurm node of its own
    assert fresh(s) == 3
    rclient.hset(st["evaluator"].key, "heartbeat", time.time() - 60)  # killed mid-eval
    assert fresh(s) == 4
    st["preprocessor-0"].set(state="working")
    s.ranks = 2  # two trainer ranks on this host split what is free
    assert fresh(s) == 1


def test_never_below_one_thread_and_statuses_read_at_most_every_half_second(share):
    s, st = share
    s.cores = 1
    st["actor-0"].set(state="generating")
    assert fresh(s) == 1
    s.cores = 4
    assert s.apply() == 1  # read 0 s ago: the count stands until CORES_S passed
    assert fresh(s) == 3
    assert cores() >= 1


@pytest.mark.parametrize("bad", [0, -1, "many", "2 threads"])
def test_a_bad_thread_count_is_refused_naming_auto(bad):
    cfg = OmegaConf.structured(Config)
    cfg.trainer.torch_threads = bad
    with pytest.raises(ValueError, match=r"trainer.torch_threads=.* or auto"):
        validate(cfg)


def test_an_actor_holds_new_groups_only_for_a_live_claim_on_its_host(share, rclient):
    s, st = share
    host = s.host
    actor = SimpleNamespace(client=rclient, names=Names("test", "cores"))  # what it reads
    st["actor-0"].set(state="waiting")
    fresh(s)
    assert cores_claimed(actor, host)
    assert not cores_claimed(actor, "another-node")  # the trainer runs elsewhere
    rclient.hset(st["trainer"].key, "heartbeat", time.time() - 60)  # killed mid-step
    assert not cores_claimed(actor, host)
    st["trainer"].set()  # alive again (heartbeat now), the claim still set
    assert cores_claimed(actor, host)
    s.release()
    assert not cores_claimed(actor, host)


@pytest.mark.parametrize("bad", [-1, 20])
def test_a_bad_niceness_is_refused_naming_the_range(bad):
    cfg = OmegaConf.structured(Config)
    cfg.pipeline.nice.actor = bad
    with pytest.raises(ValueError, match=r"pipeline.nice.actor=.* in 0..19"):
        validate(cfg)


def test_a_pool_yields_the_cores_by_its_niceness_and_its_children_inherit_it():
    code = (
        "import os, subprocess, sys\n"
        "from types import SimpleNamespace\n"
        "from pipeline.runtime import yield_cores\n"
        "before = os.nice(0)\n"
        "yield_cores('actor', SimpleNamespace(actor=7, trainer=0))\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(os.nice(0))'],\n"
        "                       capture_output=True, text=True).stdout.strip()\n"
        "print(os.nice(0) - before, int(child) - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["7", "7"], out
