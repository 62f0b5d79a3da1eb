"""Stages of one run at once: a ready queue over the pipeline's DAG, on threads.

A stage is ready once every stage it depends on is settled (a hit, ran, failed or skipped).
Ready stages are admitted in the sequential order while they fit: ``jobs`` threads (a stage
that declares ``cores`` takes that many), and ``memory`` bytes of the estimates stages declare
(:meth:`~graphbuild.engine.pipeline.Pipeline.declare_cost`). A stage that does not fit waits,
and the stages after it wait behind it (no overtaking: the admitted order is the sequential
one), unless nothing runs: a stage larger than the budget runs alone. A ready stage that must
run alone (``exclusive``) goes before the others: nothing new starts until the running stages
end, then it runs, so such stages (an LLM's part captures, ready early) run back to back and
do not stall the stages after them one by one. Beside it run only stages whose work is in a
child process and that read no model (``apart``: an HTP context preparation), so a part's
preparation overlaps the next part's tracing.

Threads, not processes: the heavy work of a stage is torch kernels and hashing, which release
the GIL, or a child process (HTP context preparation). Every stage settles through the same
code as a sequential run (:meth:`~graphbuild.engine.scheduler._Run.step`) under one lock that
a thread leaves while its stage computes, encodes its output, loads a cache entry or waits on a
lease; so keys, leases, cache writes, records and events are made one at a time, and the
report (stage records in the pipeline's order) is a sequential run's. A value two stages both
need is loaded once (a lock per stage). A rematerialized output is let go once its last reader
settled, as in a sequential run (:mod:`~graphbuild.engine.release`), so parts built at once
do not hold every part's copy to the run's end. A stage that fails skips its dependents and the run
goes on with the others, as a sequential run does; an error outside a stage (a key that
differs from the expected one, an interrupt) stops new work and is raised once the running
stages end.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any

from graphbuild.engine.events import StageEvent
from graphbuild.engine.parallel import workers
from graphbuild.engine.pipeline import Cost
from graphbuild.engine.sizes import parse_memory

__all__ = [
    "Admission",
    "build_resources",
    "default_jobs",
    "default_memory",
    "parse_memory",
    "record_timeline",
    "run_concurrently",
]

#: Share of the memory available when a build starts that its stages may declare at once.
MEMORY_SHARE = 0.8


def default_memory() -> int | None:
    """Bytes the stages of a build may declare at once: :data:`MEMORY_SHARE` of what the
    machine has available (``MemAvailable``); None where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * MEMORY_SHARE)
    except (OSError, ValueError, IndexError):
        pass
    return None


def build_resources(
    jobs: int | None, memory: int | None, parallel_safe: bool
) -> tuple[int, int | None]:
    """The ``jobs`` and ``memory`` budget a build runs with, for a pipeline that declares its
    stages safe to run at once (``Pipeline.parallel_safe``: each declared what it holds, and
    those that must run alone say so): ``jobs`` as asked (1: one at a time), else what the
    machine allows (None, the default, or 0: :func:`default_jobs`); ``memory`` as asked, else
    :func:`default_memory` once more than one stage may run. Any other pipeline runs one
    stage at a time."""
    if not parallel_safe:
        return 1, None
    jobs = default_jobs() if not jobs else max(1, jobs)
    return jobs, (default_memory() if memory is None and jobs > 1 else memory)


def default_jobs() -> int:
    """Stages at once by default: one per usable core (the memory budget bounds the heavy
    ones)."""
    return workers()


class Admission:
    """What the scheduler admitted: each admitted stage's declared memory and cores, and the
    most of each that ran at once (``peak_memory``, ``peak_cores``), for reports and tests."""

    def __init__(self, jobs: int, memory: int | None):
        self.jobs, self.memory = jobs, memory
        self.cores = self.bytes = 0
        self.peak_memory = self.peak_cores = 0
        self.exclusive = False  # an exclusive stage runs
        self.near = 0  # running stages that are not ``apart`` (work in this process)

    def fits(self, cost: Cost, anything_running: bool) -> bool:
        if not anything_running:
            return True  # a stage over the budget runs alone rather than never
        if self.cores + cost.cores > self.jobs:
            return False
        if (cost.exclusive and self.near) or (self.exclusive and not cost.apart):
            return False  # alone, but for stages whose work is in a child process
        return self.memory is None or self.bytes + cost.memory <= self.memory

    def take(self, cost: Cost) -> None:
        self.cores += cost.cores
        self.bytes += cost.memory
        self.exclusive = self.exclusive or cost.exclusive
        self.near += not cost.apart
        self.peak_cores = max(self.peak_cores, self.cores)
        self.peak_memory = max(self.peak_memory, self.bytes)

    def give_back(self, cost: Cost) -> None:
        self.cores -= cost.cores
        self.bytes -= cost.memory
        self.exclusive = self.exclusive and not cost.exclusive
        self.near -= not cost.apart


