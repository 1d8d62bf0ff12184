"""Saving a checkpoint from every rank, in the layout of pipeline/checkpoint.py.

Every rank takes part in :func:`save` (DeepSpeed writes one shard per rank into the
same folder, which must be shared); rank 0 then commits it
(:func:`pipeline.checkpoint.commit`: ``trainer_state.json`` last, the folder renamed
into place, the ``latest`` marker moved).
"""

from __future__ import annotations

import os
import shutil

from pipeline import checkpoint as layout
from trainer.ranks import Ranks, barrier


def save(ckpt_root: str, backend, state: dict, keep: int, ranks: Ranks) -> str:
    """Write the backend's state and ``state`` as the checkpoint of ``state["version"]``
    and return its folder (complete once rank 0 returns; the other ranks do not wait)."""
    tmp = layout.step_dir(ckpt_root, state["version"]) + ".tmp"
    if ranks.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(ranks)
    backend.save(tmp)
    barrier(ranks)
    if ranks.is_main:
        layout.commit(ckpt_root, tmp, state, keep)
    return layout.step_dir(ckpt_root, state["version"])
