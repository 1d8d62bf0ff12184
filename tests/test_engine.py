"""The hf engine: log-probs the trainer can reproduce, and weights swapped in flight."""

import importlib.util
import threading
import time

import pytest
import torch

from actor.engines import make_engine
from actor.engines.hf import HFEngine
from pipeline.config import VLLM_MISSING
from pipeline.logprobs import completion_logprobs, pad_sequences
from pipeline.messages import SCHEMA_VERSION, WeightAnnouncement
from pipeline.models import load_model, materialize_model
from pipeline.transfer import TensorSource
from pipeline.transfer.buckets import bucket_layout, bucket_sums, flatten


def _engine(tmp_path, **kw):
    model, tok = load_model(materialize_model("tiny", cache_dir=str(tmp_path)))
    args = dict(temperature=0.7, top_p=1.0, top_k=0, seed=1)
    args.update(kw)
    return HFEngine(model, tok, **args), tok


def _prompts(tok):
    texts = ["What is 2 + 3?", "Hi", "A much longer prompt than the others, 12 + 30 = ?"]
    return [tok(t)["input_ids"] for t in texts]


def _check_trainer_agrees(engine, prompts, outs, **sampling):
    comps = [torch.tensor(o.tokens).numpy() for o in outs]
    ids, attn, comp = pad_sequences([torch.tensor(p).numpy() for p in prompts], comps)
    with torch.no_grad():
        lp = completion_logprobs(engine.model, ids, attn, comp, **sampling)
    for row, o in enumerate(outs):
        torch.testing.assert_close(
            lp[row][comp[row]], torch.tensor(o.logprobs), atol=2e-4, rtol=1e-4
        )


def test_recorded_logprobs_match_a_full_forward(tmp_path):
    engine, tok = _engine(tmp_path)
    prompts = _prompts(tok)
    outs = engine.generate(prompts, max_new_tokens=16)
    assert all(len(o.tokens) == len(o.logprobs) == len(o.versions) for o in outs)
    _check_trainer_agrees(engine, prompts, outs, temperature=0.7)


def test_logprobs_match_under_top_k_and_top_p(tmp_path):
    engine, tok = _engine(tmp_path, top_k=20, top_p=0.9)
    prompts = _prompts(tok)
    outs = engine.generate(prompts, max_new_tokens=12)
    _check_trainer_agrees(engine, prompts, outs, temperature=0.7, top_p=0.9, top_k=20)


def _new_version(engine, version: int, delta: float, bucket_bytes: int = 1 << 16):
    named = list(engine.model.named_parameters())
    layout = bucket_layout(named, bucket_bytes)
    new = flatten({n: p.detach() + delta for n, p in named}, layout)
    ann = WeightAnnouncement(
        schema=SCHEMA_VERSION,
        version=version,
        dtype="float32",
        buckets=layout,
        **bucket_sums(new),
        targets=["actor-0"],
    )
    return ann, new


def test_swap_lands_between_forward_passes_and_sequences_continue(tmp_path):
    engine, tok = _engine(tmp_path)
    engine.stop_ids = set()  # run every sequence to the token limit
    ann, new = _new_version(engine, 7, 0.01)
    layout = ann.buckets
    before = next(engine.model.parameters()).detach().clone()
    result = {}

    def generate():
        result["outs"] = engine.generate(_prompts(tok), max_new_tokens=64)

    t = threading.Thread(target=generate)
    t.start()
    while engine.stats.forward_passes < 8:
        time.sleep(0.001)
    engine.stage(ann, TensorSource(new), time.monotonic() + 10)  # while generating
    engine.swap(7)
    t.join()
    for o in result["outs"]:
        assert len(o.tokens) == 64
        assert o.versions[0] == 0 and o.versions[-1] == 7
        assert o.versions == sorted(o.versions)
    first = layout[0].params[0]
    installed = dict(engine.model.named_parameters())[first.name]
    torch.testing.assert_close(installed.data, before + 0.01)
    assert engine.version == 7 and engine.stats.swaps == 1


