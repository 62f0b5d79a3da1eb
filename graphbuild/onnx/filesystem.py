"""What the file system under an output file does for the writer: whether a range copy shares
blocks, and writing back early so that the closing fsync waits for the tail only.

``os.copy_file_range`` shares the blocks of the source where the file system can (btrfs, XFS,
bcachefs, OpenZFS) or copies on the server (NFS, SMB); elsewhere (ext4, tmpfs) it moves the
bytes through the page cache like a write, and the writer's read-back check makes it dearer
than writing a tensor that is in memory anyway. :func:`shares_blocks` tells the two apart by
the file system's magic number (``fstatfs``); unknown means no.

Linux only (through the C library); elsewhere both are no-ops that change nothing but speed.
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
_SYNC_FILE_RANGE_WRITE = 2


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
    waiting for them: the disk works while the rest of the file is written. Advisory; the
    fsync that makes the file durable is still the caller's."""
    libc = _libc()
    if libc is not None and length > 0:
        libc.sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)
