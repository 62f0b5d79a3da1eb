"""A back end's work in a fresh Python process: a crash there (a driver, a backend's teardown,
an abort in native code) cannot take the export down, and a process's global state (a
registered execution provider, an environment for a Vulkan layer) ends with it."""

from __future__ import annotations

import os
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
