"""Run the graphbuild command line and SIGKILL this process right after its N-th file move
into a directory: a kill at an exact point of placing the outputs.

    python tests/fault_worker.py DIRECTORY N graphbuild-arguments...

``os.replace`` is the move every atomic write ends with; the wrapper lets the move complete,
counts the ones whose destination is in DIRECTORY (or is DIRECTORY itself, for placement by
directory swap), and kills the process after the N-th.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def main() -> None:
    directory, after, args = Path(sys.argv[1]).resolve(), int(sys.argv[2]), sys.argv[3:]
    real_replace = os.replace
    moves = 0

    def replace_then_maybe_die(src, dst, *a, **kw):
        nonlocal moves
        real_replace(src, dst, *a, **kw)
        path = Path(os.fsdecode(dst)).resolve()
        if directory in (path, path.parent):
            moves += 1
            if moves == after:
                os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace_then_maybe_die
    from graphbuild.cli.app import main as graphbuild_main

    sys.argv = ["graphbuild", *args]
    graphbuild_main()


if __name__ == "__main__":
    main()
