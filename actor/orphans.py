"""Processes that end with the process that started them: vLLM's engine core and
workers under an actor.

vLLM (0.32) starts its engine-core process, and on the CPU a worker process under
it, with multiprocessing; the engine core does not watch the process that started
it, so when an actor is SIGKILLed (the OOM killer, ``kill -9``, a Slurm step with
``proctrack/linuxproc``), ``VLLM::EngineCore`` keeps running, reparented to init,
holding its memory. Under the launcher the supervisor kills the actor's whole
process group (pipeline/run/supervisor.py) and systemd kills the unit's cgroup;
elsewhere nothing would. So:

- the actor sets ``NONSTOP_DIE_WITH_PARENT=1`` in its environment before it starts
  vLLM (actor/__main__.py), and vLLM's processes inherit it;
- vLLM calls :func:`vllm_plugin` in each process it starts: it is a
  ``vllm.general_plugins`` entry point (pyproject.toml), which vLLM loads in the
  engine core (``EngineCore.__init__``) and in every worker (``WorkerWrapperBase``);
- there, :func:`watch_parent` starts a daemon thread that checks every
  ``PARENT_CHECK_S`` seconds whether the parent that started this process is
  still its parent, and SIGKILLs this process when it is not (its own children
  follow the same way, or through vLLM's death pipe).

A thread, not ``prctl(PR_SET_PDEATHSIG)``: that signal follows the *thread* that
started the child, and the actor starts vLLM from its engine-loop thread.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

ENV = "NONSTOP_DIE_WITH_PARENT"
PARENT_CHECK_S = 0.5

log = logging.getLogger(__name__)
_watching = False


def watch_parent(parent_pid: int, every_s: float = PARENT_CHECK_S) -> None:
    """SIGKILL this process as soon as ``parent_pid`` is no longer its parent (the parent
    died: this process was reparented), checked now and then every ``every_s`` seconds."""
    global _watching
    if _watching:  # vLLM may load plugins more than once in a process
        return
    _watching = True

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        log.error("the process that started this one (pid %d) is gone; exiting", parent_pid)
        os.kill(os.getpid(), signal.SIGKILL)

    if os.getppid() != parent_pid:  # already gone before the watch began
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def vllm_plugin() -> None:
    """vLLM's ``vllm.general_plugins`` hook: in a process vLLM started with
    multiprocessing under an actor (``NONSTOP_DIE_WITH_PARENT=1``), watch the parent.
    Elsewhere (the actor itself, any other vLLM user of this environment) nothing.
    In every process: the queue readers' nap from ``NONSTOP_VLLM_QUEUE_NAP_US`` where the
    actor set it (actor/engines/vllm/worker/queue_nap.py)."""
    parent = multiprocessing.parent_process()
    if os.environ.get(ENV) == "1" and parent is not None and parent.pid is not None:
        watch_parent(parent.pid)
    from actor.engines.vllm.worker.queue_nap import apply_from_env

    apply_from_env()
