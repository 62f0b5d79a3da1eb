"""What the file system under an output file does for the writer: whether a range copy shares
blocks, and streaming a large file to disk as it is written.

``os.copy_file_range`` shares the blocks of the source where the file system can (btrfs, XFS,
bcachefs, OpenZFS) or copies on the server (NFS, SMB); elsewhere (ext4, tmpfs) it moves the
bytes through the page cache like a write, and the writer's read-back check makes it dearer
than writing a tensor that is in memory anyway. :func:`shares_blocks` tells the two apart by
the file system's magic number (``fstatfs``); unknown means no.

A large file is streamed (:class:`Streamer`): each range is handed to the disk as soon as it
is written, and once on disk its pages leave the page cache, so the next range reuses them.
Page cache for a new file is memory the kernel must find, and on a virtual machine memory that
has not been touched for a while is slow to hand out (a 641 MiB write took 1.2-2.3 s there
against 0.2-0.4 s into pages just freed); a streamed file needs a few ranges' worth, and the
closing fsync finds little left to write. The file is as durable as before: the caller still
fsyncs it.

Linux only (through the C library); elsewhere these are no-ops that change nothing but speed.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any

#: ``f_type`` of file systems where copy_file_range clones blocks or copies server-side:
#: btrfs, XFS, bcachefs, OpenZFS, OCFS2, NFS, SMB2 and CIFS (linux/magic.h, OpenZFS).
_SHARING = {
    0x9123683E,
    0x58465342,
    0xCA451A4E,
    0x2FC12FC1,
    0x7461636F,
    0x6969,
    0xFE534D42,
    0xFF534D42,
}
_STATFS_BYTES = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4
_WAIT_FOR_RANGE = (
    _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER
)


@functools.cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fstatfs, sync_file_range = libc.fstatfs, libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
    fstatfs.restype = ctypes.c_int
    sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    sync_file_range.restype = ctypes.c_int
    return libc


def file_system_type(fd: int) -> int | None:
    """The magic number of the file system holding the file open as ``fd`` (``f_type`` of
    ``fstatfs``, as ``stat -f -c %t`` prints it), or None where it cannot be read."""
    libc = _libc()
    if libc is None:
        return None
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if libc.fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def shares_blocks(fd: int) -> bool:
    """True when ``os.copy_file_range`` into the file open as ``fd`` can share blocks with
    (or copy server-side from) a file beside it, rather than move the bytes through memory."""
    return hasattr(os, "copy_file_range") and file_system_type(fd) in _SHARING


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` to disk now, without
    waiting for them. Advisory; the fsync that makes the file durable is still the caller's."""
    libc = _libc()
    if libc is not None and length > 0:
        libc.sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def release(fd: int, offset: int, length: int) -> None:
    """Wait until the range is on disk, then let its pages go from the page cache (the data
    stays in the file; reading it again reads the disk)."""
    libc = _libc()
    if libc is None or length <= 0:
        return
    if libc.sync_file_range(fd, offset, length, _WAIT_FOR_RANGE) == 0:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class Streamer:
    """Streams a file being written in order to disk: call :meth:`written` with the file's
    size each time bytes were added (flushed to the file). Every ``step`` bytes the new range
    is handed to the disk; the range before it is waited for and released, so at most two
    ranges of the file sit in the page cache."""

    def __init__(self, fd: int, step: int):
        self.fd, self.step = fd, step
        self._handed = 0  # bytes handed to the disk
        self._released = 0

    def due(self, size: int) -> bool:
        return size - self._handed >= self.step

    def written(self, size: int) -> None:
        if not self.due(size):
            return
        start_writeback(self.fd, self._handed, size - self._handed)
        if self._handed > self._released:
            release(self.fd, self._released, self._handed - self._released)
            self._released = self._handed
        self._handed = size
