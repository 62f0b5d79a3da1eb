"""Why a directory cannot be created or written, in words a person can act on.

The cache and the output directory are opened before any stage runs; when the system refuses
(``EROFS``, ``EACCES``), the error names the directory that stops us (a read-only file system,
another user's closed directory on the way) rather than an errno and an internal file name.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["closed_ancestor", "disk_full", "why_unwritable"]


def why_unwritable(err: OSError, path: Path) -> str:
    """Why ``path`` could not be created or written (``err`` is what the system said)."""
    if err.errno == errno.EROFS:
        return f"{_existing(path)} is on a read-only file system"
    if err.errno in (errno.EACCES, errno.EPERM):
        closed = closed_ancestor(path)
        if closed is not None:
            return f"you may not enter {closed}{_owner(closed)}"
        return f"you may not write in {_existing(path)}"
    if disk_full(err, path):
        return f"the disk holding {_existing(path)} is full ({err.strerror or err})"
    return f"{path}: {err.strerror or err}"


def disk_full(err: BaseException, path: Path) -> bool:
    """Whether ``err``, raised writing under ``path``, is a full disk: ENOSPC or a quota
    (EDQUOT), SQLite's "database or disk is full", or another write error on a writable file
    system with no space left for us (SQLite reports a full disk as a "disk I/O error" when
    it cannot grow its shared-memory file)."""
    code = getattr(err, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return True
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return False
    if "disk is full" in str(err).lower():
        return True
    try:
        st = os.statvfs(_existing(path))
    except (OSError, AttributeError):  # no statvfs (Windows), or nothing there to ask
        return False
    return not st.f_flag & os.ST_RDONLY and st.f_bavail == 0


def closed_ancestor(path: Path) -> Path | None:
    """The first directory on the way to ``path`` (``path`` included) that this user may not
    enter, or None."""
    previous = None
    for step in [*reversed(Path(os.path.abspath(path)).parents), Path(os.path.abspath(path))]:
        try:
            mode = os.stat(step).st_mode
        except PermissionError:
            return previous
        except OSError:
            return None
        if stat.S_ISDIR(mode) and not os.access(step, os.X_OK):
            return step
        previous = step
    return None


def _existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _owner(path: Path) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return ""
    if st.st_uid == os.geteuid():
        return f" (mode {stat.S_IMODE(st.st_mode):o})"
    try:
        import pwd

        owner = pwd.getpwuid(st.st_uid).pw_name
    except (ImportError, KeyError):
        owner = f"uid {st.st_uid}"
    return f" (it belongs to {owner}, mode {stat.S_IMODE(st.st_mode):o})"
