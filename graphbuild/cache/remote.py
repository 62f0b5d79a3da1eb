"""Shared caches named by URL: which backend serves which scheme.

``redis://host:port/db``, ``rediss://`` (TLS) and ``unix:///path/redis.sock`` name a Redis
server (:mod:`graphbuild.cache.redis`, installed with ``pip install 'graphbuild[redis]'``).
A new backend is a module that returns :class:`~graphbuild.cache.base.Stores` and a line here.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from graphbuild.cache.base import Stores
from graphbuild.errors import CacheError

URL_ENV = "GRAPHBUILD_CACHE_URL"
_REDIS = ("redis", "rediss", "unix")


def default_cache_url() -> str | None:
    """``$GRAPHBUILD_CACHE_URL``, or None."""
    return os.environ.get(URL_ENV) or None


def is_cache_url(text: str) -> bool:
    """True for a URL this module can open (as opposed to a directory)."""
    return urlsplit(str(text)).scheme in _REDIS


def open_remote(url: str, *, readonly: bool = False) -> Stores:
    """The stores of the shared cache at ``url``. CacheError for a URL no backend serves or
    a backend that is not installed; StoreUnavailable (an OSError) when the server cannot be
    reached."""
    scheme = urlsplit(url).scheme
    if scheme not in _REDIS:
        raise CacheError(
            f"cannot open a shared cache at {url!r}: give redis://host:port/db "
            "(or rediss://, unix:///path.sock)"
        )
    try:
        from graphbuild.cache.redis import open_redis
    except ImportError as err:
        raise CacheError(
            "a Redis cache needs the redis client: pip install 'graphbuild[redis]'"
        ) from err
    return open_redis(url, readonly=readonly)
