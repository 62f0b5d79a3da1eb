"""The action cache's index: stage key -> JSON manifest, in a diskcache database.

diskcache pickles anything that is not str, bytes, int or float, and unpickles whatever a row
says is pickled. :class:`JsonOnlyDisk` refuses both ways, so a pickle planted in the database
is reported as a corrupt entry and never executed (DESIGN.md, invariant 7).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import diskcache
from diskcache.core import MODE_PICKLE


class PickleRefused(ValueError):
    """A row of the index claims to hold a pickle."""


class RefusedKey:
    """Stands for an index key stored pickled, which is never unpickled; ``keys`` skips it."""

    def __repr__(self) -> str:
        return "<pickled key, refused>"


REFUSED_KEY = RefusedKey()


class JsonOnlyDisk(diskcache.Disk):
    """A diskcache Disk that stores only str/bytes/int/float and never unpickles."""

    def put(self, key: Any) -> tuple[Any, bool]:
        if type(key) not in (str, bytes, int, float):
            raise TypeError(f"index keys must be str, not {type(key).__name__}")
        return super().put(key)

    def get(self, key: Any, raw: bool) -> Any:
        # Only iteration converts stored keys back; raising here would end the iteration
        # (and with it stats, gc, prune and verify), so a pickled key becomes a placeholder.
        if not raw:
            return REFUSED_KEY
        return super().get(key, raw)

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> Any:
        if not read and type(value) not in (str, bytes, int, float):
            raise TypeError(f"index values must be str, not {type(value).__name__}")
        return super().store(value, read, key=key)

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        if mode == MODE_PICKLE:
            raise PickleRefused("index value is stored pickled")
        return super().fetch(mode, filename, value, read)


class ActionIndex:
    """Key -> manifest (a JSON object), plus small counters and explain records."""

    def __init__(self, directory: Path):
        self._db = diskcache.Cache(
            str(directory), disk=JsonOnlyDisk, eviction_policy="none", size_limit=2**62
        )

    def get_json(self, key: str) -> dict[str, Any] | None:
        """The JSON object under ``key``; None when absent. Raises PickleRefused or
        ValueError when the row is not JSON (the caller counts it corrupt)."""
        text = self._db.get(key, default=None, retry=True)
        if text is None:
            return None
        if not isinstance(text, str):
            raise ValueError(f"index row {key} is not text")
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"index row {key} is not a JSON object")
        return data

    def set_json(self, key: str, value: dict[str, Any]) -> None:
        self._db.set(key, json.dumps(value, sort_keys=True), retry=True)

    def delete(self, key: str) -> bool:
        return bool(self._db.delete(key, retry=True))

    def keys(self, prefix: str) -> Iterator[str]:
        for key in self._db.iterkeys():
            if isinstance(key, str) and key.startswith(prefix):
                yield key

    def incr(self, counter: str, delta: int = 1) -> None:
        key = f"stat:{counter}"
        try:
            self._db.incr(key, delta, default=0, retry=True)
        except TypeError:  # the row holds no number (damaged, or a planted pickle): restart
            self._db.set(key, delta, retry=True)

    def counter(self, counter: str) -> int:
        try:
            value = self._db.get(f"stat:{counter}", default=0, retry=True)
        except PickleRefused:
            return 0
        return int(value) if isinstance(value, (int, float)) else 0

    def clear(self) -> None:
        self._db.clear(retry=True)

    def close(self) -> None:
        self._db.close()
