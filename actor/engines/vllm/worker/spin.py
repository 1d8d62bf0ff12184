"""How long vLLM's shared-memory queue readers spin before they sleep
(``actor.vllm.queue_spin_s``; the environment variable ``NONSTOP_VLLM_SPIN_S`` carries it
into vLLM's processes).

vLLM's engine core and its workers talk over shared-memory queues
(``vllm.distributed.device_communicators.shm_broadcast``). A reader that finds nothing
keeps polling with ``sched_yield`` for ``busy_loop_s`` (1 s) after its last read before
it sleeps on a socket: the worker while the scheduler prepares the next step, the engine
core for the whole forward pass. On a GPU host that is a spare core buying latency. On a
CPU machine whose cores the trainer and the other pools share, it is a core taken from
them: measured here on the math job, the engine-core process used a quarter of a core
while the worker computed (README, *Cores on one machine*). With 0 a reader sleeps on
the socket at once; the wake-up costs tens of microseconds against a CPU forward pass of
tens of milliseconds.

Loaded in every vLLM process through the project's ``vllm.general_plugins`` entry point
(actor/orphans.py ``vllm_plugin``), before those processes build their queues. Imports
nothing from the client.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("actor")
ENV = "NONSTOP_VLLM_SPIN_S"


def apply_from_env() -> float | None:
    """Set the readers' spin from ``NONSTOP_VLLM_SPIN_S`` (seconds; unset: vLLM's own).
    Returns the value set, None when unset."""
    value = os.environ.get(ENV)
    if value is None or value == "":
        return None
    seconds = float(value)
    if seconds < 0:
        raise ValueError(f"{ENV}={value}: give seconds >= 0 (actor.vllm.queue_spin_s)")
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    original = getattr(cls.__init__, "nonstop_original", cls.__init__)

    def init(self, is_reader, context, notify_address, busy_loop_s: float = 1):
        original(self, is_reader, context, notify_address, busy_loop_s=seconds)

    init.nonstop_original = original  # type: ignore[attr-defined]
    cls.__init__ = init
    return seconds
