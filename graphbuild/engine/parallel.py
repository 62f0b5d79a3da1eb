"""One process-wide thread pool for work that releases the GIL: hashing (xxhash) and tensor
kernels (torch). Threads, not processes: the work reads tensors in place, and both libraries
drop the GIL for the length of a buffer, so a model's tensors go through at the speed of all
cores without a copy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["MAX_WORKERS", "parallel_map", "workers"]

T = TypeVar("T")
R = TypeVar("R")

#: Threads at most, whatever the core count (memory bandwidth is shared well before this).
MAX_WORKERS = 16

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_IN_WORKER = threading.local()


def workers() -> int:
    """Threads the pool runs: one per usable core, at most :data:`MAX_WORKERS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                workers(), thread_name_prefix="graphbuild-worker", initializer=_mark_worker
            )
        return _POOL


def _mark_worker() -> None:
    _IN_WORKER.active = True


def parallel_map(fn: Callable[[T], R], items: Iterable[T], *, parallel: bool = True) -> list[R]:
    """``[fn(x) for x in items]``, spread over the pool when ``parallel`` and there are at
    least two items and two workers. Results keep the items' order; the first exception (in
    item order) is raised once every item has finished, so no work outlives the call. Called
    from a pool thread, it runs in that thread (a nested map would wait on itself)."""
    seq: Sequence[T] = items if isinstance(items, Sequence) else list(items)
    nested = getattr(_IN_WORKER, "active", False)
    if not parallel or nested or len(seq) < 2 or workers() < 2:
        return [fn(x) for x in seq]
    futures = [_pool().submit(fn, x) for x in seq]
    errors = [f.exception() for f in futures]  # waits for every item
    for err in errors:
        if err is not None:
            raise err
    return [f.result() for f in futures]
