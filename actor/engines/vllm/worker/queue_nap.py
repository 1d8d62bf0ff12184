"""How vLLM's shared-memory queue readers wait while they poll (``actor.vllm.queue_nap_us``;
the environment variable ``NONSTOP_VLLM_QUEUE_NAP_US`` carries it into vLLM's processes).

vLLM's engine core and its worker talk over shared-memory queues
(``vllm.distributed.device_communicators.shm_broadcast``). For 1 s after its last read a
reader that finds nothing polls again at once, calling ``sched_yield`` between polls: the
engine core for the whole forward pass while it waits for the worker's output, the worker
while the scheduler prepares the next step. On a GPU host that is a spare core buying
latency. On the CPU build it takes a core the worker and the trainer need: profiled on the
math job here, the engine-core process was on the CPU polling (``sched_yield``) for 93% of
its samples while the worker computed, and the trainer got 0.4-0.8 of its core.

With a nap of N microseconds a polling reader sleeps N us between polls instead of
yielding: the same polling window, the same wake-up on the queue's flag (none of vLLM's
wake-up logic changes: its socket notifications are not relied on more than before, which
is what made a reader that sleeps on the socket at once miss wake-ups), at most N us later
than a spinning reader against a CPU forward pass of tens of milliseconds.

Loaded in every vLLM process through the project's ``vllm.general_plugins`` entry point
(actor/orphans.py ``vllm_plugin``). Imports nothing from the client.
"""

from __future__ import annotations

import os
import time

ENV = "NONSTOP_VLLM_QUEUE_NAP_US"


def nap_from_env() -> int | None:
    """The nap in microseconds from ``NONSTOP_VLLM_QUEUE_NAP_US``; None when unset or 0
    (vLLM's own ``sched_yield``). A value that is not a whole number >= 0 is a ValueError
    naming the setting."""
    value = os.environ.get(ENV, "")
    if value == "":
        return None
    try:
        us = int(value)
    except ValueError:
        us = -1
    if us < 0:
        raise ValueError(
            f"{ENV}={value!r}: give whole microseconds >= 0 (actor.vllm.queue_nap_us; "
            "0 keeps vLLM's own sched_yield)"
        )
    return us or None


def apply_from_env() -> int | None:
    """Make vLLM's queue readers and writers nap between polls (``nap_from_env``).
    Returns the nap set, None when vLLM's own polling is (put back) in place."""
    us = nap_from_env()
    from vllm.distributed.device_communicators import shm_broadcast

    if us is None:
        from vllm.distributed.utils import sched_yield

        shm_broadcast.sched_yield = sched_yield
        return None

    seconds = us / 1e6

    def nap() -> None:
        time.sleep(seconds)

    nap.nonstop_nap_us = us  # type: ignore[attr-defined]
    shm_broadcast.sched_yield = nap  # the name its readers' and writers' loops call
    return us
