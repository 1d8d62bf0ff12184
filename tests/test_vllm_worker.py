"""The vLLM worker extension's CPU-testable parts, with a fake vLLM Worker: the
HF -> fused-layout plan, the per-forward-pass lock, staged receive with checksums,
the swap between two steps, lock deadlines, and per-request step versions.
What is not run here: vLLM itself, CUDA streams and events (see the gpu tests)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from actor.engines.vllm.worker.extension import LockedWeights, NonstopWorkerExtension, StepVersions
from actor.engines.vllm.worker.layout import build_plan
from pipeline.messages import encode
from tests.vllm_builders import (
    FakeVllmModel,
    announcement,
    hf_model,
    hf_state,
    sched,
    shard,
    vllm_layout,
)


class FakeWorker(NonstopWorkerExtension):
    """Like vLLM's Worker: execute_model (forward, returns None: sampling follows)
    then sample_tokens; each step reads every parameter (a checksum of the weights)."""

    parallel_config = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    rank = 0

    def __init__(self, model: FakeVllmModel, step_s: float = 0.0):
        self.model, self.step_s, self.seen = model, step_s, []

    def get_model(self):
        return self.model

    def execute_model(self, scheduler_output):
        self._weights = sum(float(p.sum()) for p in self.model.flat)
        time.sleep(self.step_s)
        return None

    def sample_tokens(self, grammar_output):
        time.sleep(self.step_s)
        self.seen.append(self._weights)  # the weights the forward of this step used
        return self._weights


class MemorySource:
    def __init__(self, flat, corrupt: int | None = None):
        self.flat, self.corrupt = flat, corrupt

    def fetch(self, index, out, deadline):
        out.copy_(self.flat[index])
        if index == self.corrupt:
            out[0] += 1.0

    def close(self):
        pass


def file_source(path: str, corrupt: int = -1) -> MemorySource:
    """A BucketSource factory named by module path, as the extension loads transports."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    flat = [tensors[f"b{i}"] for i in range(len(tensors))]
    return MemorySource(flat, corrupt if corrupt >= 0 else None)


@pytest.mark.parametrize("tie", [False, True])
def test_plan_puts_every_hf_tensor_in_the_fused_layout(tie):
    old, new = hf_state(hf_model(0, tie)), hf_state(hf_model(1, tie))
    live = vllm_layout(old)
    if tie:  # vLLM keeps lm_head.weight; the tied HF model has only the embedding
        live["lm_head.weight"] = live["model.embed_tokens.weight"].clone()
    plan = build_plan(
        {k: tuple(v.shape) for k, v in live.items()}, {k: tuple(v.shape) for k, v in new.items()}
    )
    for name, t in new.items():
        plan.scatter(name, t, live)
    want = vllm_layout(new)
    if tie:
        want["lm_head.weight"] = want["model.embed_tokens.weight"]
    for name in want:
        assert torch.equal(live[name], want[name]), name


def test_plan_refuses_a_model_it_cannot_map():
    hf = {k: tuple(v.shape) for k, v in hf_state(hf_model(0)).items()}
    live = {k: tuple(v.shape) for k, v in vllm_layout(hf_state(hf_model(0))).items()}
    live["model.layers.0.self_attn.qkv_proj.weight"] = (999, 32)
    with pytest.raises(ValueError, match="qkv_proj"):
        build_plan(live, hf)
    live = {k: tuple(v.shape) for k, v in vllm_layout(hf_state(hf_model(0))).items()}
    live["model.extra.weight"] = (4, 4)
    with pytest.raises(ValueError, match="model.extra.weight"):
        build_plan(live, hf)


