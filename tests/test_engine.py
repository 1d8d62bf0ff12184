"""The hf engine: log-probs the trainer can reproduce, and weights swapped in flight."""

import threading
import time

import torch

from actor.engine import HFEngine
from pipeline.logprobs import completion_logprobs, pad_sequences
from pipeline.models import load_model, materialize_model
from pipeline.weights import bucket_layout, flatten


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


def test_swap_lands_between_forward_passes_and_sequences_continue(tmp_path):
    engine, tok = _engine(tmp_path)
    engine.stop_ids = set()  # run every sequence to the token limit
    named = list(engine.model.named_parameters())
    layout = bucket_layout(named, bucket_bytes=1 << 16)
    new = flatten({n: p.detach() + 0.01 for n, p in named}, layout)
    before = named[0][1].detach().clone()
    result = {}

    def generate():
        result["outs"] = engine.generate(_prompts(tok), max_new_tokens=64)

    t = threading.Thread(target=generate)
    t.start()
    while engine.stats.forward_passes < 8:
        time.sleep(0.001)
    engine.swap(7, layout, new)
    t.join()
    for o in result["outs"]:
        assert len(o.tokens) == 64
        assert o.versions[0] == 0 and o.versions[-1] == 7
        assert o.versions == sorted(o.versions)
    first = layout[0].params[0]
    installed = dict(engine.model.named_parameters())[first.name]
    torch.testing.assert_close(installed.data, before + 0.01)
    assert engine.version == 7 and engine.stats.swaps == 1
