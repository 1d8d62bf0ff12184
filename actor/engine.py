"""Kept for imports: the engines live in actor/engines/ (interface in base.py)."""

from actor.engines.base import Completion, Engine, EngineStats, SwapRecord
from actor.engines.hf import HFEngine

__all__ = ["Completion", "Engine", "EngineStats", "HFEngine", "SwapRecord"]
