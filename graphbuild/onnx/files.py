"""Writing one file: atomically (a temporary name, synced, renamed), handed to the disk as it
is written, its payloads taken from files written before where that costs less than writing.

A file is a sequence of segments: plain bytes and :class:`Payload` s (a tensor's bytes and
their digest). Where the file system shares blocks between files (btrfs, XFS:
:func:`~graphbuild.onnx.filesystem.shares_blocks`), a payload whose digest a range of a previous
file was recorded under is copied from there in the kernel (``os.copy_file_range``), then read
back and hashed; a range that does not hash to its digest (the file was edited, truncated or
replaced) is written from memory instead. Where the file system does not share blocks (ext4,
tmpfs) a range copy moves the bytes as a write does, and reading it back makes it dearer than
writing the tensor, which is in memory: every payload is written. A file of one payload that an
intact previous file holds whole is hard-linked (:func:`link_atomic`). The bytes are always
what a full write gives, and nothing unverified reaches them (docs/design.md, invariant 8).

A large file is streamed to disk as it is written (:class:`~graphbuild.onnx.filesystem.Streamer`):
its ranges go to the disk as they are written and leave the page cache once there, so writing
it reuses a few ranges' worth of memory and the sync finds only the tail to write. Each file
is synced once, before it is renamed into place.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from graphbuild.hashing import Hasher, digest_bytes
from graphbuild.onnx.filesystem import Streamer, release, shares_blocks, start_writeback

__all__ = [
    "Payload",
    "Pending",
    "PreviousFile",
    "SavedFile",
    "SegmentedFile",
    "Sources",
    "TensorRange",
    "link_atomic",
    "write_atomic",
    "write_pending",
    "write_segments",
]

_READ_CHUNK = 8 << 20
_STREAM_BYTES = 32 << 20
"""The writer hands the file to the disk in ranges of this many bytes (:class:`Streamer`)."""


@dataclass(frozen=True)
class TensorRange:
    """Where one tensor's bytes lie in a written file, and their xxh3-128."""

    offset: int
    length: int
    digest: str


@dataclass(frozen=True)
class SavedFile:
    """A file :func:`write_model` wrote: its xxh3-128 and size, where each tensor's bytes lie
    (``ranges``), and how many bytes were copied from previous files rather than written."""

    path: Path
    digest: str
    size: int
    ranges: tuple[TensorRange, ...]
    copied: int = 0


@dataclass(frozen=True)
class PreviousFile:
    """A file written before, with the ranges recorded for it: where unchanged tensors can be
    copied from. Untrusted: every copied range is verified against its digest. ``intact``:
    its size, modification time and inode are those recorded when it was written (nobody
    touched it since), so a file of one range can be linked whole, as placement links the
    files of an unchanged product."""

    path: Path
    ranges: Sequence[TensorRange]
    intact: bool = False


def link_atomic(source: Path, path: Path, identity: tuple[int, int] | None = None) -> bool:
    """Make ``path`` a hard link to ``source`` (replacing ``path``); False where the file
    system cannot (another device, no hard links, too many links), or where ``source`` is no
    longer the file ``identity`` (device, inode) names: it was replaced since it was opened."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        os.link(source, tmp, follow_symlinks=False)
        st = os.stat(tmp, follow_symlinks=False)
        if identity is not None and (st.st_dev, st.st_ino) != identity:
            return False
        os.replace(tmp, path)
    except OSError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


@dataclass(frozen=True)
class Payload:
    """A tensor's bytes as the file holds them, and their digest when known: the writer
    copies it from a previous file holding a range of that digest (verified), or writes it."""

    data: bytes | memoryview
    digest: str | None


@runtime_checkable
class SegmentedFile(Protocol):
    """A file artifact of any format that is written segment by segment: plain bytes (a
    header, padding) and :class:`Payload` s (tensor data), which the placement takes from
    the file it replaces where it can (:func:`write_segments`)."""

    name: str

    def segments(self) -> Iterable[bytes | memoryview | Payload]: ...


def write_segments(
    path: Path,
    segments: Iterable[bytes | memoryview | Payload],
    previous: Sequence[PreviousFile] = (),
) -> SavedFile:
    """Write ``segments`` to ``path`` atomically, each payload copied from a range of a
    ``previous`` file recorded under its digest where one is (verified as copied), else
    written; the bytes are the same either way. The result records every payload's range."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with Sources(previous) as sources:
        return write_atomic(path, segments, sources)


def write_atomic(
    path: Path,
    chunks: Iterable[bytes | memoryview | Payload],
    sources: Sources | None = None,
) -> SavedFile:
    pending = write_pending(path, chunks, sources)
    pending.settle()
    return pending.saved


