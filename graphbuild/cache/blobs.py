"""Content-addressed blob store: one file per xxh3-128 digest, written atomically."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from graphbuild.cache.names import is_digest
from graphbuild.engine.hashing import Hasher, digest_bytes

_CHUNK = 8 << 20
_SHARD = re.compile(r"[0-9a-f]{2}")
_REST = re.compile(r"[0-9a-f]{30}")
_TEMP = re.compile(r"[0-9a-f]{8}\.[A-Za-z0-9_]+\.tmp")


class CorruptBlob(Exception):
    """A blob that is missing, truncated or whose bytes do not match its digest."""

    def __init__(self, digest: str, why: str):
        self.digest = digest
        super().__init__(f"blob {str(digest)[:16]!s}... {why}")


def current_umask() -> int:
    """The process umask, read without changing it where the platform allows."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class BlobStore:
    """``root/ab/cdef...``: written to a temporary file and renamed into place; read verifies
    the digest. No fsync: a blob that a crash leaves short or empty fails verification on
    read and is rebuilt, so the cache stays correct without paying for durability.

    Only 32 lowercase hex digits are a digest: anything else is refused before a path is
    built, and listing, clearing and collecting see only names this store writes
    (``ab/`` + 30 hex digits, ``tmp/<8 hex>.<random>.tmp``), never a stray file beside them.
    Blobs are created with the umask's permissions, so a group-shared directory (``chmod
    g+s`` and ``umask 002``) stays shared."""

    def __init__(self, root: Path):
        self.root = root
        self.tmp = root / "tmp"

    def path(self, digest: str) -> Path:
        if not is_digest(digest):
            raise ValueError(f"not a blob digest: {str(digest)[:80]!r}")
        return self.root / digest[:2] / digest[2:]

    def has(self, digest: str, size: int) -> bool:
        if not is_digest(digest):
            return False
        try:
            return self.path(digest).stat().st_size == size
        except OSError:
            return False

    def write(self, digest: str, data: bytes | bytearray | memoryview) -> bool:
        """Store ``data`` under ``digest`` unless present; True when written. A blob present
        at the wrong size (truncated) is replaced: keeping it would make every entry that
        names it a miss forever."""
        dest = self.path(digest)
        if self.has(digest, memoryview(data).nbytes):
            return False
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.tmp, prefix=digest[:8] + ".", suffix=".tmp")
        try:
            os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp's 0600 would hide it from a group
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return True

    def read(self, digest: str, size: int | None = None) -> bytes:
        """The blob's bytes, checked against its digest; raises CorruptBlob."""
        if not is_digest(digest):
            raise CorruptBlob(str(digest), "is not a digest (32 lowercase hex digits)")
        try:
            data = self.path(digest).read_bytes()
        except OSError as err:
            raise CorruptBlob(digest, f"cannot be read ({err.strerror})") from err
        if size is not None and len(data) != size:
            raise CorruptBlob(digest, f"has {len(data)} bytes, expected {size}")
        if digest_bytes(data) != digest:
            raise CorruptBlob(digest, "does not match its digest")
        return data

    def verify(self, digest: str) -> bool:
        if not is_digest(digest):
            return False
        h = Hasher()
        try:
            with open(self.path(digest), "rb") as src:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
        except OSError:
            return False
        return h.hexdigest() == digest

    def delete(self, digest: str) -> int | None:
        """Remove a blob; its size when removed, None when it was absent or could not be
        removed (a read-only cache): a failed delete frees nothing."""
        if not is_digest(digest):
            return None
        p = self.path(digest)
        try:
            size = p.stat().st_size
            p.unlink()
        except OSError:
            return None
        return size

    def all(self) -> Iterator[tuple[str, int, float]]:
        """Every blob as (digest, size, mtime); names the store does not write are skipped."""
        try:
            shards = list(os.scandir(self.root))
        except OSError:
            return
        for sub in shards:
            if not _SHARD.fullmatch(sub.name) or not sub.is_dir(follow_symlinks=False):
                continue
            try:
                entries = list(os.scandir(sub.path))
            except OSError:
                continue
            for entry in entries:
                if not _REST.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                yield sub.name + entry.name, st.st_size, st.st_mtime

    def temps(self) -> Iterator[tuple[Path, float]]:
        """The store's own temporary files, as (path, mtime)."""
        try:
            entries = list(os.scandir(self.tmp))
        except OSError:
            return
        for entry in entries:
            if _TEMP.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                try:
                    yield Path(entry.path), entry.stat(follow_symlinks=False).st_mtime
                except OSError:
                    continue

    def stale_temps(self, older_than: float) -> list[Path]:
        return [p for p, mtime in self.temps() if mtime < older_than]

    def clear(self) -> tuple[int, int]:
        """Remove every blob and temporary file the store wrote, and the shard directories
        they leave empty; anything else stays. Returns (blobs removed, bytes freed)."""
        removed = freed = 0
        for digest, _size, _ in list(self.all()):
            size = self.delete(digest)
            if size is not None:
                removed, freed = removed + 1, freed + size
        for path, _ in list(self.temps()):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        for sub in (*self.root.glob("[0-9a-f][0-9a-f]"), self.tmp):
            if _SHARD.fullmatch(sub.name) or sub == self.tmp:
                with contextlib.suppress(OSError):
                    sub.rmdir()  # only when empty
        return removed, freed
