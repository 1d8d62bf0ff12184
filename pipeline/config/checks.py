"""What the sections' checks share: a dotted lookup, the one-line checks for a value
from a list or a positive number (each ValueError names the key), and a pool's device
and dtype (``actor``, ``preprocessor`` and ``trainer`` each have both)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf


def get(cfg: Any, dotted: str) -> Any:
    """``cfg``'s value at ``dotted`` (``"redis.tls.enabled"``), None where it is unset."""
    return OmegaConf.select(cfg, dotted)


def check_choice(cfg: Any, key: str, allowed: tuple) -> None:
    if get(cfg, key) not in allowed:
        raise ValueError(f"{key}={get(cfg, key)!r} is not supported; use one of {allowed}")


def check_positive(cfg: Any, *keys: str) -> None:
    for key in keys:
        if get(cfg, key) <= 0:
            raise ValueError(f"{key}={get(cfg, key)} must be > 0")


POOL_DTYPES = ("float32", "bfloat16")


def pool_dtype(cfg: Any, role: str) -> str:
    """``<role>.dtype``, or ``model.dtype`` where the pool sets none."""
    return get(cfg, f"{role}.dtype") or get(cfg, "model.dtype")


def check_pool_device(cfg: Any, role: str) -> None:
    """``<role>.device`` (cpu, cuda, cuda:N) and its dtype (:func:`pool_dtype`)."""
    device = get(cfg, f"{role}.device")
    if device != "cpu" and not (
        device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())
    ):
        raise ValueError(f"{role}.device={device!r}; use cpu, cuda or cuda:N")
    if pool_dtype(cfg, role) not in POOL_DTYPES:
        raise ValueError(
            f"{role}.dtype={pool_dtype(cfg, role)!r} (or model.dtype) is not supported; "
            f"use one of {POOL_DTYPES}"
        )
