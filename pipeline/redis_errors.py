"""The errors a pool's Redis connection ends with at start-up, one line for the operator:
raised by :func:`pipeline.streams.connect` and by the sentinel probe (pipeline/sentinel.py),
which both import them from here."""

from __future__ import annotations


class RedisUnavailable(ConnectionError):
    """Redis cannot be used at start-up (unreachable, or refuses the credentials);
    the message is one line for the operator. Pools and the launcher exit 2 on it."""


class RedisRefused(RedisUnavailable):
    """Redis answers but refuses this user (credentials, a command the ACL denies), or
    the two ends disagree on TLS (pipeline/redis_tls.py): waiting will not fix it. Pools
    exit 4 on it (EXIT_REFUSED), so the launcher stops the run at once instead of
    restarting them."""
