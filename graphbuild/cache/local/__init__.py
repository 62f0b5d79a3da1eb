"""The local backend: a cache directory holding ``index/`` (diskcache) and ``blobs/`` (files).

A cache directory carries a marker file (``CACHEDIR.TAG``) written when it is created;
maintenance (clean, prune, gc, verify with repair) refuses a directory without it, and removes
only names the store itself writes. A damaged index database is reported, moved aside
(``index.damaged-...``) under a lock on the marker, and replaced by a fresh one; with
``repair=False`` (``cache stats``, ``ls``) it is only reported. A directory this process
cannot write is read without a warning; one whose index alone it cannot write (a group cache
set up without ``chmod g+s``) is read, with a warning that says how to fix it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from graphbuild.cache.access import disk_full, why_unwritable
from graphbuild.cache.base import Stores
from graphbuild.cache.local.blobs import FileBlobs
from graphbuild.cache.local.fs import Dir
from graphbuild.cache.local.index import (
    DiskIndex,
    IndexDamaged,
    ReadOnlyDiskIndex,
    writable_by_us,
)
from graphbuild.errors import CacheError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; a repair race costs a rebuild, no more
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "MARKER",
    "FileBlobs",
    "DiskIndex",
    "ReadOnlyDiskIndex",
    "default_cache_dir",
    "open_local",
]

MARKER = "CACHEDIR.TAG"
_MARKER_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by graphbuild.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)
_OWN_NAMES = {"index", "blobs"}  # what a cache made before the marker holds
INDEX, BLOBS = "index", "blobs"


def default_cache_dir() -> Path:
    """``$GRAPHBUILD_CACHE_DIR``, else the platform's user cache directory."""
    env = os.environ.get("GRAPHBUILD_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "graphbuild"


def is_marked(path: Path) -> bool:
    """True when the directory carries graphbuild's cache marker (a file, not a link)."""
    try:
        with Dir.open_root(path) as top, os.fdopen(top.open(MARKER, os.O_RDONLY), "rb") as f:
            return b"graphbuild" in f.read(4096)
    except OSError:
        return False


@contextlib.contextmanager
def repair_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on the cache's marker while one process repairs the store (moves a
    damaged index or a planted link aside), so two processes never repair the same thing."""
    if fcntl is None:
        yield
        return
    try:
        with Dir.open_root(path) as top:
            fd = top.open(MARKER, os.O_RDONLY)
    except OSError:
        yield  # no marker to lock (a cache from before it): repair unlocked
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _mark(path: Path) -> None:
    """Write the marker into a new, empty or pre-marker cache directory; refuse a directory
    that holds anything else (``$HOME``, ``/``, a project)."""
    if is_marked(path):
        return
    try:
        names = {e.name for e in os.scandir(path)}
    except OSError as err:
        raise CacheError(f"cannot read the cache directory {path}: {err}") from err
    if not names <= _OWN_NAMES | {MARKER}:
        shown = ", ".join(sorted(names)[:5])
        raise CacheError(
            f"{path} is not a graphbuild cache (no {MARKER}) and is not empty "
            f"(it holds {shown}...); point the cache at a new or empty directory "
            "(--cache-dir, GRAPHBUILD_CACHE_DIR or cache_dir in graphbuild.toml)"
        )
    try:
        with Dir.open_root(path) as top:
            fd = top.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return
    except OSError:
        return  # cannot write here: the index open says so
    with os.fdopen(fd, "w") as f:
        f.write(_MARKER_TEXT)


def open_local(
    path: str | os.PathLike | None = None, *, readonly: bool = False, repair: bool = True
) -> Stores:
    """The local stores at ``path`` (default :func:`default_cache_dir`). ``readonly``: never
    write (nor create the directory); ``repair``: quarantine a damaged index (else report
    it in ``Stores.damage`` and go on without an index)."""
    root = Path(path).expanduser() if path is not None else default_cache_dir()
    if not readonly:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            if not _is_dir(root):
                raise CacheError(
                    f"cannot create the cache at {root}: {why_unwritable(err, root)}; choose a "
                    "cache directory you can write (--cache-dir, $GRAPHBUILD_CACHE_DIR or "
                    "[cache] dir) or build without one (--no-cache, cache=False)"
                ) from None
        readonly = not os.access(root, os.W_OK)
    if not readonly:
        _mark(root)
    stores = Stores(
        index=None,
        blobs=FileBlobs(root / BLOBS, readonly=readonly, lock=lambda: repair_lock(root)),
        location=str(root),
        readonly=readonly,
        maintainable=lambda: _refusal(root),
        path=root,
    )
    if readonly:
        _open_read_only(stores, root, quiet=True)
    elif not writable_by_us(root / INDEX) and (root / INDEX).is_dir():
        _open_read_only(stores, root, quiet=False)
    else:
        _open_writable(stores, root, repair)
    return stores


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a directory on the way we may not enter
        return False


def _refusal(root: Path) -> str | None:
    if is_marked(root):
        return None
    return (
        f"it carries no graphbuild cache marker ({MARKER}), so it may not be a cache; "
        "remove files there by hand"
    )


def _open_writable(stores: Stores, root: Path, repair: bool) -> None:
    directory = root / INDEX
    try:
        stores.index = DiskIndex(directory)
        return
    except IndexDamaged as err:
        damage = err
    except OSError as err:
        if _read_only_database(err):
            _open_read_only(stores, root, quiet=False)
            return
        _write_failed(stores, root, err)
        return
    if not repair:
        stores.damage = str(damage)
        return
    with repair_lock(root):
        try:  # another process may have repaired it while we waited for the lock
            stores.index = DiskIndex(directory)
            return
        except IndexDamaged:
            pass
        except OSError as err:
            _write_failed(stores, root, err)
            return
        try:
            with Dir.open_root(root) as top:
                aside = root / top.move_aside(INDEX, "damaged")
            stores.index = DiskIndex(directory)
        except (OSError, IndexDamaged) as err:
            _write_failed(stores, root, err)
            return
    stores.quarantined = aside
    warnings.warn(
        f"graphbuild: the cache index at {directory} was damaged ({damage}); moved it "
        f"to {aside} and started a fresh index (entries are rebuilt on the next export; "
        "delete the damaged copy once you no longer need it)",
        RuntimeWarning,
        stacklevel=4,
    )


def _read_only_database(err: OSError) -> bool:
    text = str(err).lower()
    return isinstance(err, PermissionError) or "readonly" in text or "read-only" in text


def _open_read_only(stores: Stores, root: Path, *, quiet: bool) -> None:
    stores.readonly = True
    stores.blobs.readonly = True
    try:
        stores.index = ReadOnlyDiskIndex(root / INDEX)
    except (IndexDamaged, OSError) as err:
        stores.damage = str(err)
        warnings.warn(
            f"graphbuild: the read-only cache at {root} has no readable index ({err}); "
            "going on without it",
            RuntimeWarning,
            stacklevel=4,
        )
        return
    if not quiet:
        warnings.warn(
            f"graphbuild: the cache index at {root / INDEX} is not writable by you; reading "
            "the cache without adding to it. For a cache shared by a group, make the "
            "directory group-writable with the set-group-ID bit (chmod -R g+w and "
            "chmod g+s on every directory) and use umask 002 (README: Team cache)",
            RuntimeWarning,
            stacklevel=4,
        )


def _write_failed(stores: Stores, root: Path, err: BaseException) -> None:
    """The index cannot be opened for writing (a full disk: SQLite writes as it opens): go
    on without caching, but read what the cache holds through the read-only index, so a
    full disk costs the new entries, not the hits."""
    why = cannot_write(err, root)
    stores.readonly = True
    stores.blobs.readonly = True
    stores.damage = None
    stores.unwritable = why
    reading = "reading what it holds"
    try:
        stores.index = ReadOnlyDiskIndex(root / INDEX)
    except (IndexDamaged, OSError) as read_err:
        reading = f"it cannot be read either ({read_err})"
    warnings.warn(
        f"graphbuild: cannot write to the cache at {stores.location} ({why}); "
        f"going on without caching, {reading}",
        RuntimeWarning,
        stacklevel=4,
    )


def cannot_write(err: BaseException, path: Path) -> str:
    """Why a write under ``path`` failed, for a warning: the full disk named when it is one,
    with what the system said."""
    if disk_full(err, path):
        return f"the disk is full: {err}"
    return str(err)
