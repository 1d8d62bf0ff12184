"""What a process uses, where the environment wins over the config file: the run's
secret, the Redis URL (a role's own user first) and the TLS files.

The launcher hands its pools these in the environment (``NONSTOP_RUN_SECRET``,
``NONSTOP_REDIS_URL``, ``NONSTOP_REDIS_TLS_CA``/``_CERT``/``_KEY``), so the embedded
server's password and the secret are never written to ``config.yaml``; a pool started
alone reads the same variables (deploy/env.example). ``NONSTOP_REDIS_SHARD_URLS`` (the
independent shards' instances) is refused: :func:`refuse_shard_urls`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pipeline.config.checks import get as _get

if TYPE_CHECKING:
    from pipeline.redisd.tls import TLSFiles


def run_secret() -> str:
    """The run's shared secret (weight-transfer joins are signed with it)."""
    secret = os.environ.get("NONSTOP_RUN_SECRET")
    if not secret:
        raise ValueError(
            "NONSTOP_RUN_SECRET is not set: the launcher sets it for its pools; for pools "
            "started alone, put the same random value in every pool's environment "
            "(deploy/env.example)"
        )
    return secret


def redis_url(cfg: Any, role: str | None = None) -> str:
    """The run's Redis URL: the environment wins over the config file, and a
    role's own user (``NONSTOP_REDIS_URL_ACTOR``, ...; see deploy/redis/users.acl)
    wins over the shared one.

    The embedded server's password is passed only in the environment, never
    written to disk in config.yaml.
    """
    own = os.environ.get(f"NONSTOP_REDIS_URL_{role.upper()}") if role else None
    url = own or os.environ.get("NONSTOP_REDIS_URL") or cfg.redis.url
    if not url:
        raise ValueError(
            "no Redis to talk to: set redis.url=redis://host:port/0 or NONSTOP_REDIS_URL"
        )
    return url


SHARD_URLS_ENV = "NONSTOP_REDIS_SHARD_URLS"


def refuse_shard_urls() -> None:
    """``NONSTOP_REDIS_SHARD_URLS`` (or a role's ``..._<ROLE>``) named the instances of
    independent shards, which were replaced by Redis Cluster: ValueError saying how to
    move when one is set (an empty one names nothing and passes)."""
    from pipeline.config.redis import MIGRATE_SHARDS

    for var in sorted(os.environ):
        if var.startswith(SHARD_URLS_ENV) and os.environ[var]:
            raise ValueError(f"{var} is set: {MIGRATE_SHARDS}; unset it")


def tls_files(cfg: Any | None = None) -> TLSFiles:
    """The client's TLS files: ``NONSTOP_REDIS_TLS_CA``, ``_CERT``, ``_KEY`` win over
    ``redis.tls.ca``, ``cert``, ``key`` (the launcher hands an embedded TLS server's
    client files to its pools this way; ``cfg`` None: the environment only). ValueError
    naming the setting or variable when a file is missing or a certificate comes
    without its key."""
    from pipeline.redisd.tls import ENV, KEYS, TLSFiles

    values, origin = {}, {}
    for what in ("ca", "cert", "key"):
        env = os.environ.get(ENV[what], "")
        conf = (_get(cfg, KEYS[what]) or "") if cfg is not None else ""
        values[what], origin[what] = (env, ENV[what]) if env else (conf, KEYS[what])
    files = TLSFiles(**values, origin=origin)
    if bool(files.cert) != bool(files.key):
        have, missing = ("cert", "key") if files.cert else ("key", "cert")
        raise ValueError(
            f"{files.named(have)} is set but not {KEYS[missing]} ({ENV[missing]}): a client "
            "certificate needs its private key; set both, or neither"
        )
    for what in ("ca", "cert", "key"):
        path = values[what]
        if path and not os.access(path, os.R_OK):
            why = "is not readable by this user" if os.path.exists(path) else "does not exist"
            raise ValueError(
                f"{files.named(what)}={path} {why}: give the PEM file of the "
                + {
                    "ca": "CA that signs the server's certificate",
                    "cert": "client certificate",
                }.get(what, "client certificate's private key")
            )
    return files


def redis_tls(cfg: Any | None, url: str) -> TLSFiles | None:
    """The TLS files to reach ``url`` with (:func:`tls_files`), None for a plain-text
    ``redis://`` URL; ValueError for TLS files or ``redis.tls=true`` with a plain URL."""
    from pipeline.redisd.tls import is_tls

    files = tls_files(cfg)
    if is_tls(url):
        return files
    given = [files.named(k) for k in ("ca", "cert", "key") if getattr(files, k)]
    if given:
        raise ValueError(
            f"{', '.join(given)} set but the Redis URL is plain-text redis://: use rediss:// "
            "(rediss+sentinel://, rediss+cluster://; redis.url or NONSTOP_REDIS_URL) for TLS, "
            "or unset them"
        )
    if cfg is not None and _get(cfg, "redis.tls.enabled"):
        raise ValueError(
            "redis.tls=true but the Redis URL is plain-text redis:// (redis.url or "
            "NONSTOP_REDIS_URL): use rediss:// (rediss+sentinel://, rediss+cluster://)"
        )
    return None
