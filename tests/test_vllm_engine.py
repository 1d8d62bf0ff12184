"""actor/engines/vllm/client.py against a fake AsyncLLM (tests/vllm_fake.py, written from
vLLM 0.24.0's and 0.32.0's source) whose engine-core thread drives the real worker extension:
requests held in flight, per-token versions across a swap, lock vs pause call
sequences, a lock timeout, prefix-cache salting, and the clear error without vLLM.
On real vLLM (the CPU build): tests/test_vllm_client_real.py and the other *_real.py;
on a GPU: tests/test_vllm_gpu.py."""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from actor.engines.vllm.client import VLLMEngine, load_vllm
from actor.engines.vllm.requests import token_versions
from pipeline.config import VLLM_MISSING
from pipeline.transfer import TensorSource
from tests import vllm_fake
from tests.vllm_builders import (
    announcement,
    gpu_settings,
    hf_model,
    hf_state,
    new_version,
    prompts,
    settings,
    vllm_layout,
)


@pytest.fixture
def make():
    engines = []

    def build(update_mode="lock", step_s=0.002, **kw):
        vllm_fake.AsyncLLM.model_tensors = vllm_layout(hf_state(hf_model(0)))
        vllm_fake.AsyncLLM.step_s = step_s
        engine = VLLMEngine(
            "unused-folder",
            None,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            settings=settings(**kw),
            update_mode=update_mode,
            api=vllm_fake.API,
        )
        engines.append(engine)
        return engine, vllm_fake.AsyncLLM.last

    yield build
    for e in engines:
        e.close()


def test_in_flight_count_is_held_at_the_configured_number(make):
    engine, fake = make(in_flight=8, step_s=0.003)
    outs = engine.generate(prompts(40), max_new_tokens=6)
    assert [len(o.tokens) for o in outs] == [6] * 40
    log = fake.core.active_log
    assert max(r for r, _ in log) == 8 and engine.in_flight_peak == 8
    # while prompts remain, a finished request is replaced before the next steps
    busy = [r for r, _ in log[: len(log) - 8]]
    assert sum(r == 8 for r in busy) >= 0.8 * len(busy), busy


def test_versions_are_stamped_per_token_across_a_swap(make):
    engine, fake = make(in_flight=16, step_s=0.01)
    ann, flat = announcement(1, hf_state(hf_model(1)))
    engine.stage(ann, TensorSource(flat), time.monotonic() + 60)  # staging takes its time
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("outs", engine.generate(prompts(16), 40)))
    t.start()
    time.sleep(0.15)
    engine.swap(1)  # mid-generation: 40 steps of 10 ms
    t.join()
    outs = result["outs"]
    assert engine.version == 1 and engine.stats.swaps == 1
    mixed = [o for o in outs if o.versions[0] == 0 and o.versions[-1] == 1]
    assert mixed, [o.versions for o in outs]
    # every stamp is the version of the step that sampled that token (the fake's record)
    ids = [f"nonstop{engine._ids.prefix}-{n}" for n in range(1, 17)]
    assert [o.versions for o in outs] == [fake.core.truth[i] for i in ids]
    assert all(len(o.versions) == len(o.tokens) == 40 for o in outs)
    after = engine.generate(prompts(4), 5)
    assert all(o.versions == [1] * 5 for o in after)


def test_a_request_cancelled_while_being_added_is_aborted(make):
    """vLLM's generate aborts a cancelled request only once add_request has returned; one
    cancelled while being added (already sent to the core) is aborted by the engine
    itself (client._abort_request), so nothing runs on past abort_open. On real vLLM:
    tests/test_vllm_client_real.py."""
    engine, fake = make(in_flight=8, step_s=0.01)
    for round_ in range(5):
        for k in range(3):
            engine.submit((round_, k), prompts(4), 200)  # 2 s each if left running
        time.sleep(0.001 * round_)
        assert engine.abort_open() == 3
        # served on the core thread after every add and abort sent before it
        left = fake.core.utility(lambda: [r.rid for r in fake.core.waiting + fake.core.running])
        assert left.result(timeout=5) == [], round_