def test_plan_shards_for_tensor_parallel_ranks():
    hf = hf_state(hf_model(0))
    full = vllm_layout(hf)
    for rank in range(2):
        shapes = {}
        for k, v in full.items():
            if k.endswith((".o_proj.weight", ".down_proj.weight")):
                shapes[k] = (v.shape[0], v.shape[1] // 2)
            elif v.dim() == 2 and not k.endswith(("norm.weight",)):
                shapes[k] = (v.shape[0] // 2, v.shape[1])
            else:
                shapes[k] = tuple(v.shape)
        plan = build_plan(shapes, {k: tuple(v.shape) for k, v in hf.items()}, rank, 2)
        dest = {k: torch.zeros(s) for k, s in shapes.items()}
        for name, t in hf.items():
            plan.scatter(name, t, dest)
        q = hf["model.layers.0.self_attn.q_proj.weight"]
        qkv = dest["model.layers.0.self_attn.qkv_proj.weight"]
        assert torch.equal(qkv[: q.shape[0] // 2], q.chunk(2)[rank])
        o = hf["model.layers.1.self_attn.o_proj.weight"]
        assert torch.equal(dest["model.layers.1.self_attn.o_proj.weight"], o.chunk(2, dim=1)[rank])


def test_swap_lands_between_steps_and_every_step_sees_one_whole_version():
    old, new = hf_state(hf_model(0)), hf_state(hf_model(1))
    worker = FakeWorker(FakeVllmModel(vllm_layout(old)), step_s=0.01)
    worker.nonstop_install(lock_timeout_s=5.0)
    weights = worker._nonstop
    totals = {sum(float(t.sum()) for t in vllm_layout(s).values()) for s in (old, new)}
    stop = threading.Event()

    def engine():
        while not stop.is_set():
            so = sched(cached=[("r-abcdefgh", 5)], scheduled={"r-abcdefgh": 1})
            worker.execute_model(so)
            worker.sample_tokens(None)

    t = threading.Thread(target=engine)
    t.start()
    ann, flat = announcement(1, new)
    weights.stage(ann, MemorySource(flat), time.monotonic() + 10)
    rec = weights.swap(1)
    time.sleep(0.1)
    stop.set()
    t.join()
    assert rec["hold_ms"] >= 0 and weights.live_version == 1
    assert all(min(abs(s - x) for x in totals) < 1e-3 for s in worker.seen), "a mixed step"
    versions = weights.steps.take(["r"])["r"]
    assert [v for v, _ in versions] == [0, 1]
    for name, t in vllm_layout(new).items():
        assert torch.equal(dict(worker.model.named_parameters())[name], t), name


def test_bad_checksum_or_a_held_lock_leaves_the_old_weights_whole(tmp_path):
    old, new = hf_state(hf_model(0)), hf_state(hf_model(1))
    worker = FakeWorker(FakeVllmModel(vllm_layout(old)))
    worker.nonstop_install(lock_timeout_s=0.2)
    ann, flat = announcement(1, new)
    path = str(tmp_path / "buckets.safetensors")
    save_file({f"b{i}": b for i, b in enumerate(flat)}, path)
    source = {"factory": "tests.test_vllm_worker:file_source", "path": path, "corrupt": 1}
    worker.nonstop_update(encode(ann), source)
    worker._nonstop_jobs.join()
    status = worker.nonstop_poll()
    assert status["failed"] == 1 and "checksum" in status["last_error"]
    assert status["live_version"] == 0 and status["swaps"] == []
    live = dict(worker.model.named_parameters())
    for name, t in vllm_layout(old).items():
        assert torch.equal(live[name], t), name

    # a forward pass that holds the lock past the deadline: the update fails, clearly
    worker._nonstop.lock.acquire()
    try:
        worker.nonstop_update(encode(ann), dict(source, corrupt=-1))
        worker._nonstop_jobs.join()
    finally:
        worker._nonstop.lock.release()
    status = worker.nonstop_poll()
    assert status["failed"] == 2 and "lock was not free" in status["last_error"]
    assert status["live_version"] == 0
    for name, t in vllm_layout(old).items():
        assert torch.equal(live[name], t), name

    worker.nonstop_update(encode(ann), dict(source, corrupt=-1))  # a good one goes through
    worker._nonstop_jobs.join()
    status = worker.nonstop_poll()
    assert status["live_version"] == 1 and len(status["swaps"]) == 1
    for name, t in vllm_layout(new).items():
        assert torch.equal(live[name], t), name


def test_step_versions_count_sampling_steps_only():
    steps = StepVersions()
    rid = "req7-0123abcd"
    steps.record(sched(new=[(rid, 10, 0)], scheduled={rid: 6}), 3)  # first prefill chunk
    steps.record(sched(cached=[(rid, 6)], scheduled={rid: 4}), 3)  # last chunk: samples
    steps.record(sched(cached=[(rid, 10)], scheduled={rid: 1}), 4)
    steps.record(sched(cached=[(rid, 11)], scheduled={rid: 1}, finished=[rid]), 4)
    runs = steps.take(["req7"])["req7"]
    assert runs == [[3, 1], [4, 2]]  # actor/engines/vllm/requests.py token_versions spreads them
    assert steps.take(["req7"]) == {}


def test_a_preempted_request_resent_as_new_is_counted_from_its_prefill_tokens():
    """Model runner V2 (CUDA: Llama from 0.24, every model from 0.32) re-sends a
    preempted request as a new one whose ``prefill_token_ids`` are prompt + sampled
    tokens; its recompute, chunked, samples once, at the last chunk. Counted from the
    prompt, the recompute chunks were taken for sampled steps (stamps inexact)."""
    steps = StepVersions()
    rid = "req8-0123abcd"
    steps.record(sched(new=[(rid, 10, 0)], scheduled={rid: 10}, prefill={rid: 10}), 1)
    for k in range(5):  # 5 decode steps: 15 tokens known
        steps.record(sched(cached=[(rid, 10 + k)], scheduled={rid: 1}), 1)
    steps.record(sched(preempted=[rid]), 1)  # its blocks freed; no tokens for it
    # re-sent as new under version 2: prompt 10 + 6 sampled = 16 tokens, in 3 chunks
    steps.record(sched(new=[(rid, 10, 0)], scheduled={rid: 6}, prefill={rid: 16}), 2)
    steps.record(sched(cached=[(rid, 6)], scheduled={rid: 6}), 2)
    steps.record(sched(cached=[(rid, 12)], scheduled={rid: 4}), 2)  # last chunk: samples
    steps.record(sched(cached=[(rid, 16)], scheduled={rid: 1}), 3)
    assert steps.take(["req8"])["req8"] == [[1, 6], [2, 1], [3, 1]]
    assert steps.preempted == 1 and steps.resumed == 1
    # model runner V1: resumed among the cached requests, recomputed from 0
    v1 = StepVersions()
    v1.record(sched(new=[(rid, 10, 0)], scheduled={rid: 10}), 1)
    v1.record(sched(cached=[(rid, 10)], scheduled={rid: 1}), 1)  # 12 known
    v1.record(sched(preempted=[rid]), 1)
    v1.record(sched(cached=[(rid, 0)], scheduled={rid: 8}, resumed=[rid]), 2)
    v1.record(sched(cached=[(rid, 8)], scheduled={rid: 4}), 2)  # last chunk: samples
    assert v1.take(["req8"])["req8"] == [[1, 2], [2, 1]]
    assert v1.resumed == 1


def test_staging_that_does_not_fit_beside_vllm_is_refused_with_the_arithmetic():
    """vLLM takes gpu_memory_utilization of the GPU (weights, activations, KV cache)
    before the extension installs; staging (the weights again) must fit in the rest.
    A 7.6B bf16 model (15.2 GB) at 0.9 of an 80 GiB H100: refused, saying how much
    is needed, how much is free and the utilization that would fit."""
    from actor.engines.vllm.worker.locked import check_staging_memory

    gib = 2**30
    check_staging_memory(int(3 * gib), free=int(10 * gib), total=80 * gib, utilization=0.9)
    with pytest.raises(ValueError) as e:
        check_staging_memory(int(15.2e9), free=int(7.5 * gib), total=80 * gib, utilization=0.9)
    line = str(e.value)
    assert "\n" not in line
    for part in ("needs 14.16 GiB", "= 14.66 GiB", "gpu_memory_utilization=0.9 of this GPU's "
                 "80.0 GiB only 7.50 GiB is free", "to at most 0.81"):  # fmt: skip
        assert part in line, line
    with pytest.raises(ValueError, match="cannot fit on this GPU"):
        check_staging_memory(90 * gib, free=gib, total=80 * gib, utilization=0.5)


def test_the_swap_is_enqueued_on_the_stream_the_last_step_ran_on():
    """The engine's stream is read at every execute_model entry, not once at install
    (vLLM 0.32+ moves the engine thread onto a stream of its own when it captures CUDA
    graphs): each swap record names the stream of the step before it. (On the CPU the
    streams are stand-ins; the CUDA half runs in the gpu tests.)"""
    worker = FakeWorker(FakeVllmModel(vllm_layout(hf_state(hf_model(0)))))
    worker.nonstop_install(lock_timeout_s=5.0)
    w = worker._nonstop
    streams = iter(["install", "s1", "s2"])
    w.stream_of = lambda: next(streams)
    w.compute = w.stream_of()
    so = sched(cached=[("r-abcdefgh", 5)], scheduled={"r-abcdefgh": 1})
    for version, stream in ((1, "s1"), (2, "s2")):
        worker.execute_model(so)
        worker.sample_tokens(None)
        ann, flat = announcement(version, hf_state(hf_model(version)))
        w.stage(ann, MemorySource(flat), time.monotonic() + 10)
        assert w.swap(version)["stream"] == stream


def test_the_old_version_is_freed_after_the_lock_is_released():
    """CPU: the swap exchanges pointers under the lock; the old version's tensors are
    freed after it is released (on the receiver thread: the engine may step
    meanwhile), and the record says how long that took (retire_ms)."""
    worker = FakeWorker(FakeVllmModel(vllm_layout(hf_state(hf_model(0)))))
    worker.nonstop_install(lock_timeout_s=5.0)
    w = worker._nonstop
    held_while_freeing = []

    class Probe:  # one of the retired objects: notes whether the lock is held when freed
        def __del__(self):
            held_while_freeing.append(w.lock.locked())

    ann, flat = announcement(1, hf_state(hf_model(1)))
    w.stage(ann, MemorySource(flat), time.monotonic() + 10)
    real = w.cpu.exchange
    w.cpu.exchange = lambda prep: [*real(prep), Probe()]
    rec = w.swap(1)
    assert held_while_freeing == [False] and rec["retire_ms"] >= 0


def test_destroy_worker_extension_tears_down_as_vllm_0_33_calls_it():
    """vLLM 0.33's WorkerWrapperBase.shutdown calls ``destroy_worker_extension`` found on
    the extension class with the Worker; the receiver thread ends, staging is dropped,
    and a second call does nothing."""
    worker = FakeWorker(FakeVllmModel(vllm_layout(hf_state(hf_model(0)))))
    before = set(threading.enumerate())
    worker.nonstop_install(lock_timeout_s=5.0)
    threads = [t for t in set(threading.enumerate()) - before if t.name == "nonstop-receiver"]
    assert len(threads) == 1
    hook = getattr(NonstopWorkerExtension, "destroy_worker_extension", None)
    assert callable(hook)
    hook(worker)
    worker._nonstop_jobs.join()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads) and worker._nonstop.staging is None
    hook(worker)


def test_locked_weights_refuse_non_contiguous_parameters():
    with pytest.raises(ValueError, match="contiguous"):
        LockedWeights([("w", torch.zeros(4, 4).t())], 1.0)


def test_worker_receives_a_version_over_the_gloo_transport_while_stepping():
    """The same channel code the trainer uses (pipeline/transfer): the worker connects
    in its own process space, receives bucket by bucket, checks sums, swaps."""
    from pipeline.transfer.gloo import GlooSender

    old, new = hf_state(hf_model(0)), hf_state(hf_model(1))
    worker = FakeWorker(FakeVllmModel(vllm_layout(old)), step_s=0.005)
    worker.nonstop_install(lock_timeout_s=5.0, transfer_timeout_s=20.0)
    sender = GlooSender("127.0.0.1", 20.0)
    deadline = time.monotonic() + 20
    accept = threading.Thread(target=sender.accept, args=("actor-0", "n1", deadline))
    accept.start()
    worker.nonstop_connect("gloo", sender.rendezvous(), "n1")
    accept.join()
    stop = threading.Event()

    def engine():
        while not stop.is_set():
            worker.execute_model(sched(cached=[("r-abcdefgh", 5)], scheduled={"r-abcdefgh": 1}))
            worker.sample_tokens(None)

    t = threading.Thread(target=engine)
    t.start()
    ann, flat = announcement(7, new)
    worker.nonstop_update(encode(ann))
    sent = sender.send(["actor-0"], 7, flat, time.monotonic() + 20)
    assert isinstance(sent["actor-0"], float), sent  # milliseconds, not an error
    worker._nonstop_jobs.join()
    stop.set()
    t.join()
    status = worker.nonstop_poll(["r"])
    assert status["failed"] == 0, status["last_error"]
    assert status["live_version"] == 7 and [v for v, _ in status["versions"]["r"]][-1] == 7
    live = dict(worker.model.named_parameters())
    for name, t in vllm_layout(new).items():
        assert torch.equal(live[name], t), name
    sender.close()


def finish(ids):
    """vLLM's step with no tokens scheduled that only says which requests finished."""
    return sched(finished=ids)


class FlushingWorker(FakeWorker):
    def execute_model(self, scheduler_output):  # gpu_model_runner: no tokens, no forward
        if scheduler_output.total_num_scheduled_tokens == 0:
            return "EMPTY_MODEL_RUNNER_OUTPUT"  # and sample_tokens is not called
        return super().execute_model(scheduler_output)


def test_zero_token_steps_retire_finished_requests_and_take_is_by_key():
    """vLLM calls execute_model with zero tokens to flush finished ids (the model runner
    returns an empty output, no sample_tokens follows): those steps must be recorded,
    or the finished requests' runs stay in the running table for ever."""
    worker = FlushingWorker(FakeVllmModel(vllm_layout(hf_state(hf_model(0)))))
    worker.nonstop_install(lock_timeout_s=1.0)
    w = worker._nonstop
    ids = [f"q{i}-{i:08d}" for i in range(50)]
    worker.execute_model(sched(new=[(r, 4, 0) for r in ids], scheduled={r: 4 for r in ids}))
    worker.sample_tokens(None)
    worker.execute_model(sched(cached=[(r, 4) for r in ids], scheduled={r: 1 for r in ids}))
    worker.sample_tokens(None)
    # the client collects the first 25 right after their final output: before vLLM
    # has told the workers (the next step), so they are still running here
    got = w.steps.take([f"q{i}" for i in range(25)])
    assert got == {f"q{i}": [[0, 2]] for i in range(25)}
    assert w.steps.sizes()["taken"] == 25
    # the flush: the empty output, and no sample_tokens
    assert worker.execute_model(finish(ids)) == "EMPTY_MODEL_RUNNER_OUTPUT"
    assert not w.lock.locked()
    # the taken ones are gone; the rest wait, finished, for their poll
    assert w.steps.sizes() == {"running": 0, "ids": 0, "taken": 0, "finished": 25, "evicted": 0}
    assert w.steps.take([f"q{i}" for i in range(25, 50)]) == {
        f"q{i}": [[0, 2]] for i in range(25, 50)
    }
    assert w.steps.sizes() == {"running": 0, "ids": 0, "taken": 0, "finished": 0, "evicted": 0}


def test_an_armed_tp_swap_is_refused_once_staging_is_written_again():
    """TP > 1: a swap asked for mid-step is armed and applied at the next execute_model
    entry. If a new version began staging meanwhile (the client timed out and moved
    on), the armed apply must not copy the half-written staging as the old version."""
    old, v1, v2 = (hf_state(hf_model(s)) for s in (0, 1, 2))
    worker = FakeWorker(FakeVllmModel(shard(old, 0, 2)))  # rank 0's shard, as tp_rank holds
    w = LockedWeights(list(worker.model.named_parameters()), 5.0, tp=(0, 2))
    w.wrap(worker)
    ann1, flat1 = announcement(1, v1)
    w.stage(ann1, MemorySource(flat1), time.monotonic() + 10)
    rid = "r-abcdefgh"
    worker.execute_model(sched(new=[(rid, 4, 0)], scheduled={rid: 4}))  # a step begins
    w.swap_between_steps(1)
    assert w.armed == 1 and w.live_version == 0  # mid-step: armed

    ann2, flat2 = announcement(2, v2)
    first_written, go_on = threading.Event(), threading.Event()

    class HalfSource(MemorySource):
        def fetch(self, index, out, deadline):
            super().fetch(index, out, deadline)
            if index == 0:
                first_written.set()
                assert go_on.wait(10)

    stager = threading.Thread(target=w.stage, args=(ann2, HalfSource(flat2), time.monotonic() + 10))
    stager.start()  # waits for the lock (the step holds it), then writes bucket 0
    worker.sample_tokens(None)
    assert first_written.wait(10)
    worker.execute_model(sched(cached=[(rid, 4)], scheduled={rid: 1}))  # the armed apply
    worker.sample_tokens(None)
    assert w.live_version == 0 and w.armed is None
    assert w.failed == 1 and "version 1 is not staged" in w.last_error
    live = dict(worker.model.named_parameters())
    for name, t in shard(old, 0, 2).items():
        assert torch.equal(live[name], t), name  # nothing of the half-written staging
    go_on.set()
    stager.join()
    assert w.staged_version == 2
    w.swap_between_steps(2)  # between steps: at once
    assert w.live_version == 2
    for name, t in shard(v2, 0, 2).items():
        assert torch.equal(live[name], t), name


class Clashing:
    def sample_tokens(self, grammar_output):  # a name vLLM's Worker has
        return None


def test_the_fake_loads_the_extension_as_vllm_does():
    """vLLM 0.32 (v1/worker/worker_base.py) appends the extension to the Worker's bases
    after asserting that no attribute clashes; the fake does the same."""
    from tests import vllm_fake

    worker_cls = type("Worker", (vllm_fake.FakeWorkerBase,), {})
    vllm_fake.inject_extension(
        worker_cls, "actor.engines.vllm.worker.extension.NonstopWorkerExtension"
    )
    assert worker_cls.__mro__[1:3] == (vllm_fake.FakeWorkerBase, NonstopWorkerExtension)
    clash = type("Worker", (vllm_fake.FakeWorkerBase,), {})
    with pytest.raises(AssertionError, match="sample_tokens"):
        vllm_fake.inject_extension(clash, "tests.test_vllm_worker.Clashing")


def test_a_join_never_stops_the_engine_loop():
    """nonstop_connect returns at once; the handshake (here: a trainer that never
    accepts) runs on the receiver thread while the engine steps, and its outcome is
    polled."""
    from pipeline.transfer.gloo import GlooSender

    worker = FakeWorker(FakeVllmModel(vllm_layout(hf_state(hf_model(0)))))
    worker.nonstop_install(lock_timeout_s=1.0, transfer_timeout_s=1.5)
    sender = GlooSender("127.0.0.1", 5.0)  # it never accepts this join
    t0 = time.monotonic()
    worker.nonstop_connect("gloo", sender.rendezvous(), "n-late")
    assert time.monotonic() - t0 < 0.5
    assert worker.nonstop_poll()["channel"] == {
        "nonce": "n-late",
        "state": "connecting",
        "error": "",
    }
    steps = 0
    while worker.nonstop_poll()["channel"]["state"] == "connecting":
        worker.execute_model(sched(cached=[("r-abcdefgh", 5)], scheduled={"r-abcdefgh": 1}))
        worker.sample_tokens(None)
        steps += 1
        time.sleep(0.01)
        assert time.monotonic() - t0 < 30
    assert steps > 20  # the engine stepped all along
    channel = worker.nonstop_poll()["channel"]
    assert channel["nonce"] == "n-late" and channel["state"] == "failed" and channel["error"]
    sender.close()
