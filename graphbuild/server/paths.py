"""Where the server of this user and this Python environment listens, and whether to use
one. Imports nothing beyond the standard library: the thin client reads it."""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import tempfile
from pathlib import Path

__all__ = [
    "environment_key",
    "idle_seconds",
    "runtime_dir",
    "server_wanted",
    "socket_path",
]

DEFAULT_IDLE_SECONDS = 900.0
#: the variables batch schedulers (Slurm, PBS/Torque, LSF) set in a job
BATCH_JOBS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")


def environment_key() -> str:
    """What a server is shared by: the interpreter, its environment, the graphbuild it imports
    and the version, and ``PYTHONPATH`` (another checkout is another server)."""
    import graphbuild
    from graphbuild.version import __version__

    parts = [
        sys.executable,
        sys.prefix,
        os.path.dirname(os.path.realpath(graphbuild.__file__)),
        __version__,
        os.environ.get("PYTHONPATH", ""),
        f"{sys.version_info.major}.{sys.version_info.minor}",
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def runtime_dir() -> Path:
    """``$GRAPHBUILD_SERVER_DIR``, else ``$XDG_RUNTIME_DIR/graphbuild``, else
    ``<tmp>/graphbuild-<uid>``; created 0700. A directory another user owns or others may
    write to is refused (``PermissionError``): a socket there could be anyone's."""
    given = os.environ.get("GRAPHBUILD_SERVER_DIR")
    if given:
        path = Path(given)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "graphbuild"
    else:
        path = Path(tempfile.gettempdir()) / f"graphbuild-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory of this user")
    if info.st_mode & 0o077:
        raise PermissionError(f"{path} may be read or written by other users (chmod 700 it)")
    return path


def socket_path() -> Path:
    return runtime_dir() / f"server-{environment_key()}.sock"


def server_wanted(env: dict[str, str] | os._Environ | None = None) -> bool:
    """``GRAPHBUILD_SERVER=1`` or ``0`` decides; unset, a server is used except in CI
    (``CI`` set), under pytest (a test must not leave a server behind) and in a batch job
    (``SLURM_JOB_ID``, ``PBS_JOBID``, ``LSB_JOBID``: a server started by one job would serve
    the next job of the user on that node from inside the first one's allocation)."""
    env = os.environ if env is None else env
    value = env.get("GRAPHBUILD_SERVER", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    ci = env.get("CI", "").strip().lower()
    if ci not in ("", "0", "false") or "PYTEST_CURRENT_TEST" in env:
        return False
    return not any(env.get(job) for job in BATCH_JOBS)


def idle_seconds(env: dict[str, str] | os._Environ | None = None) -> float:
    """How long a server waits for a command before it exits
    (``GRAPHBUILD_SERVER_IDLE``, seconds; 15 minutes by default)."""
    env = os.environ if env is None else env
    try:
        return float(env.get("GRAPHBUILD_SERVER_IDLE", DEFAULT_IDLE_SECONDS))
    except ValueError:
        return DEFAULT_IDLE_SECONDS