def test_lock_and_pause_modes_call_vllm_differently(make):
    for mode in ("lock", "pause"):
        engine, fake = make(update_mode=mode)
        calls = fake.core.calls
        start = len(calls)
        new_version(engine, 1, seed=1)
        seq = [c for c in calls[start:] if c != "nonstop_poll"]
        if mode == "lock":
            assert seq == ["nonstop_update", "nonstop_swap"], seq
            assert engine.stats.recent_swaps[-1].mode == "staged"
        else:
            assert seq == [
                "nonstop_update",
                "pause_generation(mode=keep,clear_cache=False)",
                "nonstop_swap_paused",
                "resume_generation",
            ], seq
            assert engine.stats.recent_swaps[-1].mode == "pause"
        outs = engine.generate(prompts(4), 5)
        assert all(o.versions == [1] * 5 for o in outs)
        live = dict(fake.worker.get_model().named_parameters())
        for name, t in vllm_layout(hf_state(hf_model(1))).items():
            assert torch.equal(live[name], t), name


def test_lock_timeout_fails_the_update_and_generation_goes_on(make):
    engine, fake = make(lock_timeout_s=0.3)
    ann, flat = announcement(1, hf_state(hf_model(1)))
    engine.stage(ann, TensorSource(flat), time.monotonic() + 20)
    lock = fake.worker._nonstop.lock
    lock.acquire()  # a forward pass that will not end in time
    try:
        with pytest.raises(RuntimeError, match="lock was not free"):
            engine.swap(1)
    finally:
        lock.release()
    assert engine.version == 0
    outs = engine.generate(prompts(4), 5)
    assert all(o.versions == [0] * 5 for o in outs)
    live = dict(fake.worker.get_model().named_parameters())
    for name, t in vllm_layout(hf_state(hf_model(0))).items():
        assert torch.equal(live[name], t), name
    engine.swap(1)  # the staged copy is still whole: the next try goes through
    assert engine.version == 1
    assert all(o.versions == [1] * 5 for o in engine.generate(prompts(4), 5))


def test_no_request_under_a_new_version_hits_a_block_computed_under_the_old(make):
    engine, fake = make(in_flight=4)
    shared = prompts(8, length=13, shared=True)  # 3 full blocks each, the same tokens
    engine.generate(shared, 3)
    hits0 = list(fake.core.hits)
    assert hits0 and all(v == 0 for _, v in hits0)  # caching works within a version
    new_version(engine, 1, seed=1)
    outs = engine.generate(shared, 3)
    later = fake.core.hits[len(hits0) :]
    assert later, "the new version's requests share blocks among themselves"
    assert all(v == 1 for _, v in later), later  # never a block computed under version 0
    assert {s for s, _ in later}.isdisjoint({s for s, _ in hits0})
    assert all(o.versions[0] == 1 for o in outs)


def test_without_prefix_caching_no_salt_is_sent(make):
    engine, fake = make(enable_prefix_caching=False)
    engine.generate(prompts(4, length=13, shared=True), 2)
    assert fake.core.hits == []


def test_missing_vllm_gives_the_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(ValueError) as e:
        load_vllm()
    assert str(e.value) == VLLM_MISSING
    assert "make setup-vllm" in VLLM_MISSING and "pip install -e '.[vllm]'" in VLLM_MISSING


def test_token_versions_are_exact_or_lower_bounds_and_say_which():
    runs = [[3, 1], [4, 2]]  # the worker's record: version 3 for one step, then 4 for two
    assert token_versions(runs, 3) == ([3, 4, 4], True)
    # fewer steps than tokens: the missing earliest get the oldest version possible
    assert token_versions(runs, 4) == ([3, 3, 4, 4], False)
    assert token_versions(runs, 4, floor=2) == ([2, 3, 4, 4], False)
    # more steps than tokens (a step after the last token): the first ones, never newer
    assert token_versions(runs, 2) == ([3, 4], False)
    # no record at all: the version live when the request was submitted, else 0
    assert token_versions([], 3, floor=5) == ([5, 5, 5], False)
    assert token_versions([], 2) == ([0, 0], False)
    assert token_versions([], 0) == ([], True)


