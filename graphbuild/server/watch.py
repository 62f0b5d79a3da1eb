"""``graphbuild export --watch``: export, then export again whenever a file the export
depends on changes: the configuration, the project's sources the model's build imported
(the model and calibration factories' code among them) and every file the build read (a
checkpoint, a data file). Each export reports its stages as usual, so the lines show what
reran; between exports a line names the files that changed.

Each export is a command of its own (on the build server, or a fresh process with
``--no-server``), so an edited module is imported again. ``--watch-runs N`` stops after N
exports (for scripts and tests); Ctrl-C stops it otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["watch"]

POLL_SECONDS = 0.25


def _options(argv: list[str]) -> tuple[list[str], int | None]:
    """``argv`` without ``--watch`` and ``--watch-runs N``; N (None: no limit)."""
    out, runs, skip = [], None, False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--watch":
            continue
        if arg == "--watch-runs" and i + 1 < len(argv):
            runs, skip = int(argv[i + 1]), True
        elif arg.startswith("--watch-runs="):
            runs = int(arg.partition("=")[2])
        else:
            out.append(arg)
    return out, runs


def _config_files(argv: list[str]) -> dict[str, str]:
    """The config file the export reads (``--config``, else the one found upward)."""
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            return {str(Path(argv[i + 1]).resolve()): "configuration"}
        if arg.startswith("--config="):
            return {str(Path(arg.partition("=")[2]).resolve()): "configuration"}
    from graphbuild.config import find_config

    found = find_config(os.getcwd())
    return {str(found): "configuration"} if found else {}


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


def _shown(path: str) -> str:
    with contextlib.suppress(ValueError):
        return os.path.relpath(path)
    return path


def watch(argv: list[str], use_server: bool) -> int:
    """Export, then export again on every change, until interrupted or ``--watch-runs``."""
    from graphbuild.server.client import run_served

    argv, runs = _options(argv)
    done, code = 0, 0
    files: dict[str, str] = _config_files(argv)
    with tempfile.TemporaryDirectory(prefix="graphbuild-watch-") as tmp:
        report = os.path.join(tmp, "watch.json")
        try:
            while True:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(report)
                # stamps from before the export: a file edited while it runs counts as changed
                started = {p: _stamp(p) for p in files}
                env = {**os.environ, "GRAPHBUILD_WATCH_REPORT": report}
                served = run_served(argv, env) if use_server else None
                if served is None:
                    command = [sys.executable, "-m", "graphbuild", "--no-server", *argv]
                    served = subprocess.run(command, env=env).returncode
                code = served
                done += 1
                with contextlib.suppress(OSError, ValueError), open(report) as f:
                    files = json.load(f)["files"]
                files = {**files, **_config_files(argv)}
                if runs is not None and done >= runs:
                    return code
                before = {p: started[p] if p in started else _stamp(p) for p in files}
                print(
                    f"watch: export {done} exited {code}; watching {len(files)} files "
                    "(Ctrl-C to stop)",
                    file=sys.stderr,
                    flush=True,
                )
                while True:
                    time.sleep(POLL_SECONDS)
                    changed = [p for p in files if _stamp(p) != before[p]]
                    if changed:
                        break
                for path in changed:
                    print(f"watch: {_shown(path)} changed ({files[path]})", file=sys.stderr)
        except KeyboardInterrupt:
            return code
