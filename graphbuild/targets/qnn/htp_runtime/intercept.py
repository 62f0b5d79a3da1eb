"""What QNN's libraries write to the process's stdout and stderr, taken from them.

onnxruntime logs from C++ to file descriptor 2 (QNN EP's reasons for the nodes it leaves are
there), and QNN's HTP libraries print a line of their own to descriptor 1 when they load,
which would corrupt ``graphbuild export --json`` on stdout. While QNN is loaded or compiles,
both descriptors point at a temporary file; C's stdio buffers are flushed into it before they
are restored, and its text is handed back for parsing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
from collections.abc import Iterator

__all__ = ["intercepted_output"]

_lock = threading.Lock()


def _flush_c_stdio() -> None:
    with contextlib.suppress(Exception):  # no libc symbol table (not Linux/macOS): nothing buffered
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def intercepted_output() -> Iterator[list[str]]:
    """Everything written to file descriptors 1 and 2 meanwhile, as one text appended to the
    yielded list when the block ends."""
    got: list[str] = []
    with _lock, tempfile.TemporaryFile(mode="w+b") as sink:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        try:
            for fd in saved:
                os.dup2(sink.fileno(), fd)
            yield got
        finally:
            _flush_c_stdio()
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            sink.seek(0)
            got.append(sink.read().decode("utf-8", "replace"))
