"""Fixtures shared by several test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import RedisServer


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A fresh, empty ``redis-server`` on a free loopback port (the test skips, saying why,
    where redis-server or the redis client is not installed)."""
    with RedisServer() as url:
        yield url
