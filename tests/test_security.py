"""Security and data-loss behaviour: per-pool Redis users, no pickle, an empty Redis."""

import ast
import json
import signal
import subprocess
import time

import pytest
import redis

from pipeline.redisd.server import free_port
from tests.launching import ROOT, launch_tiny, run_tiny, wait_for_step

ROLES = ("actor", "preprocessor", "trainer", "operator")


@pytest.fixture
def acl_redis(tmp_path):
    """redis-server loading deploy/redis/users.acl with a password per role."""
    acl = (ROOT / "deploy" / "redis" / "users.acl").read_text()
    for role in ROLES:
        acl = acl.replace(f"CHANGE-ME-{role}", f"pw-{role}")
    (tmp_path / "users.acl").write_text(acl)
    port = free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
            "--aclfile",
            str(tmp_path / "users.acl"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    urls = {r: f"redis://{r}:pw-{r}@127.0.0.1:{port}/0" for r in ROLES}
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(urls["operator"]).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, "redis did not start"
            time.sleep(0.05)
    yield urls
    proc.terminate()
    proc.wait()


@pytest.mark.parametrize("mode", ["async", "sync"])  # sync: the actors' claim script
def test_pools_run_as_their_own_restricted_redis_users(tmp_path, acl_redis, mode):
    env = {f"NONSTOP_REDIS_URL_{r.upper()}": acl_redis[r] for r in ROLES[:3]}
    code, out = run_tiny(
        tmp_path,
        tmp_path / "run",
        f"redis.url={acl_redis['operator']}",
        "trainer.max_steps=2",
        f"pipeline.mode={mode}",
        env_extra=env,
    )
    assert code == 0, out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trainer_steps"] == 2 and summary["weight_updates_applied"]["actor-0"] >= 1

    actor = redis.Redis.from_url(acl_redis["actor"])
    for forbidden in (
        lambda: actor.flushall(),
        lambda: actor.config_get("requirepass"),
        lambda: actor.xadd("nonstop:tiny:batches", {"data": b"x"}),
        lambda: actor.set("other:key", 1),
        lambda: actor.keys("*"),
        lambda: actor.script_load("return 1"),  # scripts run with EVALSHA/EVAL only
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(acl_redis["actor"].replace("pw-actor", "guess")).ping()
    trainer = redis.Redis.from_url(acl_redis["trainer"])
    for forbidden in (
        lambda: trainer.execute_command("MULTI"),  # nothing uses transactions: scripts do
        lambda: trainer.xadd("nonstop:tiny:rollouts", {"data": b"x"}),
        lambda: trainer.flushall(),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()


def test_an_empty_redis_stops_the_run_with_a_clear_message(tmp_path, redis_server):
    run_dir = tmp_path / "run"
    proc = launch_tiny(
        tmp_path, run_dir, f"redis.url={redis_server.url}", "trainer.max_steps=100000"
    )
    wait_for_step(run_dir, proc)
    redis.Redis.from_url(redis_server.url).flushall()  # as if it restarted without its AOF
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    assert proc.returncode == 1, out
    assert "redis lost the run's data" in out
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "restarted without the run's data" in logs


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name):
                yield owner.id, node.func.attr, node


def test_no_pickle_and_no_unsafe_torch_load_in_the_code():
    bad = []
    for path in ROOT.glob("*/**/*.py"):
        if path.parts[len(ROOT.parts)] in (".venv", "tests", ".stage", ".stage-cache"):
            continue
        for owner, attr, node in _calls(ast.parse(path.read_text())):
            if owner in ("pickle", "cPickle", "dill", "cloudpickle") and attr.startswith("load"):
                bad.append(f"{path}:{node.lineno} {owner}.{attr}")
            if owner == "torch" and attr == "load":
                safe = any(
                    k.arg == "weights_only" and getattr(k.value, "value", None) is True
                    for k in node.keywords
                )
                if not safe:
                    bad.append(f"{path}:{node.lineno} torch.load without weights_only=True")
    assert bad == []
