"""The local blob store: one file per xxh3-128 digest, ``blobs/ab/cdef...``, written atomically.

Only 32 lowercase hex digits are a digest: anything else is refused before a name is built.
Listing, clearing and collecting see only names this store writes (``ab/`` + 30 hex digits,
``tmp/<8 hex>.<random>.tmp``), never a stray file beside them. Every directory below the
cache directory is opened without following links (:mod:`graphbuild.cache.local.fs`): a link
planted where the store keeps ``blobs``, a shard or ``tmp`` is read as absent, and moved aside
(with a warning) before the store writes there again.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

from graphbuild.cache.base import CorruptBlob, check_blob_size, checked_blob, read_only_error
from graphbuild.cache.local.fs import Dir, ForeignPath, WrongSize, is_dir_entry, is_file_entry
from graphbuild.cache.names import is_digest
from graphbuild.hashing import Hasher

_CHUNK = 8 << 20
_SHARD = re.compile(r"[0-9a-f]{2}")
_REST = re.compile(r"[0-9a-f]{30}")
_TEMP = re.compile(r"[0-9a-f]{8}\.[A-Za-z0-9_]+\.tmp")
_TMP = "tmp"


class FileBlobs:
    """``root/ab/cdef...``: written to ``root/tmp`` and renamed into place; read verifies the
    digest. No fsync: a blob that a crash leaves short or empty fails verification on read and
    is rebuilt, so the cache stays correct without paying for durability.

    Blobs are created with the umask's permissions, so a group-shared directory (``chmod
    g+s`` and ``umask 002``) stays shared. ``lock`` serialises repairs (moving a planted link
    aside) between processes."""

    def __init__(
        self,
        root: Path,
        *,
        readonly: bool = False,
        lock: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ):
        self.root = root
        self.tmp = root / _TMP
        self.readonly = readonly
        self._lock = lock

    def path(self, digest: str) -> Path:
        """Where the blob lives (for people and tests; the store itself never opens it by
        this path)."""
        if not is_digest(digest):
            raise ValueError(f"not a blob digest: {str(digest)[:80]!r}")
        return self.root / digest[:2] / digest[2:]

    # ----------------------------------------------------------------- directories

    def _top(self) -> Dir:
        return Dir.open_root(self.root.parent)

    def _own(self, parent: Dir, name: str, create: bool) -> Dir:
        """A directory of the store; with ``create``, made when absent, and a link or a
        file in its place is moved aside first."""
        try:
            return parent.sub(name, create=create)
        except ForeignPath:
            if not create:
                raise
        with self._lock():
            if parent.kind(name) not in (None, "dir"):  # another process may have fixed it
                aside = parent.move_aside(name, "foreign")
                warnings.warn(
                    f"graphbuild: {parent.path / name} in the cache was a symbolic link or "
                    f"not a directory; moved it to {parent.path / aside} and made a new one "
                    "(the cache never writes through a link; look into who planted it)",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return parent.sub(name, create=True)

    def _shard(self, digest: str) -> Dir | None:
        """The shard holding ``digest`` opened for reading; None when absent or foreign."""
        try:
            with self._top() as top, top.sub(self.root.name) as blobs:
                return blobs.sub(digest[:2])
        except OSError:
            return None

    # ----------------------------------------------------------------- the store

    def has(self, digest: str, size: int) -> bool:
        if not is_digest(digest):
            return False
        shard = self._shard(digest)
        if shard is None:
            return False
        with shard:
            try:
                st = shard.lstat(digest[2:])
            except OSError:
                return False
        return is_file_entry(st) and st.st_size == size

    def write(self, digest: str, data: bytes | bytearray | memoryview) -> bool:
        """Store ``data`` under ``digest`` unless present; True when written. A blob present
        at the wrong size (truncated) is replaced: keeping it would make every entry that
        names it a miss forever."""
        if not is_digest(digest):
            raise ValueError(f"not a blob digest: {str(digest)[:80]!r}")
        if self.readonly:
            raise read_only_error(str(self.root))
        if self.has(digest, memoryview(data).nbytes):
            return False
        with (
            self._top() as top,
            self._own(top, self.root.name, True) as blobs,
            self._own(blobs, _TMP, True) as tmp,
            self._own(blobs, digest[:2], True) as shard,
        ):
            if shard.kind(digest[2:]) in ("dir", "other"):
                with self._lock():
                    if shard.kind(digest[2:]) in ("dir", "other"):
                        shard.move_aside(digest[2:], "foreign")
            name = f"{digest[:8]}.{secrets.token_hex(8)}.tmp"
            fd = tmp.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                tmp.replace_into(name, shard, digest[2:])
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink(name)
                raise
        return True

    def read(self, digest: str, size: int | None = None) -> bytes:
        """The blob's bytes, checked against its digest; raises CorruptBlob. With ``size``
        (what the manifest says), a file of another size is not read, and a size this
        machine could not hold is refused before any byte is (``check_blob_size``)."""
        if not is_digest(digest):
            raise CorruptBlob(str(digest), "is not a digest (32 lowercase hex digits)")
        if size is not None:
            check_blob_size(digest, size)
        shard = self._shard(digest)
        if shard is None:
            raise CorruptBlob(digest, "cannot be read (no shard directory of the store's own)")
        try:
            with shard:
                data = shard.read_bytes(digest[2:], size)
        except WrongSize as err:
            raise CorruptBlob(digest, str(err)) from err
        except OSError as err:
            raise CorruptBlob(digest, f"cannot be read ({err.strerror or err})") from err
        return checked_blob(digest, data, size)

    def verify(self, digest: str) -> bool:
        if not is_digest(digest):
            return False
        shard = self._shard(digest)
        if shard is None:
            return False
        h = Hasher()
        try:
            with shard, os.fdopen(shard.open(digest[2:], os.O_RDONLY), "rb") as src:
                if not is_file_entry(os.fstat(src.fileno())):
                    return False
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
        except OSError:
            return False
        return h.hexdigest() == digest

    def delete(self, digest: str) -> int | None:
        """Remove a blob; its size when removed, None when it was absent or could not be
        removed (a read-only cache): a failed delete frees nothing."""
        if not is_digest(digest) or self.readonly:
            return None
        shard = self._shard(digest)
        if shard is None:
            return None
        with shard:
            try:
                st = shard.lstat(digest[2:])
                if not is_file_entry(st):
                    return None
                shard.unlink(digest[2:])
            except OSError:
                return None
        return st.st_size

    def all(self) -> Iterator[tuple[str, int, float]]:
        """Every blob as (digest, size, mtime); names the store does not write, and links,
        are skipped."""
        try:
            top = self._top()
        except OSError:
            return
        with top:
            try:
                blobs = top.sub(self.root.name)
            except OSError:
                return
            with blobs:
                shards = [
                    n for n, st in blobs.entries() if _SHARD.fullmatch(n) and is_dir_entry(st)
                ]
                for name in shards:
                    try:
                        shard = blobs.sub(name)
                    except OSError:
                        continue
                    with shard:
                        found = list(shard.entries())
                    for rest, st in found:
                        if _REST.fullmatch(rest) and is_file_entry(st):
                            yield name + rest, st.st_size, st.st_mtime

    def _temps(self) -> list[tuple[str, float]]:
        try:
            with self._top() as top, top.sub(self.root.name) as blobs, blobs.sub(_TMP) as tmp:
                return [
                    (n, st.st_mtime)
                    for n, st in tmp.entries()
                    if _TEMP.fullmatch(n) and is_file_entry(st)
                ]
        except OSError:
            return []

    def _remove_temps(self, names: list[str]) -> int:
        removed = 0
        try:
            with self._top() as top, top.sub(self.root.name) as blobs, blobs.sub(_TMP) as tmp:
                for name in names:
                    try:
                        tmp.unlink(name)
                        removed += 1
                    except OSError:
                        continue
        except OSError:
            pass
        return removed

    def sweep(self, older_than: float) -> int:
        """Remove the store's own temporary files written before ``older_than``."""
        if self.readonly:
            return 0
        return self._remove_temps([n for n, mtime in self._temps() if mtime < older_than])

    def clear(self) -> tuple[int, int]:
        """Remove every blob and temporary file the store wrote, and the shard directories
        they leave empty; anything else stays. Returns (blobs removed, bytes freed)."""
        if self.readonly:
            raise read_only_error(str(self.root))
        removed = freed = 0
        for digest, _size, _ in list(self.all()):
            size = self.delete(digest)
            if size is not None:
                removed, freed = removed + 1, freed + size
        self._remove_temps([n for n, _ in self._temps()])
        try:
            with self._top() as top, top.sub(self.root.name) as blobs:
                for name, st in list(blobs.entries()):
                    if (_SHARD.fullmatch(name) or name == _TMP) and is_dir_entry(st):
                        with contextlib.suppress(OSError):
                            blobs.rmdir(name)  # only when empty
        except OSError:
            pass
        return removed, freed

    def close(self) -> None:
        pass