class SlowSource(TensorSource):
    """Buckets that take ``delay_s`` each to arrive; optionally fail at bucket ``fail_at``."""

    def __init__(self, buckets, delay_s: float, fail_at: int | None = None):
        super().__init__(buckets)
        self.delay_s, self.fail_at = delay_s, fail_at

    def fetch(self, index, out, deadline):
        time.sleep(self.delay_s)
        if index == self.fail_at:
            raise ConnectionError("trainer went away mid-transfer")
        super().fetch(index, out, deadline)


def test_in_place_update_records_its_whole_lock_hold_as_the_swap(tmp_path):
    engine, tok = _engine(tmp_path)
    engine.stop_ids = set()
    ann, new = _new_version(engine, 3, 0.02, bucket_bytes=1 << 14)
    assert len(ann.buckets) >= 3
    stop = threading.Event()

    def generate():
        while not stop.is_set():
            engine.generate(_prompts(tok), max_new_tokens=8)

    t = threading.Thread(target=generate)
    t.start()
    try:
        while engine.stats.forward_passes < 4:
            time.sleep(0.001)
        engine.update_in_place(ann, SlowSource(new, delay_s=0.05), time.monotonic() + 10)
        passes = engine.stats.forward_passes
        time.sleep(0.2)
        assert engine.stats.forward_passes > passes  # generation resumed
    finally:
        stop.set()
        t.join()
    (record,) = engine.stats.recent_swaps
    assert record.mode == "in-place" and record.version == 3
    assert record.ms >= 0.05 * len(ann.buckets) * 1000  # the receive happened under the lock
    assert engine.stats.swap_ms == [record.ms] and engine.version == 3
    # the generation pause around the update is at least that hold
    starts_ends = list(engine.stats.timeline)
    applied = engine.stats.version_times[-1]
    gap = min(b[0] for b in starts_ends if b[0] > applied) - max(
        a[1] for a in starts_ends if a[1] < applied
    )
    assert gap * 1000 >= record.ms


def test_failed_in_place_update_is_recorded_and_blocks_generation(tmp_path):
    engine, tok = _engine(tmp_path)
    ann, new = _new_version(engine, 4, 0.02, bucket_bytes=1 << 14)
    with pytest.raises(ConnectionError):
        engine.update_in_place(ann, SlowSource(new, 0.01, fail_at=1), time.monotonic() + 10)
    assert engine.version is None  # partial weights: nothing may generate
    (record,) = engine.stats.recent_swaps
    assert record.version is None and record.ms >= 10 and engine.stats.swaps == 0
    engine.update_in_place(ann, TensorSource(new), time.monotonic() + 10)
    assert engine.version == 4 and engine.stats.swaps == 1 and engine.stats.swap_events == 2
    assert len(engine.generate(_prompts(tok), max_new_tokens=2)) == 3


def test_swap_without_a_staged_version_is_refused(tmp_path):
    engine, _ = _engine(tmp_path)
    ann, new = _new_version(engine, 5, 0.0)
    with pytest.raises(RuntimeError, match="not staged"):
        engine.swap(5)
    engine.stage(ann, TensorSource(new), time.monotonic() + 10)
    with pytest.raises(RuntimeError, match="not staged"):
        engine.swap(6)


def test_swap_history_is_bounded_and_counted(tmp_path):
    engine, _ = _engine(tmp_path)
    stats = engine.stats
    for i in range(stats.recent_swaps.maxlen + 10):
        stats.add_swap(time.perf_counter(), i, "staged")
    assert len(stats.recent_swaps) == stats.recent_swaps.maxlen
    assert stats.swaps == stats.swap_events == stats.recent_swaps.maxlen + 10
    new, total = stats.swaps_since(stats.swap_events - 3)
    assert [r.version for r in new] == [total - 3, total - 2, total - 1]


