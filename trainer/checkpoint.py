"""Checkpoints: HF-format safetensors model, optimizer state, and the stream
position (``trainer_state.json``), so a restart neither loses nor repeats data."""

from __future__ import annotations

import json
import os
import shutil

import torch


def save(ckpt_root: str, model, tokenizer, optimizer, state: dict, keep: int) -> str:
    path = os.path.join(ckpt_root, f"step-{state['version']:06d}")
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump(state, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    with open(os.path.join(ckpt_root, "latest.tmp"), "w") as f:
        f.write(os.path.basename(path))
    os.replace(os.path.join(ckpt_root, "latest.tmp"), os.path.join(ckpt_root, "latest"))
    for old in sorted(
        d for d in os.listdir(ckpt_root) if d.startswith("step-") and not d.endswith(".tmp")
    )[:-keep]:
        shutil.rmtree(os.path.join(ckpt_root, old), ignore_errors=True)
    return path


def latest(ckpt_root: str) -> str | None:
    marker = os.path.join(ckpt_root, "latest")
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        path = os.path.join(ckpt_root, f.read().strip())
    return path if os.path.isdir(path) else None


def load_state(path: str, optimizer) -> dict:
    """Restore the optimizer (weights_only: no pickle) and return trainer_state."""
    optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)
