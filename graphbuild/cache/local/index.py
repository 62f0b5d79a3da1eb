"""The local action index: stage key -> JSON manifest, in a diskcache (SQLite) database.

diskcache pickles anything that is not str, bytes, int or float, and unpickles whatever a row
says is pickled. :class:`JsonOnlyDisk` refuses both ways, so a pickle planted in the database
is reported as a corrupt entry and never executed (docs/design.md, invariant 7). Values are kept
inside the database (never as separate files); a row of an older cache naming a value file is
read or removed only when its name is one diskcache itself generates (``ab/cd/<28 hex>.val``),
through directories opened without following links.

A database that is not one (truncated, random bytes, a directory, a link or a settings table
diskcache never writes) raises :class:`IndexDamaged` at open; the cache quarantines it and
starts a fresh one. The index directory and database are created with the umask's
permissions, so a group-shared cache stays writable by the group. A cache whose index this
process cannot write is read through :class:`ReadOnlyDiskIndex` (SQLite's read-only mode).
SQLite errors leave this module as ``OSError`` (:class:`~graphbuild.cache.base.StoreUnavailable`).
Leases (``lease:<name>`` rows naming their owner) expire through diskcache's own expiry.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import diskcache
from diskcache.core import DEFAULT_SETTINGS, METADATA, MODE_BINARY, MODE_PICKLE, MODE_RAW, MODE_TEXT

from graphbuild.cache.base import StoreUnavailable, read_only_error
from graphbuild.cache.local.fs import Dir

_VALUE_FILE = re.compile(r"([0-9a-f]{2})/([0-9a-f]{2})/([0-9a-f]{28}\.val)")
DB_NAME = "cache.db"
LEASE = "lease:"  # index rows of leases (in-flight deduplication), with an expiry
_SIDE_FILES = (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", f"{DB_NAME}-journal")
_SETTINGS = {
    **DEFAULT_SETTINGS,
    "eviction_policy": "none",
    "size_limit": 2**62,
    "disk_min_file_size": 2**40,  # every value inside the database: no value files to plant
}
_KNOWN_SETTINGS = set(DEFAULT_SETTINGS) | set(METADATA)
#: SQLite errors that say the database is busy, not ours to write, or has no room to grow
#: (SQLITE_FULL: "database or disk is full"), never that it is damaged
_TRANSIENT = ("locked", "busy", "readonly", "read-only", "unable to open", "disk i/o", "is full")

F = TypeVar("F", bound=Callable[..., Any])


class PickleRefused(ValueError):
    """A row of the index claims to hold a pickle."""


class IndexDamaged(Exception):
    """The index database cannot be read as one (not SQLite, malformed, not a file, a link,
    settings diskcache never writes)."""


class RefusedKey:
    """Stands for an index key stored pickled, which is never unpickled; ``keys`` skips it."""

    def __repr__(self) -> str:
        return "<pickled key, refused>"


REFUSED_KEY = RefusedKey()


def _value_file(filename: Any) -> tuple[str, str, str]:
    match = _VALUE_FILE.fullmatch(filename) if type(filename) is str else None
    if match is None:
        raise ValueError(f"index row names a value file diskcache never writes: {filename!r}")
    return match.group(1), match.group(2), match.group(3)


def read_value_file(index_dir: Path, filename: Any) -> bytes:
    """A value file of an older cache, read through directories opened without following
    links; ValueError for a name diskcache never writes."""
    a, b, name = _value_file(filename)
    with (
        Dir.open_root(index_dir.parent) as top,
        top.sub(index_dir.name) as idx,
        idx.sub(a) as da,
        da.sub(b) as db,
    ):
        return db.read_bytes(name)


def remove_value_file(index_dir: Path, filename: Any) -> None:
    """Remove a value file (and the shard directories it leaves empty); a planted name or a
    link on the way removes nothing."""
    try:
        a, b, name = _value_file(filename)
        with Dir.open_root(index_dir.parent) as top, top.sub(index_dir.name) as idx:
            with idx.sub(a) as da:
                with da.sub(b) as db:
                    db.unlink(name)
                da.rmdir(b)
            idx.rmdir(a)
    except (OSError, ValueError):
        return


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
        if mode == MODE_RAW:
            return super().fetch(mode, filename, value, read)
        if mode == MODE_PICKLE:
            raise PickleRefused("index value is stored pickled")
        if mode not in (MODE_TEXT, MODE_BINARY) or read:
            raise ValueError(f"index row has mode {mode!r}, which graphbuild never writes")
        data = read_value_file(Path(self._directory), filename)
        return data.decode("utf-8") if mode == MODE_TEXT else data

    def remove(self, file_path: str) -> None:
        remove_value_file(Path(self._directory), file_path)


def _is_transient(err: BaseException) -> bool:
    """True for errors that say the database is busy or not ours to write, not damaged."""
    text = str(err).lower()
    return isinstance(err, sqlite3.OperationalError) and any(t in text for t in _TRANSIENT)


def _sqlite_errors(method: F) -> F:
    """SQLite errors leave the index as OSError: the cache treats them as an unreachable
    store (a miss on read, caching off on write), whatever the backend."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except (sqlite3.Error, diskcache.Timeout) as err:
            raise StoreUnavailable(f"the cache index: {err}") from err

    return wrapper  # type: ignore[return-value]


