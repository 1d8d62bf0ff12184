"""The checkpoint layout: where a run's checkpoints are and what each one holds.

::

    RUN_DIR/checkpoints/
        step-NNNNNN/          one per saved trainer step (NNNNNN: the policy version)
            ...               the backend's model and optimizer state and an HF-format
                              copy of the weights (trainer/backends/)
            trainer_state.json  the stream position and dedupe window (STATE_FILE),
                              written last
        step-NNNNNN.tmp/      one being written; never read
        latest                the name of the newest complete step folder

The trainer writes a checkpoint (trainer/checkpoint.py: every rank writes its part into
the ``.tmp`` folder), then :func:`commit` on rank 0 writes ``trainer_state.json`` last,
renames the folder into place and moves the ``latest`` marker: a crash at any point
leaves the previous checkpoint as the latest. The readers (the trainer resuming, the
evaluation, the summary) find it with :func:`latest` and read it with
:func:`load_state`, so a restart neither loses nor repeats data.
"""

from __future__ import annotations

import json
import os
import shutil

STATE_FILE = "trainer_state.json"
LATEST = "latest"


def step_dir(ckpt_root: str, version: int) -> str:
    """The folder of the checkpoint of policy version ``version``."""
    return os.path.join(ckpt_root, f"step-{version:06d}")


def commit(ckpt_root: str, tmp: str, state: dict, keep: int) -> str:
    """Finish a checkpoint whose backend files are in ``tmp``: write ``state`` into it,
    rename it into place, point ``latest`` at it and drop all but the ``keep`` newest."""
    path = step_dir(ckpt_root, state["version"])
    with open(os.path.join(tmp, STATE_FILE), "w") as f:
        json.dump(state, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    marker = os.path.join(ckpt_root, LATEST)
    with open(marker + ".tmp", "w") as f:
        f.write(os.path.basename(path))
    os.replace(marker + ".tmp", marker)
    for old in sorted(
        d for d in os.listdir(ckpt_root) if d.startswith("step-") and not d.endswith(".tmp")
    )[:-keep]:
        shutil.rmtree(os.path.join(ckpt_root, old), ignore_errors=True)
    return path


def latest(ckpt_root: str) -> str | None:
    """The newest complete checkpoint folder under ``ckpt_root``, or None."""
    marker = os.path.join(ckpt_root, LATEST)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        path = os.path.join(ckpt_root, f.read().strip())
    return path if os.path.isfile(os.path.join(path, STATE_FILE)) else None


def load_state(path: str) -> dict:
    """The trainer_state of a checkpoint folder (the backend restores its own part)."""
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)
