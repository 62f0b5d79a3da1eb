"""Fixtures shared by several test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import graphbuild as gb
from tests.redis_server import RedisServer


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A fresh, empty ``redis-server`` on a free loopback port (the test skips, saying why,
    where redis-server or the redis client is not installed)."""
    with RedisServer() as url:
        yield url


@pytest.fixture(scope="session")
def zoo_cache(tmp_path_factory: pytest.TempPathFactory) -> gb.Cache:
    """One cache for every export of the model zoo in a session (tests/zoo_exports.py)."""
    return gb.Cache(tmp_path_factory.mktemp("zoo") / "cache")
