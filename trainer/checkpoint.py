"""Checkpoints: the backend's model and optimizer state, an HF-format copy of
the weights, and the stream position plus dedupe window (``trainer_state.json``),
so a restart neither loses nor repeats data.

Every rank takes part in :func:`save` (DeepSpeed writes one shard per rank into
the same folder, which must be shared). Rank 0 writes ``trainer_state.json``
last, then renames the folder into place and moves the ``latest`` marker: a
crash at any point leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import os
import shutil

from trainer.ranks import Ranks, barrier

STATE_FILE = "trainer_state.json"


def save(ckpt_root: str, backend, state: dict, keep: int, ranks: Ranks) -> str:
    path = os.path.join(ckpt_root, f"step-{state['version']:06d}")
    tmp = path + ".tmp"
    if ranks.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(ranks)
    backend.save(tmp)
    barrier(ranks)
    if ranks.is_main:
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
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
    return path if os.path.isfile(os.path.join(path, STATE_FILE)) else None


def load_state(path: str) -> dict:
    """The trainer_state of a checkpoint folder (the backend restores its own part)."""
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)
