"""A pool told to stop (SIGTERM, SIGINT) stops at once, whatever Redis does.

While a pool runs, a Redis command that meets a dropped connection is retried for
about ``redis.reconnect_s`` (pipeline.streams.connect): a redis-server restarting
mid-run costs nothing. Once the pool is told to stop, that budget no longer holds:
:class:`StopEvent` (the pool's ``stop``) remembers when it was set, and
:func:`guard` gives every client of the pool a :class:`StopAwareRetry` that retries
a failing command only until :data:`FINAL_WRITES_S` seconds after the stop. A pool
whose Redis is gone (the whole machine shutting down, redis-server included) makes
one short bounded attempt at its final writes (its ``stopped`` status, the acks of
work it finished) and leaves, instead of spending the launcher's grace period
(``launch.stop_timeout_s``) in the reconnect loop and being SIGKILLed. A command
blocked on a server that accepted it but never answers (a hung server: its socket
deadline is 30 s) is cut once that budget and the longest blocking read
(``redis.block_ms``) have passed: :func:`watch` shuts the pool's sockets in use down, so
the blocked read fails then.

Cutting the final writes short loses nothing: an entry a pool read but did not
acknowledge stays in its consumer group's pending list (PEL), in the AOF, and is
read again after a restart (the preprocessor re-reads its own pending entries or
another consumer claims them; the trainer re-reads from its checkpoint's position);
the trainer's unfinished step is neither acknowledged nor checkpointed, so its
batches come again; a rollout group whose XADD got no reply was not recorded (the
actor records a group only after the reply), and the count-once scripts
(pipeline.streams.add_once, retire_groups) make a re-sent count change nothing. The
status hash is telemetry: a ``stopped`` state that did not land leaves the last state.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.retry import Retry

log = logging.getLogger(__name__)

FINAL_WRITES_S = 1.0  # after the stop: how long a failing Redis command is still retried


class StopEvent(threading.Event):
    """The pool's stop flag; remembers when it was first set (monotonic seconds)."""

    def __init__(self, final_s: float = FINAL_WRITES_S):
        super().__init__()
        self.final_s = final_s
        self.since: float | None = None

    def set(self) -> None:
        if self.since is None:
            self.since = time.monotonic()
        super().set()

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or until the stop if that comes first (while running: a
        retry's backoff, up to 2 s, ends at the stop). In slices, checking the flag, not
        with ``wait()``: the pool's signal handler calls ``set()`` in the main thread,
        and ``wait()`` holds the Event's (non-reentrant) lock for a few bytecodes, where
        a handler's ``set()`` would wait for it forever."""
        end = time.monotonic() + seconds
        running = not self.is_set()
        while (left := end - time.monotonic()) > 0 and not (running and self.is_set()):
            time.sleep(min(left, 0.05))

    def left(self) -> float:
        """Seconds of the final-writes budget left: infinite while the pool runs."""
        if self.since is None:
            return math.inf
        return max(0.0, self.since + self.final_s - time.monotonic())


class StopAwareRetry(Retry):
    """``base``'s retries and backoff while the pool runs; once ``stop`` is set, a
    failing command is retried only within the stop's final-writes budget (the backoff
    sleeps shortened to fit it), and after it fails at the first error."""

    def __init__(self, base: Retry | None, stop: StopEvent):
        if base is None:  # a client without retries: none while stopping either
            super().__init__(_NoBackoff(), 0)
        else:
            super().__init__(base._backoff, base._retries, base._supported_errors)
        self.stop = stop

    def __deepcopy__(self, memo: dict) -> StopAwareRetry:
        """redis-py gives each new connection a deep copy of the client's retry: the
        copy has its own backoff state and the same stop."""
        twin = StopAwareRetry.__new__(StopAwareRetry)
        for key, value in self.__dict__.items():
            setattr(twin, key, value if key == "stop" else copy.deepcopy(value, memo))
        return twin

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        self._backoff.reset()
        failures = 0
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                left = self.stop.left()
                if left <= 0 or (self._retries >= 0 and failures > self._retries):
                    raise error
                backoff = min(self._backoff.compute(failures), left)
                if backoff <= 0:
                    continue
                self.stop.sleep(backoff)


class _NoBackoff:
    def reset(self) -> None:
        pass

    def compute(self, failures: int) -> float:
        return 0.0


def guard(client: redis.Redis, stop: StopEvent) -> redis.Redis:
    """Give ``client`` (and its open connections) the stop-aware retry; returns it."""
    retry = client.get_retry()
    if not isinstance(retry, StopAwareRetry):
        client.set_retry(StopAwareRetry(retry, stop))
    return client


def watch(
    clients: Callable[[], list[redis.Redis]], stop: StopEvent, longest_read_s: float
) -> threading.Thread:
    """A daemon thread that waits for the stop, then for its final-writes budget and
    ``longest_read_s`` (redis.block_ms: a blocking read a healthy server answers within
    it), and then shuts down the sockets of every connection of ``clients()`` still in
    use: a command waiting on a server that does not answer (its socket deadline is far
    longer) fails now, and the stop-aware retry does not try it again. A healthy
    server's commands have answered by then; a new command connects afresh."""

    def run() -> None:
        stop.wait()
        time.sleep(stop.left() + longest_read_s)
        for client in clients():
            for sock in _in_use_sockets(client):
                with contextlib.suppress(OSError):  # closed meanwhile
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it

    thread = threading.Thread(target=run, name="stop-watch", daemon=True)
    thread.start()
    return thread


def _in_use_sockets(client: redis.Redis) -> list[socket.socket]:
    """The sockets of ``client``'s connections handed out to a command right now (a
    Redis Cluster client: those of every node's client)."""
    if not hasattr(client, "connection_pool") and hasattr(client, "get_nodes"):
        nodes = [n.redis_connection for n in client.get_nodes() if n.redis_connection]
        return [sock for node in nodes for sock in _in_use_sockets(node)]
    pool = client.connection_pool
    with getattr(pool, "_lock", None) or contextlib.nullcontext():
        conns = list(getattr(pool, "_in_use_connections", ()))
    socks = []
    for conn in conns:
        sock = getattr(conn, "_sock", None)
        if sock is not None:
            socks.append(sock)
    return socks


def final(stop: StopEvent, what: str, write: Callable[[], Any]) -> Any:
    """Run one of a pool's final Redis writes (``what`` names it for the log); when the
    pool is stopping and Redis does not take it within the budget, log one line saying
    why that loses nothing, and return None. While the pool runs, errors propagate."""
    try:
        return write()
    except (redis.ConnectionError, redis.TimeoutError) as e:
        if not stop.is_set():
            raise
        log.warning("stopping: redis did not take %s (%s); %s", what, _short(e), NOTHING_LOST)
        return None


NOTHING_LOST = (
    "nothing is lost: what this pool read and did not acknowledge stays pending in redis "
    "and is read again after a restart"
)


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__
