"""Shared by the benchmarks: percentiles, the device label, the table printer, the JSON writer."""

from __future__ import annotations

import json
import os
import platform

import numpy as np
import torch


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


def device_name(device: str | torch.device = "cpu") -> str:
    """Where the measured work ran: the GPU's name for a CUDA device, else the CPU
    (a CPU measurement on a machine that also has a GPU says cpu)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device.index or 0)
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
