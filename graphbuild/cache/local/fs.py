"""The local store's own directories, opened so that a planted symlink leads nowhere.

Whoever can write to a shared cache directory can replace ``blobs/ab`` (or ``blobs``, or
``index``) with a symbolic link to a directory of the victim's. Every path below the cache
directory is therefore opened one component at a time relative to its parent's descriptor,
with ``O_NOFOLLOW``: a link where the store keeps a directory or a file of its own is
:class:`ForeignPath`, never followed. The cache directory itself may be a link (the user's
choice: ``~/.cache/graphbuild`` -> a bigger disk).

Files and directories are created with mode 0666/0777 and the umask decides the rest, so a
group-shared cache (``chmod g+s`` on the directory, ``umask 002``) stays group-writable; the
set-group-ID bit is inherited by new directories from their parent.

Where the platform has no ``dir_fd`` support (Windows), the same operations fall back to
paths, each preceded by an ``lstat`` check of every component below the cache directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)
FD_SAFE = bool(
    _NOFOLLOW
    and _DIRECTORY
    and {os.open, os.stat, os.mkdir, os.rename, os.unlink, os.rmdir} <= os.supports_dir_fd
    and os.scandir in os.supports_fd
)
_FOREIGN = {errno.ELOOP, errno.ENOTDIR, errno.EMLINK}


class ForeignPath(OSError):
    """A symbolic link, or something that is not a directory, where the store keeps one of
    its own directories or files."""


class WrongSize(OSError):
    """A file that does not hold the number of bytes expected of it."""

    def __init__(self, found: int, expected: int):
        super().__init__(f"has {found} bytes, expected {expected}")
        self.found, self.expected = found, expected


def _foreign(where: str, what: str = "is a symbolic link or not a directory") -> ForeignPath:
    return ForeignPath(errno.ELOOP, f"{where} {what}; the cache never follows it")


class Dir:
    """One of the store's directories: a descriptor opened without following links (or, as a
    fallback, a path checked with ``lstat``). Names passed to its methods are single
    components that the caller has validated."""

    def __init__(self, path: Path, fd: int | None):
        self.path = path
        self.fd = fd

    @classmethod
    def open_root(cls, path: Path) -> Dir:
        """The cache directory itself; a link there is followed (the user chose it)."""
        if not FD_SAFE:
            if not path.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
            return cls(path, None)
        return cls(path, os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------- directories

    def sub(self, name: str, *, create: bool = False) -> Dir:
        """The subdirectory ``name``; created (umask permissions) when ``create``. Raises
        ForeignPath for a link or a file there, FileNotFoundError when absent."""
        path = self.path / name
        if not FD_SAFE:
            return self._sub_by_path(path, create)
        assert self.fd is not None
        flags = os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC
        for attempt in (0, 1):
            try:
                return Dir(path, os.open(name, flags, dir_fd=self.fd))
            except FileNotFoundError:
                if not create or attempt:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=self.fd)
            except OSError as err:
                if err.errno in _FOREIGN:
                    raise _foreign(str(path)) from err
                raise
        raise AssertionError("unreachable")

    def _sub_by_path(self, path: Path, create: bool) -> Dir:
        try:
            st = path.lstat()
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):
                path.mkdir(0o777)
            st = path.lstat()
        if not stat.S_ISDIR(st.st_mode):
            raise _foreign(str(path))
        return Dir(path, None)

    def kind(self, name: str) -> str | None:
        """'dir', 'file', 'link', 'other' or None (absent), without following a link."""
        try:
            st = self.lstat(name)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return "link"
        if stat.S_ISDIR(st.st_mode):
            return "dir"
        return "file" if stat.S_ISREG(st.st_mode) else "other"

    def move_aside(self, name: str, why: str) -> str:
        """Rename ``name`` (a link, a file, a damaged directory: the entry itself, never
        what a link points to) to ``<name>.<why>-<time>-<pid>``; the new name."""
        aside = f"{name}.{why}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}"
        if FD_SAFE:
            os.rename(name, aside, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        else:
            os.rename(self.path / name, self.path / aside)
        return aside

    # ----------------------------------------------------------------- files

    def lstat(self, name: str) -> os.stat_result:
        if FD_SAFE:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        return os.lstat(self.path / name)

    def open(self, name: str, flags: int, mode: int = 0o666) -> int:
        """``os.open`` of a file in this directory, never through a link, and never waiting:
        a FIFO planted where the store keeps a file would block a plain open until someone
        writes to it (regular files ignore ``O_NONBLOCK``). Callers check the type of what
        they opened (``fstat``) before they read."""
        flags |= _NOFOLLOW | _CLOEXEC | _BINARY | _NONBLOCK
        try:
            if FD_SAFE:
                return os.open(name, flags, mode, dir_fd=self.fd)
            if self.kind(name) == "link":
                raise _foreign(str(self.path / name), "is a symbolic link")
            return os.open(self.path / name, flags, mode)
        except OSError as err:
            if err.errno in _FOREIGN and not isinstance(err, ForeignPath):
                raise _foreign(str(self.path / name), "is a symbolic link") from err
            raise

    def read_bytes(self, name: str, size: int | None = None) -> bytes:
        """The bytes of a regular file; with ``size``, exactly that many or
        ``WrongSize``: a file of another size is not read (nothing beyond what the caller
        expects is ever held in memory)."""
        fd = self.open(name, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise _foreign(str(self.path / name), "is not a regular file")
            if size is None:
                return f.read()
            if st.st_size != size:
                raise WrongSize(st.st_size, size)
            data = f.read(size + 1)  # the file may have grown since the fstat
            if len(data) != size:
                raise WrongSize(len(data), size)
            return data

    def replace_into(self, name: str, dest: Dir, dest_name: str) -> None:
        """Atomically rename ``name`` here to ``dest_name`` in ``dest``."""
        if FD_SAFE:
            os.replace(name, dest_name, src_dir_fd=self.fd, dst_dir_fd=dest.fd)
        else:
            os.replace(self.path / name, dest.path / dest_name)

    def unlink(self, name: str) -> None:
        """Remove a file (or a link itself, never what it points to)."""
        if FD_SAFE:
            os.unlink(name, dir_fd=self.fd)
        else:
            os.unlink(self.path / name)

    def rmdir(self, name: str) -> None:
        if FD_SAFE:
            os.rmdir(name, dir_fd=self.fd)
        else:
            os.rmdir(self.path / name)

    def entries(self) -> Iterator[tuple[str, os.stat_result]]:
        """(name, lstat) of every entry; links are reported as links, never followed."""
        with os.scandir(self.fd if FD_SAFE else self.path) as it:  # type: ignore[type-var]
            found = list(it)
        for entry in found:
            try:
                yield entry.name, entry.stat(follow_symlinks=False)
            except OSError:
                continue


def is_dir_entry(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode)


def is_file_entry(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)