@dataclass
class Pending:
    """A file written under a temporary name and handed to the disk, not yet synced:
    :meth:`settle` waits for it, lets its pages go and renames it into place."""

    tmp: Path
    path: Path
    saved: SavedFile

    def settle(self) -> None:
        try:
            fd = os.open(self.tmp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                os.fsync(fd)
                release(fd, 0, self.saved.size)  # its pages serve the next file
            finally:
                os.close(fd)
            os.replace(self.tmp, self.path)
        finally:
            self.tmp.unlink(missing_ok=True)

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


def write_pending(
    path: Path,
    chunks: Iterable[bytes | memoryview | Payload],
    sources: Sources | None = None,
) -> Pending:
    """Write ``chunks`` to a temporary name beside ``path`` and start handing them to the
    disk; the caller settles the result (:meth:`Pending.settle`) or discards it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w+b") as f:  # read too: copied ranges are read back
            writer = _FileWriter(f, sources)
            for chunk in chunks:
                writer.add(chunk)
            f.flush()
            f.truncate(writer.pos)  # nothing of a failed copy past the end
            start_writeback(f.fileno(), 0, writer.pos)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Pending(tmp, path, writer.result(path))


class Sources:
    """The previous files, opened for reading, and where each recorded digest lies in them.

    Only regular files are read (a FIFO or device in their place would block or lie), opened
    without following a symbolic link, and only ranges inside the file's current size."""

    def __init__(self, previous: Sequence[PreviousFile]):
        self._previous = previous
        self._fds: list[int] = []
        self.ranges: dict[tuple[str, int], tuple[int, int]] = {}  # (digest, length) -> (fd, off)
        # intact one-tensor files: (digest, length) -> (path, (device, inode))
        self.whole: dict[tuple[str, int], tuple[Path, tuple[int, int]]] = {}

    def __enter__(self) -> Sources:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        for prev in self._previous:
            try:
                fd = os.open(prev.path, flags | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                continue
            self._fds.append(fd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            for r in prev.ranges:
                if r.length > 0 and r.offset >= 0 and r.offset + r.length <= st.st_size:
                    self.ranges.setdefault((r.digest, r.length), (fd, r.offset))
            if prev.intact and len(prev.ranges) == 1:
                (r,) = prev.ranges
                if r.offset == 0 and r.length == st.st_size and st.st_nlink == 1:
                    identity = (st.st_dev, st.st_ino)
                    self.whole.setdefault((r.digest, r.length), (prev.path, identity))
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def find(self, digest: str, length: int) -> tuple[int, int] | None:
        return self.ranges.get((digest, length))

    def whole_file(self, digest: str, length: int) -> tuple[Path, tuple[int, int]] | None:
        """An intact previous file holding exactly these bytes, and nothing else, with its
        identity (device, inode) as opened; each is handed out once, so no two new files
        share an inode (onnx refuses a data file with more than one link)."""
        return self.whole.pop((digest, length), None)


#: errnos with which copy_file_range says it cannot copy between these files (then every
#: tensor is written from memory)
_NO_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM}


class _FileWriter:
    """Writes chunks in order, hashing the file as it goes; a payload found in the sources is
    range-copied and verified (see the module's docstring)."""

    def __init__(self, f, sources: Sources | None):
        self.f = f
        copies = hasattr(os, "copy_file_range")  # Linux; elsewhere every tensor is written
        if sources is None or not sources.ranges or not copies or not shares_blocks(f.fileno()):
            sources = None  # copies would cost more than the writes they replace
        self.sources = sources
        self.hasher = Hasher()
        self.pos = 0
        self._stream = Streamer(f.fileno(), _STREAM_BYTES)
        self.ranges: list[TensorRange] = []
        self.copied = 0
        self._buffer: bytearray | None = None

    def add(self, chunk: bytes | memoryview | Payload) -> None:
        if not isinstance(chunk, Payload):
            self._write(chunk)
            return
        data = chunk.data
        length = len(data)
        digest = chunk.digest or digest_bytes(data)
        source = self.sources.find(digest, length) if self.sources is not None else None
        if source is None or not self._copy(source, length, digest):
            self._write(data)
        else:
            self.copied += length
            self._write_back()
        self.ranges.append(TensorRange(self.pos - length, length, digest))

    def result(self, path: Path) -> SavedFile:
        return SavedFile(path, self.hasher.hexdigest(), self.pos, tuple(self.ranges), self.copied)

    def _write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.hasher.update(data)
        self.pos += len(data)
        self._write_back()

    def _write_back(self) -> None:
        if self._stream.due(self.pos):
            self.f.flush()
            self._stream.written(self.pos)

    def _copy(self, source: tuple[int, int], length: int, digest: str) -> bool:
        """Copy ``length`` bytes from the source range to the current position, then read them
        back: True when they hash to ``digest`` (the position has moved past them)."""
        src_fd, src_offset = source
        self.f.flush()
        fd = self.f.fileno()
        done = 0
        try:
            while done < length:
                n = os.copy_file_range(
                    src_fd, fd, length - done, src_offset + done, self.pos + done
                )
                if n == 0:  # the source is shorter than recorded
                    return False
                done += n
        except OSError as err:
            if err.errno in _NO_COPY:
                self.sources = None  # not between these files: write the rest from memory
            return False
        before = self.hasher.copy()
        check = Hasher()
        if self._buffer is None:
            self._buffer = bytearray(_READ_CHUNK)
        view = memoryview(self._buffer)
        offset = self.pos
        while offset < self.pos + length:
            n = os.preadv(fd, [view[: min(_READ_CHUNK, self.pos + length - offset)]], offset)
            if n <= 0:
                break
            check.update(view[:n])
            self.hasher.update(view[:n])
            offset += n
        if offset != self.pos + length or check.hexdigest() != digest:
            self.hasher = before  # the bytes at this position are overwritten from memory
            return False
        self.pos += length
        self.f.seek(self.pos)
        return True