def check_files(directory: Path) -> None:
    """IndexDamaged when the index directory, its database or the database's side files are
    links, or not what SQLite keeps there (a directory in place of the database)."""
    with Dir.open_root(directory.parent) as top:
        kind = top.kind(directory.name)
        if kind is None:
            return
        if kind != "dir":
            raise IndexDamaged(f"{directory} is a {'symbolic link' if kind == 'link' else kind}")
        with top.sub(directory.name) as idx:
            for name in _SIDE_FILES:
                kind = idx.kind(name)
                if kind not in (None, "file"):
                    what = "a symbolic link" if kind == "link" else f"not a file ({kind})"
                    raise IndexDamaged(f"{directory / name} is {what}")


def _check_database(db_path: Path) -> None:
    """IndexDamaged unless the file is an SQLite database whose settings diskcache could have
    written (settings become attributes and PRAGMAs when diskcache opens it)."""
    try:
        conn = sqlite3.connect(str(db_path), timeout=60)
    except sqlite3.Error as err:
        raise IndexDamaged(f"{db_path}: {err}") from err
    try:
        check = conn.execute("PRAGMA quick_check").fetchall()
        if check != [("ok",)]:
            raise IndexDamaged(f"{db_path}: {'; '.join(str(r[0]) for r in check[:3])}")
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "Settings" in tables:
            keys = {r[0] for r in conn.execute("SELECT key FROM Settings")}
            unknown = sorted(str(k) for k in keys - _KNOWN_SETTINGS)
            if unknown:
                raise IndexDamaged(f"{db_path}: settings diskcache never writes: {unknown[:3]}")
    except sqlite3.Error as err:
        if _is_transient(err):
            raise StoreUnavailable(f"{db_path}: {err}") from err
        raise IndexDamaged(f"{db_path}: {err}") from err
    finally:
        conn.close()


def _create_database(directory: Path) -> None:
    """The index directory and an empty database file (an empty file is an empty SQLite
    database), created with the umask's permissions: diskcache would make the directory
    0755 and SQLite the file 0644, which shuts a group out of a shared cache."""
    with (
        Dir.open_root(directory.parent) as top,
        top.sub(directory.name, create=True) as idx,
        contextlib.suppress(FileExistsError),
    ):
        os.close(idx.open(DB_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))


def writable_by_us(directory: Path) -> bool:
    """True when this process may write the index (its directory and database)."""
    db = directory / DB_NAME
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    return not db.exists() or os.access(db, os.R_OK | os.W_OK)


class DiskIndex:
    """Key -> JSON object (manifests, explain records, placement stamps), plus counters."""

    readonly = False

    def __init__(self, directory: Path):
        self.directory = directory
        check_files(directory)
        _create_database(directory)
        db_path = directory / DB_NAME
        _check_database(db_path)
        try:
            self._db = diskcache.Cache(str(directory), disk=JsonOnlyDisk, **_SETTINGS)
        except (sqlite3.Error, diskcache.Timeout) as err:
            if _is_transient(err) or isinstance(err, diskcache.Timeout):
                raise StoreUnavailable(f"{db_path}: {err}") from err
            raise IndexDamaged(f"{db_path}: {err}") from err
        except (TypeError, ValueError, AttributeError) as err:  # settings it cannot take
            raise IndexDamaged(f"{db_path}: {err}") from err

    @_sqlite_errors
    def get_json(self, key: str) -> dict[str, Any] | None:
        """The JSON object under ``key``; None when absent. Raises PickleRefused or
        ValueError when the row is not JSON (the caller counts it corrupt)."""
        return json_object(key, self._db.get(key, default=None, retry=True))

    @_sqlite_errors
    def set_json(self, key: str, value: dict[str, Any]) -> None:
        self._db.set(key, json.dumps(value, sort_keys=True), retry=True)

    @_sqlite_errors
    def delete(self, key: str) -> bool:
        return bool(self._db.delete(key, retry=True))

    @_sqlite_errors
    def keys(self, prefix: str) -> Iterator[str]:
        return iter([k for k in self._db.iterkeys() if isinstance(k, str) and k.startswith(prefix)])

    @_sqlite_errors
    def incr(self, counter: str, delta: int = 1) -> None:
        key = f"stat:{counter}"
        try:
            self._db.incr(key, delta, default=0, retry=True)
        except (TypeError, ValueError, OverflowError):  # no number there, or a huge one
            self._db.set(key, delta, retry=True)

    def counter(self, counter: str) -> int:
        try:
            value = self._db.get(f"stat:{counter}", default=0, retry=True)
        except (PickleRefused, ValueError, OSError, sqlite3.Error):
            return 0
        return int(value) if type(value) in (int, float) and abs(value) < 2**62 else 0

    @_sqlite_errors
    def clear(self) -> None:
        self._db.clear(retry=True)

    # Leases are rows with diskcache's expiry: ``add`` inserts only when no unexpired row is
    # there, in one SQLite transaction, so of two processes asking at once one gets it.

    @_sqlite_errors
    def acquire_lease(self, name: str, owner: str, seconds: float) -> bool:
        return bool(self._db.add(LEASE + name, lease_row(owner), expire=seconds, retry=True))

    @_sqlite_errors
    def renew_lease(self, name: str, owner: str, seconds: float) -> bool:
        with self._db.transact(retry=True):
            if lease_owner(self._db.get(LEASE + name, retry=True)) != owner:
                return False
            self._db.set(LEASE + name, lease_row(owner), expire=seconds, retry=True)
        return True

    @_sqlite_errors
    def release_lease(self, name: str, owner: str) -> bool:
        with self._db.transact(retry=True):
            if lease_owner(self._db.get(LEASE + name, retry=True)) != owner:
                return False
            self._db.delete(LEASE + name, retry=True)
        return True

    def lease_holder(self, name: str) -> str | None:
        try:
            return lease_owner(self._db.get(LEASE + name, retry=True))
        except (PickleRefused, ValueError, OSError, sqlite3.Error):
            return None

    def close(self) -> None:
        self._db.close()

    def release_thread(self) -> None:
        """Close the calling thread's connection: diskcache opens one per thread, and
        :meth:`close` closes the caller's alone. A thread that ends without this leaves its
        connection open until the garbage collector breaks its reference cycle."""
        self._db.close()


