"""Shared fixtures: a real redis-server per test module and a client for it, the tiny
model's folder and a trainer factory on them; tests marked ``vllm`` are skipped, with the
reason, where real vLLM is not importable (tests/vllm_real.py). Shared helpers that are
not fixtures live in tests/*_builders.py (and tests/weight_peers.py, tests/vllm_fake.py,
tests/vllm_real.py); a test module never imports another test module (tests/test_layout.py)."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.config import Config
from pipeline.models import materialize_model
from pipeline.redisd.server import EmbeddedRedis
from pipeline.runtime import Pool
from pipeline.streams import Names, connect
from pipeline.telemetry import MetricsFile, PoolStatus
from tests.deploy_builders import unit_root  # noqa: F401 - a fixture: a root to verify units in
from tests.launching import tiny_cache
from tests.listen_builders import wrap  # noqa: F401 - a fixture: a host whose name resolves off loopback
from tests.slurm_builders import slurm  # noqa: F401 - a fixture: the single-host Slurm
from tests.vllm_real import vllm_available, vllm_engine  # noqa: F401 (the fixture)
from trainer.main import Trainer

# pytest-timeout for tests marked slow or vllm: the faults schedule alone may take 900 s
# (tests/test_faults.py); a real-vLLM module starts its engine (~70 s idle, minutes under
# load) in a module fixture, whose set-up counts against the module's first test
LONG_TIMEOUT_S = 1800


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server (loopback, password, AOF, noeviction) for one test module."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    server = EmbeddedRedis(str(tmp_path_factory.mktemp("redis")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def rclient(redis_server):
    """A connected redis.Redis on an empty database; closed afterwards."""
    client = connect(redis_server.url, attempts=3)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model's folder, materialized once per test module (a module may define
    its own ``tiny``): a copy of the session's (tests/launching.py tiny_cache)."""
    return materialize_model("tiny", tiny_cache(tmp_path_factory.mktemp("m")))


@pytest.fixture
def make_trainer(tiny, tmp_path, rclient, monkeypatch):
    """``make(**trainer_overrides)``: a Trainer pool on the tiny model and ``rclient``
    (names test:trainer); every one made is closed afterwards."""
    monkeypatch.setenv("NONSTOP_RUN_SECRET", "test-secret")
    made = []

    def make(**trainer_overrides) -> Trainer:
        cfg = OmegaConf.structured(Config)
        cfg.run_dir, cfg.model.path, cfg.redis.block_ms = str(tmp_path), tiny, 100
        cfg.trainer.transfer_timeout_s = 5
        for k, v in trainer_overrides.items():
            cfg.trainer[k] = v
        names = Names("test", "trainer")
        pool = Pool(
            cfg=cfg,
            name="trainer",
            role="trainer",
            client=rclient,
            names=names,
            stop=threading.Event(),
            status=PoolStatus(rclient, names, "trainer", "trainer"),
            metrics=MetricsFile(str(tmp_path / "metrics.jsonl")),
        )
        made.append(Trainer(pool))
        return made[-1]

    yield make
    for t in made:
        t.publisher.close(timeout_s=1)


# `make test` runs the suite on TEST_WORKERS pytest-xdist workers (Makefile) with
# --dist loadgroup: each test runs in the group add_worker_groups gives it, and one group
# runs on one worker, its tests in file order
SERIAL_GROUPS = {
    # one real vLLM engine at a time (each takes ~3 GiB and both cores while it
    # compiles); a module with any vllm test goes here whole, its module fixtures with it
    "vllm": lambda item: item.get_closest_marker("vllm") is not None,
    # one single-host Slurm at a time: each starts slurmctld, six slurmd and a munged of
    # its own (tests/slurm_builders.py, deploy/slurm/local-cluster.sh), and its jobs run
    # whole pipelines
    "slurm": lambda item: "slurm" in getattr(item, "fixturenames", ()),
    # tests/test_envs.py counts the machine's pyexec sandboxes: none of another test's
    "pyexec": lambda item: (
        item.module.__name__.split(".")[-1]
        in ("test_envs", "test_episode_actor", "test_episode_durable")
    ),
}


def add_worker_groups(items) -> None:
    """An ``xdist_group`` for every test: its module (module fixtures are built once, on
    one worker), or the SERIAL_GROUPS group its module belongs to."""
    by_module: dict[str, str] = {}
    for item in items:
        module = item.module.__name__
        for group, belongs in SERIAL_GROUPS.items():
            if belongs(item):
                by_module[module] = group
        by_module.setdefault(module, module)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(by_module[item.module.__name__]))


# a module whose source starts a whole pipeline, a Redis topology, a bench or a Slurm: its
# tests are marked ``e2e`` (``make test-quick`` leaves them out, with ``slow`` and ``vllm``)
WHOLE_RUNS = re.compile(
    r"launch_tiny|run_tiny|pipeline\.launch|pipeline\.bench|fault_runs|start_local_cluster"
    r"|RedisHA\(|LocalCluster\(|\bslurm\b"
)


def add_e2e_markers(items) -> None:
    whole: dict[str, bool] = {}
    for item in items:
        path = str(item.path)
        if path not in whole:
            whole[path] = bool(WHOLE_RUNS.search(Path(path).read_text()))
        if whole[path]:
            item.add_marker(pytest.mark.e2e)


def pytest_runtest_setup(item):
    """On an xdist worker with ``--dist loadgroup``: a test must carry its group in its id
    (xdist appends ``@group``), or the groups above were silently lost and every test was
    dealt out alone: vLLM engines and single-host Slurms side by side, module fixtures
    built on both workers. pytest 9.2 names items by ``_id`` while pytest-xdist 3.8 still
    writes ``_nodeid``, and xdist's own collection hook ran before the one below marked
    the groups: both lost them until 2026-11-29 (pyproject.toml pins pytest below 9.2)."""
    if getattr(item.config.option, "loadgroup", False) and "@" not in item.nodeid:
        pytest.fail(
            f"pytest-xdist's loadgroup did not group {item.nodeid}: this pytest and "
            "pytest-xdist do not work together; install pytest<9.2 (make setup does) or "
            "run without workers (TEST_WORKERS=0)",
            pytrace=False,
        )


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Skip the ``vllm`` tests, saying why, when ``import vllm`` fails (``make setup-vllm``).
    Tests marked slow or vllm get LONG_TIMEOUT_S (pytest-timeout) unless they set their own
    @pytest.mark.timeout: the default in pyproject.toml is for ordinary tests."""
    for item in items:
        long = item.get_closest_marker("slow") or item.get_closest_marker("vllm")
        if long is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))
    add_worker_groups(items)
    add_e2e_markers(items)
    marked = [item for item in items if item.get_closest_marker("vllm") is not None]
    if not marked:
        return
    why = vllm_available()
    if why is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=why))


# NONSTOP_TEST_CPU=FILE: one JSON line per test with its wall time and the CPU seconds its
# process and the children it reaped used (pools, servers, engines a test started and
# waited for; set-up and teardown of the fixtures it was first or last to use included):
# where CI's time goes is CPU work on 2 cores, so this is what to cut (README, Tests)
CPU_LOG = os.environ.get("NONSTOP_TEST_CPU")


def _cpu_s() -> float:
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not CPU_LOG:
        yield
        return
    cpu, wall = _cpu_s(), time.monotonic()
    yield
    row = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2)}
    row["cpu_s"] = round(_cpu_s() - cpu, 2)
    with open(CPU_LOG, "a") as f:
        f.write(json.dumps(row) + "\n")
