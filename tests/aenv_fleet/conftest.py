"""Fixtures of the fleet tests: a real redis-server per module (cluster.py has the
3-node cluster)."""
from __future__ import annotations

import shutil
from typing import Iterator

import pytest

from .redisserver import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (scripts/install.sh installs it)")
    srv = RedisServer.start(tmp_path_factory.mktemp("redis"))
    try:
        yield srv
    finally:
        srv.stop()
