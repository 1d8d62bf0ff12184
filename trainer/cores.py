"""``trainer.torch_threads=auto``: the trainer's torch threads follow what the other pools
on its machine are doing, so no core sits idle while the trainer is starved.

::

    reads   the status hashes of the run's pools (every CORES_S seconds at most): their
            ``host``, ``state`` and ``heartbeat``
    writes  nothing itself: the step record carries ``torch_threads`` (the mean over the
            step's micro-batches) and the trainer's status the current count
    blocks  never (one SCAN and a few HGETALL)

The trainer may use the CPUs of its affinity (``cores``). A pool on the same host (its
status's ``host``, with a heartbeat younger than STALE_S) takes as many of them as it
keeps busy: an actor that is generating (``state`` ``generating``; a vLLM CPU engine runs
one OpenMP thread per worker, the hf engine ``sampling.torch_threads``), an evaluator
that is evaluating (``eval.torch_threads``; none when ``pipeline.nice.evaluator`` is
above the trainer's: it then runs on what the trainer leaves), a preprocessor that is working
(``preprocessor.torch_threads``). An actor held back by back-pressure, or a finished
evaluator, takes none. The trainer runs ``cores`` minus what they take, at least one.
Trainer ranks on one host (``LOCAL_WORLD_SIZE``) split what is free. The count is set
before every micro-batch (``torch.set_num_threads``; never in the
middle of a forward or backward pass).

A step's thread count cannot change inside its forward or backward pass, and an actor
held back by back-pressure may get room in the middle of a step (a preprocessor drops a
group without signal): it would then generate on the core the trainer's second thread
runs on. So when the trainer takes the cores of idle actors it **claims** them for the
step: its status field ``cores_claimed`` is 1 until the step ends, and an actor on the
same host starts no new group meanwhile (actor/room.py, hold reason ``cores``; a claim
whose heartbeat is older than STALE_S is ignored). The actor had a full backlog when
it went idle, so the trainer has the next step's samples.

Why not simply ``cores`` threads all the time: with an actor generating on one of two
cores, two trainer threads share the other with it, and torch's intra-op threads wait at
each parallel region for the one that is descheduled (bench/results/samerun-*.md has the
fixed two-thread row beside this one). On a machine of its own (a Slurm node, a
systemd unit alone on its host) nothing else is on the host, and ``auto`` is ``cores``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from pipeline.streams import CORES_CLAIMED as CLAIM

log = logging.getLogger("trainer")
CORES_S = 0.5  # statuses are read at most this often
STALE_S = 10.0  # a status whose heartbeat is older than this belongs to no live pool

AUTO = "auto"


def cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def takes(status: dict[str, str], cfg: Any) -> int:
    """The cores a pool with this status keeps busy now (module docstring)."""
    role, state = status.get("role", ""), status.get("state", "")
    if role == "actor" and state == "generating":
        return 1 if cfg.actor.engine == "vllm" else int(cfg.sampling.torch_threads)
    if role == "evaluator" and state.startswith("evaluating"):
        # niced below the trainer (pipeline.nice.evaluator) it runs only on what the
        # trainer leaves idle: it takes none of the trainer's cores
        if _nice(cfg, "evaluator") > _nice(cfg, "trainer"):
            return 0
        return int(cfg.eval.torch_threads)
    if role == "preprocessor" and state == "working":
        return int(cfg.preprocessor.torch_threads)
    return 0


def _nice(cfg: Any, role: str) -> int:
    return int(getattr(getattr(getattr(cfg, "pipeline", None), "nice", None), role, 0) or 0)


class CoreShare:
    """The trainer's thread count under ``trainer.torch_threads=auto``; :meth:`apply` before
    each micro-batch, :meth:`release` after the step. ``statuses`` reads the run's status
    hashes (name -> fields), ``set_status`` sets fields of the trainer's."""

    def __init__(
        self,
        cfg: Any,
        statuses,
        set_status,
        me: str,
        ranks: int = 1,
        host: str | None = None,
    ):
        self.cfg, self.statuses, self.set_status = cfg, statuses, set_status
        self.me, self.ranks = me, ranks
        self.claimed = False
        self.host = host or socket.gethostname()
        self.cores = cores()
        self.threads = 0  # set by apply
        self.checked = 0.0
        self.used: list[int] = []  # the count at each apply since the last take_mean

    def wanted(self) -> tuple[int, bool]:
        """(threads, claimed): the cores free now, and whether they include an idle
        actor's, which the trainer then claims for the step (module docstring)."""
        now = time.time()
        busy = actors_idle = 0
        for name, st in self.statuses().items():
            if name == self.me or st.get("role") == "trainer" or st.get("host") != self.host:
                continue
            if now - float(st.get("heartbeat", 0) or 0) > STALE_S:
                continue
            busy += takes(st, self.cfg)
            if st.get("role") == "actor":  # what it would take once it generates again
                actors_idle += takes(dict(st, state="generating"), self.cfg) - takes(st, self.cfg)
        threads = max(1, (self.cores - busy) // self.ranks)  # ranks on this host: a share each
        return threads, threads > max(1, (self.cores - busy - actors_idle) // self.ranks)

    def apply(self) -> int:
        """Set torch's threads to what the machine has free now; returns the count."""
        import torch

        if time.monotonic() - self.checked >= CORES_S or not self.threads:
            self.checked = time.monotonic()
            want, claim = self.wanted()
            if claim != self.claimed:  # before the threads: no actor starts into them
                self.claim(claim)
            if want != self.threads:
                torch.set_num_threads(want)
                self.threads = want
        self.used.append(self.threads)
        return self.threads

    def claim(self, on: bool) -> None:
        self.set_status(**{CLAIM: int(on)})
        self.claimed = on

    def release(self) -> None:
        """After the step: idle actors may start new groups again."""
        if self.claimed:
            self.claim(False)

    def take_mean(self) -> float:
        """The mean thread count since the last call (a step's micro-batches)."""
        used, self.used = self.used, []
        return round(sum(used) / len(used), 3) if used else float(self.threads)