class ReadOnlyDiskIndex:
    """The same rows, read with SQLite's read-only mode from a cache this process cannot
    write (a mounted team cache, a CI runner's copy): lookups, listings and counters work,
    nothing is written."""

    readonly = True

    def __init__(self, directory: Path):
        self.directory = directory
        try:
            check_files(directory)
        except OSError as err:
            raise IndexDamaged(f"{directory}: {err}") from err
        db_path = directory / DB_NAME
        if not db_path.is_file():
            raise IndexDamaged(f"{db_path} is missing")
        uri = (directory.parent.resolve() / directory.name / DB_NAME).as_uri()
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
            return read_value_file(self.directory, filename).decode("utf-8")
        raise ValueError(f"index row {key} holds bytes, not text")

    @_sqlite_errors
    def get_json(self, key: str) -> dict[str, Any] | None:
        return json_object(key, self._value(key))

    @_sqlite_errors
    def keys(self, prefix: str) -> Iterator[str]:
        rows = self._conn.execute("SELECT key FROM Cache WHERE raw = 1").fetchall()
        return iter([k for (k,) in rows if isinstance(k, str) and k.startswith(prefix)])

    def counter(self, counter: str) -> int:
        try:
            value = self._value(f"stat:{counter}")
        except (PickleRefused, ValueError, OSError, sqlite3.Error):
            return 0
        return int(value) if type(value) in (int, float) and abs(value) < 2**62 else 0

    def set_json(self, key: str, value: dict[str, Any]) -> None:
        raise read_only_error(str(self.directory))

    def delete(self, key: str) -> bool:
        raise read_only_error(str(self.directory))

    def incr(self, counter: str, delta: int = 1) -> None:
        raise read_only_error(str(self.directory))

    def clear(self) -> None:
        raise read_only_error(str(self.directory))

    def acquire_lease(self, name: str, owner: str, seconds: float) -> bool:
        raise read_only_error(str(self.directory))

    def renew_lease(self, name: str, owner: str, seconds: float) -> bool:
        raise read_only_error(str(self.directory))

    def release_lease(self, name: str, owner: str) -> bool:
        raise read_only_error(str(self.directory))

    def lease_holder(self, name: str) -> str | None:
        try:
            row = self._conn.execute(
                "SELECT expire_time, mode, value FROM Cache WHERE key = ? AND raw = 1",
                (LEASE + name,),
            ).fetchone()
        except sqlite3.Error:
            return None
        if row is None or row[1] != MODE_RAW or (row[0] is not None and row[0] <= time.time()):
            return None
        return lease_owner(row[2])

    def close(self) -> None:
        self._conn.close()


def lease_row(owner: str) -> str:
    """A lease's row: a JSON object, like every other row, naming its owner."""
    return json.dumps({"owner": owner})


def lease_owner(text: Any) -> str | None:
    """The owner a lease row names; None for no row or one that is not a lease."""
    try:
        row = json_object(LEASE, text)
    except (ValueError, UnicodeDecodeError):
        return None
    owner = row.get("owner") if row else None
    return owner if isinstance(owner, str) else None


def json_object(key: str, text: Any) -> dict[str, Any] | None:
    """A row's text as a JSON object; None for no row; ValueError for anything else."""
    if text is None:
        return None
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if not isinstance(text, str):
        raise ValueError(f"index row {key} is not text")
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"index row {key} is not a JSON object")
    return data
