"""The resident memory of a process and all its descendants, sampled while it runs (Linux).

``ru_maxrss`` is one process's high-water mark; an export that prepares HTP contexts in child
processes holds memory in several at once. :class:`TreeRss` sums the RSS of a process and every
process below it (that has started its own program), every ``interval`` seconds, in a thread,
and keeps the largest sum.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss(pid: int) -> int:
    """Resident bytes of one process; 0 once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants now. A child between fork and exec (its
    command line still its parent's) counts nothing: its pages are its parent's, shared, and
    /proc gives it its parent's whole resident size (a process of 1 GiB starting workers
    would read as 2 GiB now and then)."""
    total, todo = 0, [(pid, None)]
    while todo:
        p, parent_cmdline = todo.pop()
        cmdline = _cmdline(p)
        if p != pid and (cmdline is None or cmdline == parent_cmdline):
            continue  # gone, or not exec'd yet (its children, if any, are forks too)
        total += rss(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo += [(int(c), cmdline) for c in task.read_text().split()]
    return total


class TreeRss:
    """``with TreeRss(pid) as m: ...``: ``m.peak`` is the largest :func:`tree_rss` seen."""

    def __init__(self, pid: int | None = None, interval: float = 0.05) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, tree_rss(self.pid))
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