def test_the_engine_asks_vllm_for_no_async_scheduling(make):
    engine, fake = make()
    assert fake.args.async_scheduling is False
    fake.vllm_config.scheduler_config.async_scheduling = True  # as if vLLM ignored it
    with pytest.raises(ValueError, match="async scheduling"):
        VLLMEngine(
            "unused-folder",
            None,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            settings=settings(),
            api=_always_async(),
        )


def _always_async():
    """vllm_fake's API whose AsyncLLM resolves async scheduling on whatever is asked."""

    class AsyncLLM(vllm_fake.AsyncLLM):
        def __init__(self, args):
            super().__init__(args)
            self.vllm_config.scheduler_config.async_scheduling = True

    return SimpleNamespace(**{**vars(vllm_fake.API), "AsyncLLM": AsyncLLM})


def test_the_gpu_tests_settings_start_an_engine_here():
    """The GPU tests' set-up as far as the CPU goes: their settings (gpu_settings: the
    project's VLLMConfig, every field, validated) start the engine (a fake vLLM
    here), so a field they lack fails CI, not the GPU host (it did: AttributeError)."""
    from dataclasses import asdict

    def start(s):
        vllm_fake.AsyncLLM.model_tensors = vllm_layout(hf_state(hf_model(0)))
        return VLLMEngine("unused-folder", None, temperature=1.0, top_p=1.0, top_k=0,
                          settings=s, api=vllm_fake.API)  # fmt: skip

    built = gpu_settings(enforce_eager=True)
    engine = start(built)
    try:
        assert engine.info["params"] > 0
        assert vllm_fake.AsyncLLM.last.args.gpu_memory_utilization == 0.3
        assert [len(o.tokens) for o in engine.generate(prompts(4), 5)] == [5] * 4
    finally:
        engine.close()
    bad = asdict(built)
    del bad["allow_untested_version"]
    with pytest.raises(AttributeError, match="allow_untested_version"):
        start(SimpleNamespace(**bad))  # hand-built settings without it: the GPU host's error
    with pytest.raises(ValueError, match="actor.vllm.in_flight=200 > actor.vllm.max_num_seqs"):
        gpu_settings(in_flight=200)
    with pytest.raises(ValueError, match=r"actor.vllm.cpu_kv_cache_gib=-1.0 must be >= 0"):
        gpu_settings(cpu_kv_cache_gib=-1)
    for nap in (-1, "fast"):
        with pytest.raises(ValueError, match=r"actor.vllm.queue_nap_us=.*whole microseconds"):
            gpu_settings(queue_nap_us=nap)
    with pytest.raises(ValueError, match="queue_nap_us"):  # OmegaConf's own type check
        gpu_settings(queue_nap_us=0.5)
    assert gpu_settings(queue_nap_us=0).queue_nap_us == 0


def test_error_and_abort_finishes_are_failed_requests_never_completions(make):
    """vLLM ends a request with finish_reason ``error`` (e.g. a KV load failure) or
    ``abort``: its unit is dropped as failed in streaming (never trained on), and a
    batch raises."""
    engine, fake = make(in_flight=8)
    fake.core.forced_reasons = {50: "error", 60: "abort"}
    good, bad = [[1, 2, 3]] * 2, [[50, 2, 3], [1, 2, 3]]
    engine.submit("good", good, 4)
    engine.submit("bad", bad, 4)
    engine.submit("aborted", [[60, 1]], 4)
    got, deadline = {}, time.monotonic() + 30
    while engine.held_units and time.monotonic() < deadline:
        got.update(dict(engine.take(0.5)))
    assert list(got) == ["good"] and [len(c.tokens) for c in got["good"]] == [4, 4]
    assert engine.units_failed == 2
    with pytest.raises(RuntimeError, match="finish_reason=error"):
        engine.generate(bad, 4)


def test_a_quantized_checkpoint_is_refused_in_one_line_before_vllm_starts(tmp_path):
    import json

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "fp8"}})
    )
    with pytest.raises(ValueError) as e:
        VLLMEngine(str(tmp_path), None, temperature=1.0, top_p=1.0, top_k=0,
                   settings=settings(), api=vllm_fake.API)  # fmt: skip
    line = str(e.value)
    assert "\n" not in line and "quantization_config: fp8" in line and "model.name" in line