def test_stop_tokens_end_rows_and_mark_them_finished(tmp_path):
    engine, tok = _engine(tmp_path, temperature=1.0)
    vocab = engine.model.config.vocab_size
    engine.stop_ids = set(range(vocab // 2))  # about half of all draws stop a row
    outs = engine.generate(_prompts(tok), max_new_tokens=40)
    for o in outs:
        stopped_at = [i for i, t in enumerate(o.tokens) if t in engine.stop_ids]
        assert o.finished == bool(stopped_at)
        if stopped_at:
            assert stopped_at == [len(o.tokens) - 1]  # nothing after the stop token
        assert len(o.tokens) == len(o.logprobs) == len(o.versions) <= 40
    assert engine.stats.tokens == sum(len(o.tokens) for o in outs)


def test_make_engine_builds_the_engine_the_config_names(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from pipeline.config import Config

    path = materialize_model("tiny", cache_dir=str(tmp_path))
    cfg = OmegaConf.structured(Config)
    cfg.actor.engine = "tgi"
    with pytest.raises(ValueError, match="use one of"):
        make_engine(cfg, path, seed=0)
    cfg.actor.engine = "hf"
    engine = make_engine(cfg, path, seed=0)
    assert isinstance(engine, HFEngine) and engine.tokenizer is not None
    assert engine.temperature == cfg.sampling.temperature and engine.kind == "full"
    cfg.model.lora.rank = 4  # the trainer's version-0 adapter on the hf engine
    assert make_engine(cfg, path, seed=0).kind == "lora"
    cfg.actor.engine = "vllm"  # without vLLM: the clear error (with it: test_vllm_client_real)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ValueError) as e:
        make_engine(cfg, path, seed=0)
    assert e.value.args[0] == VLLM_MISSING


def test_config_picks_the_engine_with_actor_engine(tmp_path):
    from pipeline.config import load_config

    path = tmp_path / "config.yaml"
    path.write_text("actor:\n  engine: vllm\n")
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ValueError, match="actor.engine=vllm"):
            load_config(str(path))
    else:  # a tested vLLM (the version check: test_vllm_client_real)
        assert load_config(str(path)).actor.engine == "vllm"
    path.write_text("engine:\n  kind: hf\n")
    with pytest.raises(ValueError, match="replaced by actor.engine"):
        load_config(str(path))
    path.write_text("weights:\n  transport: carrier-pigeon\n")
    with pytest.raises(ValueError, match="weights.transport"):
        load_config(str(path))
    path.write_text("actor:\n  engine: hf\n")
    assert load_config(str(path)).actor.engine == "hf"


def test_added_gap_is_the_pause_around_a_version_less_the_usual_gap():
    """What ``nonstop_swap_added_gap_seconds`` observes (pipeline/telemetry.py): passes
    every 10 ms (2 ms gaps), a version at 0.0405 with the next pass 12 ms after the last
    one: gap 12 ms, usual 2 ms, added 10 ms; not measurable yet before the next pass
    starts; not measured when generation restarted of its own in the gap (a new batch)."""
    from actor.engines.base import EngineStats
    from pipeline.telemetry import added_gap

    passes = [(0.01 * i, 0.01 * i + 0.008) for i in range(5)]  # ends at 0.048
    gap = added_gap(passes, 0.0405, [])
    assert gap is None  # no pass after it yet
    passes.append((0.060, 0.068))
    gap = added_gap(passes, 0.0485, [])
    assert gap.ms == pytest.approx(12) and gap.usual_ms == pytest.approx(2)
    assert gap.added_ms == pytest.approx(10)
    assert added_gap(passes, 0.0485, [0.055]).ms is None  # a batch began in the gap
    assert added_gap(passes, -1.0, []).ms is None  # nothing ran before it
    stats = EngineStats()
    stats.timeline.extend(passes[:5])
    stats.new_version()  # now: after every pass
    assert stats.gaps_since(0) == ([], 0)  # measured once a pass follows
    start = time.perf_counter()
    stats.timeline.append((start, start + 0.001))
    (g,), seen = stats.gaps_since(0)
    assert seen == 1 and g.ms > 0 and stats.gaps_since(seen) == ([], 1)