def run_concurrently(run: Any, jobs: int, memory: int | None) -> Admission:
    """Settle every stage of ``run`` (a :class:`~graphbuild.engine.scheduler._Run`) with up to
    ``jobs`` at once within ``memory`` bytes; fills ``run.timeline``. Returns what it admitted."""
    big = threading.RLock()
    stage_locks = {name: threading.Lock() for name in run.order}
    admission = Admission(jobs, memory)

    @contextlib.contextmanager
    def unlocked() -> Iterator[None]:
        big.release()
        try:
            yield
        finally:
            big.acquire()

    @contextlib.contextmanager
    def stage_lock(name: str) -> Iterator[None]:
        lock = stage_locks[name]
        with unlocked():  # wait for the loading thread without holding up the others
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    sequential = run.unlocked, run.stage_lock  # once the run is over: outputs load as usual
    run.unlocked, run.stage_lock = unlocked, stage_lock
    listeners = list(run.listeners)
    run.listeners = [_with_worker(listener) for listener in listeners]
    t0 = time.perf_counter()
    grad = _grad_mode()

    def settle(name: str) -> None:
        with big, _grad_enabled(grad):
            start = time.perf_counter() - t0
            try:
                run.step(name)
                run.let_go(name)  # before its dependents start: none can read what it drops
            finally:
                record_timeline(run, name, start, time.perf_counter() - t0)

    names = list(run.order)
    wanted = set(names)
    deps = {n: [d for d in run.pipeline.dependencies(n) if d in wanted] for n in names}
    costs = {n: run.pipeline.cost(n) for n in names}
    settled: set[str] = set()
    running: dict[Future[None], str] = {}
    error: BaseException | None = None
    pool = ThreadPoolExecutor(jobs, thread_name_prefix="graphbuild-stage")
    try:
        while names or running:
            while error is None:  # admit until nothing more fits
                name = _next(names, settled, deps, costs, admission, bool(running))
                if name is None:
                    break
                names.remove(name)
                admission.take(costs[name])
                task = contextvars.copy_context().run  # check mode is a context variable
                running[pool.submit(task, _settle_and_release, run, settle, name)] = name
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                name = running.pop(future)
                admission.give_back(costs[name])
                settled.add(name)
                if future.exception() is not None and error is None:
                    error = future.exception()
    finally:
        pool.shutdown(wait=True)
        run.listeners = listeners
        run.unlocked, run.stage_lock = sequential
        run.timeline.sort(key=lambda entry: (entry["start"], entry["stage"]))
    if error is not None:
        raise error
    if run.failures:  # the one a sequential run would report: the last in the order
        run.failure = run.failures[max(run.failures, key=run.order.index)]
    if names and run.stopped is None and run.failure is None:
        raise RuntimeError(f"stages never became ready: {', '.join(names)}")  # a cycle: a bug
    return admission


def _next(
    names: list[str],
    settled: set[str],
    deps: dict[str, list[str]],
    costs: dict[str, Cost],
    admission: Admission,
    anything_running: bool,
) -> str | None:
    """The next stage to start, or None. Ready stages go in the sequential order while they
    fit (no overtaking: the first that does not fit waits, and those after it); a ready stage
    that runs alone goes first, once the stages running here end; beside it, only stages whose
    work is in a child process (``apart``) start, in order."""
    ready = [n for n in names if all(d in settled for d in deps[n])]
    if admission.exclusive:
        candidates = [n for n in ready if costs[n].apart]
    else:
        candidates = [n for n in ready if costs[n].exclusive][:1] or ready
    if candidates and admission.fits(costs[candidates[0]], anything_running):
        return candidates[0]
    return None


def worker() -> str:
    """Where the stage in this thread runs, as progress and the timeline show it."""
    name = threading.current_thread().name
    return f"{os.getpid()}/{name.removeprefix('graphbuild-stage_') if 'stage' in name else 'main'}"


def _with_worker(listener: Callable[[StageEvent], None]) -> Callable[[StageEvent], None]:
    def emit(event: StageEvent) -> None:
        listener(replace(event, worker=event.worker or worker()))

    return emit


def record_timeline(run: Any, name: str, start: float, end: float) -> None:
    """Note in ``run.timeline`` where and when stage ``name`` settled (seconds from the run's
    start)."""
    record = run.states[name].record
    run.timeline.append(
        {
            "stage": name,
            "worker": worker(),
            "start": round(start, 4),
            "end": round(end, 4),
            "status": str(record.status),
        }
    )


def _grad_mode() -> bool | None:
    """torch's grad mode in the calling thread (thread-local in torch: the stages' threads
    get the caller's), None without torch."""
    import sys

    torch = sys.modules.get("torch")
    return None if torch is None else torch.is_grad_enabled()


def _grad_enabled(mode: bool | None) -> contextlib.AbstractContextManager[Any]:
    if mode is None:
        return contextlib.nullcontext()
    import torch

    return torch.set_grad_enabled(mode)


def _settle_and_release(run: Any, settle: Callable[[str], None], name: str) -> None:
    """``settle(name)`` in a pool thread, then close the cache connection the thread opened:
    the pool's threads end with the run, and a connection left to them would stay open until
    the garbage collector found it."""
    try:
        settle(name)
    finally:
        if run.cache is not None:
            run.cache.release_thread()
