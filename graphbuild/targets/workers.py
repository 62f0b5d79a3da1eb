"""A back end's work in a fresh Python process: a crash there (a driver, a backend's teardown,
an abort in native code) cannot take the export down, and a process's global state (a
registered execution provider, an environment for a Vulkan layer) ends with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import graphbuild


def run_worker(
    module: str,
    args: Sequence[str],
    cwd: Path,
    *,
    env: Mapping[str, str] | None = None,
    first_on_path: Sequence[str] = (),
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """``python -m module *args`` in ``cwd`` with this graphbuild importable (after the
    folders ``first_on_path``), ``env`` (default: this process's) as its environment, its
    output captured as text; ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
    environment = dict(os.environ if env is None else env)
    root = str(Path(graphbuild.__file__).resolve().parents[1])
    environment["PYTHONPATH"] = os.pathsep.join(
        [*first_on_path, root, *filter(None, [environment.get("PYTHONPATH")])]
    )
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def describe_exit(returncode: int) -> str:
    """How a worker process ended, for an error message: a signal by name with what it usually
    means here (a crash inside the backend's native code, or the kernel's out-of-memory killer),
    else the exit code."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"killed by signal {-returncode}"
    if name == "SIGKILL":
        return "killed by SIGKILL (often the out-of-memory killer: check free memory)"
    if name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGABRT", "SIGFPE"):
        return f"crashed with {name} inside the backend's native code"
    return f"killed by {name}"
