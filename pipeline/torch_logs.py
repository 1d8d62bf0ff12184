"""torch's C++ logs and transfer errors, one line each.

torch.distributed's TCPStore (the weight-transfer rendezvous of every transport)
logs each failed connect attempt and each timed-out wait on stderr with a C++
backtrace (dozens of ``frame #N`` lines) before it raises; the exception the
Python side gets is already one line. So a pool process:

* calls :func:`quiet_cpp_logs` before torch is first imported (the pools'
  ``__main__``): it sets ``TORCH_CPP_LOG_LEVEL=FATAL`` unless the user set it.
  torch reads the variable once, when its C++ library loads, and child processes
  (vLLM workers, torchrun ranks) inherit it. ``TORCH_CPP_LOG_LEVEL=WARNING`` (or
  INFO) brings torch's C++ logs back for debugging;
* logs a failed join with :func:`join_failed` / :func:`accept_failed`: one line
  with the address, the deadline, the error's first line and what to check.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

ENV = "TORCH_CPP_LOG_LEVEL"
QUIET = "FATAL"  # ERROR still prints the TCPStore's retry traces
LIMIT = 600  # characters of an error's message kept in a log line
CAUSE = 200  # of the underlying torch error quoted inside ours


def quiet_cpp_logs(environ: MutableMapping[str, str] | None = None) -> bool:
    """Silence torch's C++ log lines unless ``TORCH_CPP_LOG_LEVEL`` is set; True
    when it takes effect in this process (torch not imported yet)."""
    environ = os.environ if environ is None else environ
    environ.setdefault(ENV, QUIET)  # children get it even when this process is too late
    return "torch" not in sys.modules


def one_line(e: BaseException, limit: int = LIMIT) -> str:
    """``Type: first line of the message`` without any C++ backtrace."""
    text = str(e).split("Exception raised from", 1)[0].strip()
    first = text.splitlines()[0].strip() if text else ""
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def is_join_failure(e: BaseException) -> bool:
    """A network or deadline failure of a join (not a configuration error)."""
    import torch.distributed as dist

    return isinstance(e, (TimeoutError, OSError, dist.DistError))


def join_failed(host: str, port: str | int, timeout_s: float, e: BaseException) -> str:
    """The actor's line when it cannot reach or join the trainer's transfer store."""
    return (
        f"could not join the trainer's weight transfer at {host}:{port} within "
        f"{timeout_s:g} s ({one_line(e, CAUSE)}); check that the trainer is running, that "
        f"trainer.transfer_host ({host}) is an address of the trainer this machine "
        f"can reach, and that no firewall blocks port {port}"
    )


def accept_failed(
    actor: str, host: str | None, port: str | int | None, timeout_s: float, e: BaseException
) -> str:
    """The trainer's line when an actor that asked to join does not complete the join."""
    where = f"{host}:{port}" if host and port else "the trainer's transfer store"
    return (
        f"actor {actor} did not complete its weight-transfer join at {where} within "
        f"{timeout_s:g} s ({one_line(e, CAUSE)}); the actor stopped, or cannot reach {where} "
        f"(trainer.transfer_host, firewall)"
    )
