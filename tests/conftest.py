"""Shared fixtures: a real redis-server per test module and a client for it."""

from __future__ import annotations

import shutil

import pytest

from pipeline.redis_server import EmbeddedRedis
from pipeline.streams import connect


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server (loopback, password, AOF, noeviction) for one test module."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    server = EmbeddedRedis(str(tmp_path_factory.mktemp("redis")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def rclient(redis_server):
    """A connected redis.Redis on an empty database; closed afterwards."""
    client = connect(redis_server.url, attempts=3)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()
