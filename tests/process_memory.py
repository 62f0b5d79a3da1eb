"""The resident memory of a process and all its descendants, sampled while it runs (Linux).

``ru_maxrss`` is one process's high-water mark; an export that prepares HTP contexts in child
processes holds memory in several at once. :class:`TreeRss` sums the RSS of a process and every
process below it, every ``interval`` seconds, in a thread, and keeps the largest sum.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, as /proc lists them now (gone ones are skipped)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in task.read_text().split()]
    return found


def rss(pid: int) -> int:
    """Resident bytes of one process; 0 once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants now."""
    return sum(rss(p) for p in descendants(pid))


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
