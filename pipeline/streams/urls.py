"""The multi-host URLs of sentinel and cluster mode, read one way:
``redis[s]+KIND://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/PATH`` (sentinel.py's
``/SERVICE[/DB]``, cluster.py's bare ``/``). Passwords never reach a message
(:func:`shown`)."""

from __future__ import annotations

from urllib.parse import unquote


def split(
    url: str, kind: str, schemes: tuple[str, str], form: str
) -> tuple[bool, str | None, str | None, str, str]:
    """(tls, username, password, hosts, path) of a ``schemes`` = (plain, TLS) URL;
    ValueError naming the form to use when the scheme is not one of them."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        raise ValueError(f"not a {kind} URL: use {form}")
    username = password = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        user, has_pw, pw = cred.partition(":")
        username, password = unquote(user) or None, unquote(pw) if has_pw else None
    hosts, _, path = rest.partition("/")
    return scheme.lower() == schemes[1], username, password, hosts, path


def host_ports(
    hosts: str, url: str, default_port: int, what: str, form: str
) -> list[tuple[str, int]]:
    """``H:P[,H:P...]`` as (host, port) pairs (a bare host takes ``default_port``, an
    IPv6 host its brackets off); ValueError naming the bad ``what`` address."""
    out = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon:
            host, port = item.strip(), str(default_port)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"bad {what} address {item!r} in {shown(url)}: write HOST:PORT ({form})"
            )
        out.append((host.strip("[]"), int(port)))
    return out


def shown(url: str) -> str:
    """``url`` with its credentials replaced by ``***``."""
    if "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url
