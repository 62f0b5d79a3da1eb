"""Content-addressed blob store: one file per xxh3-128 digest, written atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from graphbuild.engine.hashing import Hasher, digest_bytes

_CHUNK = 8 << 20


class CorruptBlob(Exception):
    """A blob that is missing, truncated or whose bytes do not match its digest."""

    def __init__(self, digest: str, why: str):
        self.digest = digest
        super().__init__(f"blob {digest[:16]}... {why}")


class BlobStore:
    """``root/ab/cdef...``: written to a temporary file and renamed into place; read verifies
    the digest. No fsync: a blob that a crash leaves short or empty fails verification on
    read and is rebuilt, so the cache stays correct without paying for durability."""

    def __init__(self, root: Path):
        self.root = root
        self.tmp = root / "tmp"

    def path(self, digest: str) -> Path:
        return self.root / digest[:2] / digest[2:]

    def has(self, digest: str, size: int) -> bool:
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
        fd, tmp = tempfile.mkstemp(dir=self.tmp, prefix=digest[:8])
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return True

    def read(self, digest: str, size: int | None = None) -> bytes:
        """The blob's bytes, checked against its digest; raises CorruptBlob."""
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
        h = Hasher()
        try:
            with open(self.path(digest), "rb") as src:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
        except OSError:
            return False
        return h.hexdigest() == digest

    def delete(self, digest: str) -> int:
        p = self.path(digest)
        try:
            size = p.stat().st_size
            p.unlink()
            return size
        except OSError:
            return 0

    def all(self) -> Iterator[tuple[str, int, float]]:
        """Every blob as (digest, size, mtime)."""
        if not self.root.exists():
            return
        for sub in os.scandir(self.root):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub.path):
                st = entry.stat()
                yield sub.name + entry.name, st.st_size, st.st_mtime

    def stale_temps(self, older_than: float) -> list[Path]:
        if not self.tmp.exists():
            return []
        return [p for p in self.tmp.iterdir() if p.stat().st_mtime < older_than]

    def clear(self) -> None:
        if self.root.exists():
            shutil.rmtree(self.root)
