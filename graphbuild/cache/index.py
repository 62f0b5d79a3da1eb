"""The action cache's index: stage key -> JSON manifest, in a diskcache database.

diskcache pickles anything that is not str, bytes, int or float, and unpickles whatever a row
says is pickled. :class:`JsonOnlyDisk` refuses both ways, so a pickle planted in the database
is reported as a corrupt entry and never executed (DESIGN.md, invariant 7). A row's value file
is read or removed only when its name is one diskcache itself generates (``ab/cd/<28 hex>.val``):
a row naming ``../../home/me/notes`` is corrupt, never a path.

A database that is not one (truncated, random bytes, a directory in its place) raises
:class:`IndexDamaged` at open; the cache quarantines it and starts a fresh one. A cache that
cannot be written is read through :class:`ReadOnlyIndex` (SQLite's read-only mode).
"""

from __future__ import annotations

import errno
import json
import os
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import diskcache
from diskcache.core import MODE_PICKLE, MODE_RAW, MODE_TEXT

_VALUE_FILE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")
DB_NAME = "cache.db"


class PickleRefused(ValueError):
    """A row of the index claims to hold a pickle."""


class IndexDamaged(Exception):
    """The index database cannot be read as one (not SQLite, malformed, not a file)."""


class RefusedKey:
    """Stands for an index key stored pickled, which is never unpickled; ``keys`` skips it."""

    def __repr__(self) -> str:
        return "<pickled key, refused>"


REFUSED_KEY = RefusedKey()


def _value_file(filename: Any) -> str:
    if type(filename) is not str or not _VALUE_FILE.fullmatch(filename):
        raise ValueError(f"index row names a value file diskcache never writes: {filename!r}")
    return filename


class JsonOnlyDisk(diskcache.Disk):
    """A diskcache Disk that stores only str/bytes/int/float, never unpickles, and reads or
    removes only value files with the names diskcache generates."""

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
        if filename is not None:
            _value_file(filename)
        return super().fetch(mode, filename, value, read)

    def remove(self, file_path: str) -> None:
        try:
            _value_file(file_path)
        except ValueError:
            return  # a planted name: never a path to delete
        super().remove(file_path)


_DAMAGE = ("not a database", "malformed", "no such table", "file is not")


def _is_damage(err: BaseException) -> bool:
    """True for errors that mean the file is not a usable index (not a lock or a busy DB)."""
    if isinstance(err, IsADirectoryError):
        return True
    if isinstance(err, sqlite3.DatabaseError):
        text = str(err).lower()
        return any(d in text for d in _DAMAGE) or not isinstance(err, sqlite3.OperationalError)
    return False


class ActionIndex:
    """Key -> manifest (a JSON object), plus small counters and explain records."""

    readonly = False

    def __init__(self, directory: Path):
        db_path = directory / DB_NAME
        if directory.exists() and not directory.is_dir():  # not damage: nowhere to write
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(directory))
        if db_path.exists() and not db_path.is_file():
            raise IndexDamaged(f"{db_path} is not a file")
        try:
            self._db = diskcache.Cache(
                str(directory), disk=JsonOnlyDisk, eviction_policy="none", size_limit=2**62
            )
        except (sqlite3.DatabaseError, OSError) as err:
            if _is_damage(err):
                raise IndexDamaged(f"{db_path}: {err}") from err
            raise
        try:
            check = self._db._sql("PRAGMA quick_check").fetchall()
        except sqlite3.DatabaseError as err:
            self._db.close()
            if _is_damage(err):
                raise IndexDamaged(f"{db_path}: {err}") from err
            raise
        if check != [("ok",)]:
            self._db.close()
            raise IndexDamaged(f"{db_path}: {'; '.join(str(r[0]) for r in check[:3])}")

    def get_json(self, key: str) -> dict[str, Any] | None:
        """The JSON object under ``key``; None when absent. Raises PickleRefused or
        ValueError when the row is not JSON (the caller counts it corrupt)."""
        return _json_object(key, self._db.get(key, default=None, retry=True))

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
        except (PickleRefused, ValueError):
            return 0
        return int(value) if type(value) in (int, float) and abs(value) < 2**62 else 0

    def clear(self) -> None:
        self._db.clear(retry=True)

    def close(self) -> None:
        self._db.close()


class ReadOnlyIndex:
    """The same rows, read with SQLite's read-only mode from a cache this process cannot
    write (a mounted team cache, a CI runner's copy): lookups, listings and counters work,
    nothing is written."""

    readonly = True

    def __init__(self, directory: Path):
        self.directory = directory
        db_path = directory / DB_NAME
        if not db_path.is_file():
            raise IndexDamaged(f"{db_path} is missing or not a file")
        uri = db_path.resolve().as_uri()
        last: Exception | None = None
        for mode in ("mode=ro", "immutable=1"):  # immutable: no -shm can be created beside it
            try:
                conn = sqlite3.connect(f"{uri}?{mode}", uri=True, check_same_thread=False)
                conn.execute("SELECT count(*) FROM Cache").fetchone()
            except sqlite3.DatabaseError as err:
                last = err
                continue
            self._conn = conn
            return
        assert last is not None
        raise IndexDamaged(f"{db_path}: {last}") from last

    def _value(self, key: str) -> Any:
        row = self._conn.execute(
            "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1", (key,)
        ).fetchone()
        if row is None:
            return None
        mode, filename, value = row
        if mode == MODE_PICKLE:
            raise PickleRefused("index value is stored pickled")
        if mode == MODE_RAW:
            return value
        if mode == MODE_TEXT:
            return (self.directory / _value_file(filename)).read_text(encoding="utf-8")
        raise ValueError(f"index row {key} holds bytes, not text")

    def get_json(self, key: str) -> dict[str, Any] | None:
        return _json_object(key, self._value(key))

    def keys(self, prefix: str) -> Iterator[str]:
        rows = self._conn.execute("SELECT key FROM Cache WHERE raw = 1").fetchall()
        for (key,) in rows:
            if isinstance(key, str) and key.startswith(prefix):
                yield key

    def counter(self, counter: str) -> int:
        try:
            value = self._value(f"stat:{counter}")
        except (PickleRefused, ValueError, OSError):
            return 0
        return int(value) if type(value) in (int, float) and abs(value) < 2**62 else 0

    def set_json(self, key: str, value: dict[str, Any]) -> None:
        raise _read_only()

    def delete(self, key: str) -> bool:
        raise _read_only()

    def incr(self, counter: str, delta: int = 1) -> None:
        raise _read_only()

    def clear(self) -> None:
        raise _read_only()

    def close(self) -> None:
        self._conn.close()


def _read_only() -> OSError:
    return OSError(errno.EROFS, os.strerror(errno.EROFS))


def _json_object(key: str, text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"index row {key} is not text")
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"index row {key} is not a JSON object")
    return data
