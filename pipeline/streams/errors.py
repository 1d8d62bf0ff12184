"""What the streams layer raises when Redis cannot be used at start-up, and URLs shown
in messages with the password hidden (:func:`redact`).

connection.py (a ``redis://`` or ``rediss://`` URL) and sentinel.py (a
``redis+sentinel://`` one) both raise these; the pools map them to exit codes
(pipeline/runtime.py).
"""

from __future__ import annotations


class RedisUnavailable(ConnectionError):
    """Redis cannot be used at start-up (unreachable, or refuses the credentials);
    the message is one line for the operator. Pools and the launcher exit 2 on it."""


class RedisRefused(RedisUnavailable):
    """Redis answers but refuses this user (credentials, a command the ACL denies), or
    the two ends disagree on TLS (pipeline/redisd/tls.py): waiting will not fix it. Pools
    exit 4 on it (EXIT_REFUSED), so the launcher stops the run at once instead of
    restarting them."""


def redact(url: str) -> str:
    """``url`` with its user and password hidden (``scheme://***@host:port/db``)."""
    if "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
