"""A back end's native log lines through graphbuild's logging.

Runtimes a stage calls in process write their own lines to the process's stderr from native
code, past Python's ``sys.stderr`` (ExecuTorch's CPU probe: ``[cpuinfo_utils.cpp:87] Failed to
open midr file ...``), where they land in the middle of graphbuild's report. While such a call
runs, file descriptor 2 goes to a temporary file; each line is then a log record of the
runtime's logger (``graphbuild.runtime.<name>``), shown where logging is configured to show it
and nowhere else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["native_lines_logged"]


@contextlib.contextmanager
def native_lines_logged(runtime: str, level: int = logging.INFO) -> Iterator[None]:
    """Within the block, what is written to file descriptor 2 becomes records of the logger
    ``graphbuild.runtime.<runtime>`` at ``level``, one per line, when the block ends."""
    logger = logging.getLogger(f"graphbuild.runtime.{runtime}")
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no descriptor 2 to take over: leave it as it is
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for line in sink.read().decode(errors="replace").splitlines():
                if line.strip():
                    logger.log(level, line.rstrip())
