"""Model materialization: the tiny model, caching, loading and bad input."""

import pytest
import torch
from safetensors.torch import load_file

from pipeline.models import TINY_MODEL, load_model, materialize_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return materialize_model(TINY_MODEL, cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_tiny_model_loads_and_generates(tiny_path):
    model, tokenizer = load_model(tiny_path)
    assert not model.training
    assert tokenizer.pad_token is not None and tokenizer.eos_token == "<|im_end|>"
    assert 90 <= len(tokenizer) <= 120
    ids = tokenizer("What is 2 + 3?", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids["input_ids"].shape[1] + 5)


def test_tiny_model_is_deterministic_and_cached(tiny_path, tmp_path):
    again = materialize_model(TINY_MODEL, cache_dir=str(tmp_path))
    assert again != tiny_path
    first, second = (
        load_file(f"{tiny_path}/model.safetensors"),
        load_file(f"{again}/model.safetensors"),
    )
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert materialize_model(TINY_MODEL, cache_dir=str(tmp_path)) == again


def test_tiny_chat_template_round_trips(tiny_path):
    _, tokenizer = load_model(tiny_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1 + 1?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_local_folder_is_returned_as_is(tiny_path):
    assert materialize_model(tiny_path) == tiny_path


def test_bad_specs_raise_value_error(tmp_path, monkeypatch):
    monkeypatch.setenv("NONSTOP_NO_HUB", "1")
    with pytest.raises(ValueError, match="config.json"):
        materialize_model(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        materialize_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no-such/model"):
        materialize_model("no-such/model", cache_dir=str(tmp_path))


def test_unknown_dtype_names_the_allowed_ones(tiny_path):
    with pytest.raises(ValueError, match="float32"):
        load_model(tiny_path, dtype="float8")
