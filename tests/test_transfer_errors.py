"""Weight-transfer join failures are one log line each, not torch's C++ backtraces
(issue 14 item 5): an actor that cannot reach the trainer's store, and a trainer
whose joining actor never arrives. Real redis-server, real TCPStore, real
processes (the C++ log level is fixed when torch loads, so each case runs in a
fresh interpreter that starts the way the pools' ``__main__`` does)."""

import os
import subprocess
import sys
import textwrap

import pytest

from pipeline.redisd.server import free_port
from pipeline.torch_logs import ENV, QUIET, one_line, quiet_cpp_logs

PRELUDE = """
import logging, sys, time
if sys.argv[1] == "quiet":
    from pipeline.torch_logs import quiet_cpp_logs
    assert quiet_cpp_logs()  # as the pools' __main__ does, before torch loads
logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
import redis
from pipeline.streams import Names
url, port = sys.argv[2], sys.argv[3]
client = redis.Redis.from_url(url)
names = Names("test", "joinerr-" + port)
"""

ACTOR = """
from actor.weight_receiver import WeightReceiver
client.hset(names.rendezvous, mapping={"transport": "gloo", "host": "127.0.0.1",
                                       "port": port, "epoch": "e1"})
receiver = WeightReceiver(client, names, "actor-0", None, timeout_s=1.5, secret="s")
receiver.start()
deadline = time.monotonic() + 20
while receiver.failed < 2 and time.monotonic() < deadline:
    time.sleep(0.1)
receiver.stop()
print("failed", receiver.failed)
"""

TRAINER = """
from trainer.weight_publisher import WeightPublisher
from pipeline.transfer.buckets import join_mac
publisher = WeightPublisher(client, names, "127.0.0.1", 1, timeout_s=1.5, secret="s")
join = {"actor": "actor-z", "nonce": "n1", "epoch": publisher.epoch}
join["mac"] = join_mac("s", join)
client.xadd(names.joins, join)  # a valid join whose actor never reaches the store
deadline = time.monotonic() + 20
while not publisher.last_error and time.monotonic() < deadline:
    time.sleep(0.1)
publisher.close(timeout_s=5)
print("error", publisher.last_error)
"""


def _run(script: str, mode: str, url: str, port: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(script)
    return subprocess.run(
        [sys.executable, "-c", code, mode, url, str(port)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.fixture
def dead_port():
    return free_port("127.0.0.1")  # nothing listens there


def test_actor_that_cannot_reach_the_store_logs_one_line_per_attempt(redis_server, dead_port):
    done = _run(ACTOR, "quiet", redis_server.url, dead_port)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "failed 2" in done.stdout or "failed 3" in done.stdout, done.stdout
    lines = done.stderr.strip().splitlines()
    assert "frame #" not in done.stderr and "Exception raised from" not in done.stderr
    joins = [x for x in lines if "could not join the trainer's weight transfer" in x]
    assert len(joins) >= 2 and len(lines) == len(joins), lines  # nothing else on stderr
    assert f"at 127.0.0.1:{dead_port} within 1.5 s" in joins[0]
    assert "trainer.transfer_host" in joins[0] and "firewall" in joins[0]


def test_trainer_whose_actor_never_joins_logs_one_line(redis_server, dead_port):
    done = _run(TRAINER, "quiet", redis_server.url, dead_port)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "actor actor-z did not complete its weight-transfer join at 127.0.0.1:" in done.stdout
    lines = done.stderr.strip().splitlines()
    assert "frame #" not in done.stderr
    assert len(lines) == 1 and "actor actor-z did not complete" in lines[0], lines
    assert "within 1.5 s" in lines[0] and "DistStoreError" in lines[0]


def test_without_the_quiet_start_torch_prints_its_backtraces(redis_server, dead_port):
    """The control: what the pools printed before (so the checks above can fail)."""
    done = _run(ACTOR, "loud", redis_server.url, dead_port)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "frame #" in done.stderr and len(done.stderr.splitlines()) > 20


def test_quiet_keeps_a_level_the_user_set():
    env = {ENV: "INFO"}
    quiet_cpp_logs(env)
    assert env[ENV] == "INFO"
    env = {}
    quiet_cpp_logs(env)
    assert env[ENV] == QUIET


def test_one_line_drops_a_cpp_backtrace():
    e = RuntimeError(
        "wait timeout after 1999ms, keys: /n/0/1\n"
        "Exception raised from throwTimeoutError at socket.cpp:1030 (most recent call first):\n"
        "frame #0: c10::Error::Error(...)\n"
    )
    assert one_line(e) == "RuntimeError: wait timeout after 1999ms, keys: /n/0/1"
    assert one_line(TimeoutError()) == "TimeoutError"
