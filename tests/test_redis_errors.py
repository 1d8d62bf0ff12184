"""Clear errors where a user meets Redis trouble (issue 14 item 5), each against a
real redis-server or a real closed port: an unreachable ``redis.url`` is one line
within the start-up budget naming the URL (password hidden) and what to check,
exit code 2 from a pool and from the launcher, no traceback; refused credentials
are said at once; a pool that Redis refuses (ACL, eviction policy) exits 4 and the
launcher's supervisor stops the run at once instead of restarting it; the run-time
reconnect (``redis.reconnect_s``) is unchanged; summary.json counts the trainer's
dead letters beside the preprocessors'."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline.config import Config
from pipeline.messages import RolloutGroup, encode
from pipeline.redisd.server import EmbeddedRedis, free_port
from pipeline.run.summary import build_summary
from pipeline.streams import Consumer, Names, RedisUnavailable, connect, publish
from tests.launching import ROOT, tiny_cache
from tests.redis_builders import acl_server
from tests.trainer_builders import batch, run_step, sample

SECRET = "hunter2-not-shown"


def closed_url() -> str:
    """A URL with a password on a loopback port nothing listens on."""
    return f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"


def test_unreachable_url_is_one_line_within_the_start_up_budget():
    url = closed_url()
    start = time.monotonic()
    with pytest.raises(RedisUnavailable) as info:
        connect(url, startup_s=4.0)
    took = time.monotonic() - start
    msg = str(info.value)
    assert 3.0 <= took <= 6.0, f"gave up after {took:.1f} s with a 4 s budget"
    assert "\n" not in msg and SECRET not in msg
    assert url.replace(f":{SECRET}@", "***@") in msg  # the URL, password hidden
    for hint in ("redis-server is running", "host and port", "firewall", "redis-cli -u"):
        assert hint in msg, f"{hint!r} missing from: {msg}"


def test_the_default_budget_is_about_ten_seconds():
    start = time.monotonic()
    with pytest.raises(RedisUnavailable):
        connect(closed_url())
    assert 6.0 <= time.monotonic() - start <= 11.0


def test_refused_credentials_are_said_at_once(redis_server):
    url = redis_server.url.replace(redis_server.password, SECRET)
    start = time.monotonic()
    with pytest.raises(RedisUnavailable) as info:
        connect(url)
    assert time.monotonic() - start < 2.0, "credentials retried as if unreachable"
    msg = str(info.value)
    assert "refused the credentials" in msg and "users.acl" in msg and SECRET not in msg


def test_a_connected_client_still_rides_out_a_redis_restart(tmp_path):
    """After start-up, a command meeting a restarting server retries (reconnect_s)."""
    server = EmbeddedRedis(str(tmp_path / "redis"))
    server.start()
    try:
        client = connect(server.url, reconnect_s=20.0)
        client.set("k", "v")
        server.stop()
        threading.Timer(1.5, server.start).start()  # same port, password and AOF
        start = time.monotonic()
        assert client.get("k") == b"v"  # waited for the restart instead of raising
        assert time.monotonic() - start >= 1.0
    finally:
        time.sleep(0.1)
        server.stop()


def _one_error_line(out: str, url: str) -> None:
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if "cannot reach redis" in ln]
    assert len(lines) == 1, out
    assert url.replace(f":{SECRET}@", "***@") in lines[0] and SECRET not in out


@pytest.mark.slow
def test_a_pool_exits_2_in_one_line_when_redis_is_unreachable(tmp_path):
    from tests.config_builders import actor_config

    url = closed_url()
    env = dict(os.environ, NONSTOP_REDIS_URL=url, HF_HUB_OFFLINE="1")
    env["NONSTOP_CACHE"] = tiny_cache(tmp_path / "cache")
    cmd = [sys.executable, "-m", "preprocessor", "--config", actor_config(tmp_path, url)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stdout + proc.stderr, url)
    assert took < 30, f"{took:.1f} s"  # imports (torch) plus the ~8 s budget


def test_a_pool_exits_4_in_one_line_on_an_evicting_redis(tmp_path, redis_server, rclient):
    """A server that may evict stream data stops a pool at start-up in one line (exit
    4: Redis refuses the run, a restart cannot fix it), not with a traceback."""
    from tests.config_builders import actor_config

    url = redis_server.url
    env = dict(os.environ, NONSTOP_REDIS_URL=url, HF_HUB_OFFLINE="1")
    env["NONSTOP_CACHE"] = tiny_cache(tmp_path / "cache")
    cmd = [sys.executable, "-m", "preprocessor", "--config", actor_config(tmp_path, url)]
    rclient.config_set("maxmemory-policy", "allkeys-lru")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        rclient.config_set("maxmemory-policy", "noeviction")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if "maxmemory-policy is 'allkeys-lru'" in ln]
    assert len(lines) == 1 and "noeviction" in lines[0], out


@pytest.mark.slow
def test_the_launcher_exits_2_in_one_line_when_redis_url_is_unreachable(tmp_path):
    url = closed_url()
    cmd = [sys.executable, "-m", "pipeline.launch", "redis=external", f"redis.url={url}"]
    env = dict(os.environ, NONSTOP_CACHE=tiny_cache(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    env.pop("NONSTOP_REDIS_URL", None)
    start = time.monotonic()
    proc = subprocess.run(
        cmd + [f"run_dir={tmp_path / 'run'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout + proc.stderr
    _one_error_line(proc.stdout + proc.stderr, url)
    assert "error: cannot reach redis" in proc.stderr
    assert took < 30, f"{took:.1f} s"  # before materializing the model


# ---- summary.json counts every pool's dead letters (the trainer's too)


def test_summary_counts_the_trainers_dead_letters_beside_the_preprocessors(
    make_trainer,  # the fixture of tests/conftest.py
    rclient,
    tmp_path,
):
    trainer = make_trainer(samples_per_step=2)
    names, rng = trainer.pool.names, np.random.default_rng(5)
    cfg = OmegaConf.structured(Config)
    cfg.task.group_size = 2
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    # the preprocessor dead-letters a rollouts entry that does not decode
    publish(rclient, names.rollouts, b"not a rollout group", group="g-prep")
    prep = Consumer(rclient, names, names.rollouts, "preprocessor", "preprocessor-0", RolloutGroup)
    assert prep.read(10, wait=False) == [] and prep.dead_lettered == 1
    # the trainer dead-letters a batch whose arrays disagree, and trains the good one
    bad = batch("bad", [sample(0, 5, 0, 1.0, rng, lp=[-1.0, -1.0]), sample(1, 5, 0, 0, rng)], rng)
    good = batch("good", [sample(0, 5, 0, 1.0, rng), sample(1, 5, 0, -1.0, rng)], rng)
    publish(rclient, names.batches, encode(bad))
    publish(rclient, names.batches, encode(good))
    assert run_step(trainer)["dead_lettered"] == 2  # samples

    s = build_summary(str(tmp_path), rclient, names, "finished", 1.0)
    assert s.dead_lettered == 2
    assert s.dead_lettered_by_role == {"preprocessor": 1, "trainer": 1}
    assert int(s.pools["trainer"]["dead_lettered"]) == 1  # its own counter, like a preprocessor's
    assert {d["role"] for d in s.dead_letter_entries} == {"preprocessor", "trainer"}
    assert "preprocessor 1, trainer 1" in s.render()


# ---- a Redis user without a command its pool needs stops the pool at start-up


def test_the_shipped_acl_passes_every_roles_probe_and_the_probe_writes_nothing(tmp_path):
    from pipeline.streams import check_permissions

    urls = acl_server(tmp_path)
    try:
        names = Names("nonstop", "probe")
        for role in ("actor", "preprocessor", "trainer"):
            check_permissions(connect(urls[role]), names, role, urls[role])
        operator = connect(urls["operator"])
        assert not any(operator.exists(getattr(names, s)) for s in Names.STREAMS)
    finally:
        urls["proc"].terminate()
        urls["proc"].wait()


def test_a_user_without_xadd_is_named_with_the_command_key_and_acl_file(tmp_path):
    from pipeline.streams import check_permissions

    urls = acl_server(tmp_path, drop=" +xadd")
    try:
        names = Names("nonstop", "probe")
        with pytest.raises(RedisUnavailable) as info:
            check_permissions(connect(urls["actor"]), names, "actor", urls["actor"])
        msg = str(info.value)
        assert "XADD" in msg and names.rollouts in msg and "deploy/redis/users.acl" in msg
        assert "pw-actor" not in msg and "\n" not in msg
    finally:
        urls["proc"].terminate()
        urls["proc"].wait()


@pytest.mark.slow
def test_an_actor_without_xadd_exits_4_at_start_up(tmp_path):
    from tests.config_builders import actor_config

    urls = acl_server(tmp_path, drop=" +xadd")
    try:
        env = dict(os.environ, NONSTOP_REDIS_URL_ACTOR=urls["actor"], HF_HUB_OFFLINE="1")
        env.update(NONSTOP_CACHE=tiny_cache(tmp_path / "cache"), NONSTOP_RUN_SECRET="s" * 32)
        env["NONSTOP_REDIS_URL"] = urls["operator"]
        cmd = [sys.executable, "-m", "actor", "--config", actor_config(tmp_path, urls["actor"])]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 4, out
        assert "Traceback" not in out and "may not run XADD on nonstop:tiny:rollouts" in out
    finally:
        urls["proc"].terminate()
        urls["proc"].wait()


def test_a_pool_started_alone_refuses_shard_urls_in_one_line(tmp_path):
    """NONSTOP_REDIS_SHARD_URLS (independent-instance shards, replaced by Redis Cluster)
    in a pool's environment: the pool stops at start-up, exit 4 (a restart cannot fix
    it), one line naming the move, before it connects anywhere."""
    from pipeline.config import MIGRATE_SHARDS
    from tests.config_builders import actor_config

    env = dict(os.environ, HF_HUB_OFFLINE="1", NONSTOP_RUN_SECRET="s" * 32)
    env.update(
        NONSTOP_CACHE=tiny_cache(tmp_path / "cache"), NONSTOP_REDIS_URL="redis://127.0.0.1:1/0"
    )
    env["NONSTOP_REDIS_SHARD_URLS"] = "redis://127.0.0.1:2/0"
    cmd = [sys.executable, "-m", "actor", "--config", actor_config(tmp_path, "redis://h:1/0")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out
    assert "Traceback" not in out, out
    line = next(ln for ln in out.splitlines() if "NONSTOP_REDIS_SHARD_URLS is set" in ln)
    assert line.endswith(f"NONSTOP_REDIS_SHARD_URLS is set: {MIGRATE_SHARDS}; unset it"), line


@pytest.mark.parametrize("code", [2, 4])
def test_the_supervisor_restarts_an_unreachable_pool_but_stops_on_a_refused_one(
    tmp_path, capsys, code
):
    """Exit 2 (Redis unreachable at start-up: may come back) is restarted like a crash;
    exit 4 (Redis refused the pool: ACL, credentials, eviction) stops the run at once
    with the pool's last line."""
    from pipeline.run.supervisor import Supervisor

    cfg = OmegaConf.structured(Config)
    cfg.launch.restart_policy, cfg.launch.max_restarts, cfg.launch.watchdog_s = "on-failure", 3, 0
    script = f"print('the pool says why'); raise SystemExit({code})"
    cmds = {"actor-0": [sys.executable, "-c", script]}
    sup = Supervisor(cfg, str(tmp_path), dict(os.environ), cmds)
    sup.spawn_all()
    outcome = None
    deadline = time.monotonic() + 60
    while outcome is None and time.monotonic() < deadline:
        outcome = sup.check({})
        time.sleep(0.05)
    assert outcome == (f"failed: actor-0 exited with {code}", 1)
    out = capsys.readouterr().out
    if code == 4:
        assert sup.restarts["actor-0"] == 0 and "redis refused it" in out
        assert "the pool says why" in out
    else:
        assert sup.restarts["actor-0"] == 3 and "restarting it (3/3)" in out
