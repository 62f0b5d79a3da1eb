"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import graphbuild as gb
from tests.redis_server import RedisServer


@pytest.fixture(scope="session", autouse=True)
def default_cache_in_the_sessions_temp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """An export that names no cache writes to the session's temporary directory, never to the
    user's cache or to one ``$GRAPHBUILD_CACHE_DIR`` left set by the shell (CI's quick start)."""
    saved = os.environ.get("GRAPHBUILD_CACHE_DIR")
    os.environ["GRAPHBUILD_CACHE_DIR"] = str(tmp_path_factory.mktemp("default-cache"))
    yield
    if saved is None:
        os.environ.pop("GRAPHBUILD_CACHE_DIR", None)
    else:
        os.environ["GRAPHBUILD_CACHE_DIR"] = saved


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
