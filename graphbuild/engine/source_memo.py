"""What a fresh process would otherwise recompute about source files, kept in the local cache.

A code closure (:mod:`~graphbuild.engine.closure`) needs, for every file it reaches, what
each top-level name of the file uses: a parse of the file. In a new process that parse is
most of a warm export's own time (the stages of a transformers model reach some fifty of
graphbuild's files), though it is a pure function of the file's bytes and module name. So
each summary is kept in the run's cache, in a record named by the digest of (what it is,
the module name, the file's xxh3, the closure code's own xxh3): a file edited since has
another digest and is parsed again, and nothing is taken on trust beyond the bytes read now.
Installed libraries' versions are kept the same way, named by the state of the directories
they are installed in (:func:`environment_stamp`).

A record holds its value and the digest of it; one that is malformed or does not match its
digest is no record (computed again, and written over). A cache that cannot be written
keeps nothing, and no cache at all (``cache=False``) means everything is computed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any, Protocol

from graphbuild.hashing import digest_json

__all__ = ["MemoStore", "environment_stamp", "get", "put", "use"]


class MemoStore(Protocol):
    """Where records are kept: :class:`~graphbuild.cache.byte_store.ByteCache` is one."""

    def memo(self, key: str) -> dict[str, Any] | None: ...

    def record_memo(self, key: str, value: dict[str, Any]) -> None: ...


_lock = threading.Lock()
_store: MemoStore | None = None


def use(store: MemoStore | None) -> None:
    """Keep records in ``store`` from now on (None: keep none). A run sets its cache."""
    global _store
    with _lock:
        _store = store


def record_key(*parts: Any) -> str:
    """The name of a record: the digest of what it is a function of."""
    return digest_json(["source memo", *parts])


def get(key: str, kind: str) -> Any | None:
    """The value recorded under ``key`` for records of ``kind``; None when there is none, it
    is of another kind, or it does not match its own digest."""
    store = _store
    if store is None:
        return None
    try:
        record = store.memo(key)
    except Exception:  # a damaged index row only costs the time it would have saved
        return None
    if type(record) is not dict or record.get("kind") != kind or "value" not in record:
        return None
    if record.get("digest") != digest_json([kind, record["value"]]):
        return None
    return record["value"]


def put(key: str, kind: str, value: Any) -> None:
    """Record ``value`` (JSON) under ``key``; nothing when no store is set or it cannot be
    written (the cache warns about that itself, once)."""
    store = _store
    if store is None:
        return
    record = {"kind": kind, "value": value, "digest": digest_json([kind, value])}
    with contextlib.suppress(OSError):
        store.record_memo(key, record)


#: A directory modified this recently may change again within the same clock tick: its
#: mtime does not vouch for what is installed there (git's "racily clean").
_RACY_NS = 2_000_000_000


def environment_stamp() -> str | None:
    """What the installed libraries a process sees are a function of: the Python minor
    version, ``sys.path`` as it is, and the mtime of each of its directories (installing or
    removing a distribution adds or removes its ``.dist-info`` directory in one of them,
    which changes that directory's mtime); None while one is too recently modified to vouch
    for its contents."""
    now = time.time_ns()
    stamps = []
    for entry in sys.path:
        where = os.path.abspath(entry or os.curdir)  # "" is the working directory
        try:
            mtime = os.stat(where).st_mtime_ns
        except OSError:
            mtime = None
        if mtime is not None and now - mtime < _RACY_NS:
            return None
        stamps.append([where, mtime])
    return digest_json([list(sys.version_info[:2]), stamps])
