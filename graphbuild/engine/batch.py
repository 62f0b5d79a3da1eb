"""A batch of builds over one cache: each distinct stage key runs once across all of them.

A sweep exports one model N ways (presets, calibration sets, options). Run one after another,
N exports share only what the cache happens to hold when each starts; here the batch keys
every build's stages wave by wave: a stage's key is known once the digests of its upstream
outputs are (a hit, or a job that finished), and every stage whose key is known forms the next
wave. A key whose entry serves (:func:`~graphbuild.engine.rebuild.decide`) is a hit; each
other distinct key is one :class:`StageJob`, however many builds need it, handed to an
:class:`Executor` (this process, a pool of processes, Ray tasks). What ``capture`` and ``to_onnx`` share across presets runs once, not N times.

The cache is the transport: a job loads its inputs from the cache by key, builds its stage
and stores the output there (:func:`run_job`, the rebuilder of :mod:`.scheduler` restricted
to one stage, which must compute the key the batch planned, else
:class:`~graphbuild.errors.KeyMismatchError`). The batch reads back only the new manifest, whose
output digest keys the next wave (early cutoff holds across builds: a stage that reran with an
identical output gives its dependents the same key). Nothing but keys and small results travel
between processes; a job that dies leaves no entry (blobs first, manifest last) and its lease
expires, so the executor's retry builds it again.

A stage whose key cannot be computed (an input that cannot be fingerprinted) cannot travel
through the cache: it and its dependents are ``deferred`` to the caller, who builds them in
its own process (a sweep's final, per-variant export does).
"""

from __future__ import annotations

import enum
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import networkx as nx

from graphbuild.engine.keying import Keys
from graphbuild.engine.rebuild import decide
from graphbuild.engine.scheduler import run_pipeline
from graphbuild.engine.status import StageStatus
from graphbuild.errors import GraphbuildError

if TYPE_CHECKING:
    from graphbuild.engine.artifact_store import Cache
    from graphbuild.engine.fingerprint import InputFacets
    from graphbuild.engine.pipeline import Pipeline

__all__ = [
    "BatchEvent",
    "BatchReport",
    "BatchStatus",
    "Build",
    "Executor",
    "InlineExecutor",
    "JobRecord",
    "JobResult",
    "StageJob",
    "run_batch",
    "run_job",
    "worker_name",
]


class BatchStatus(str, enum.Enum):
    """What happened to one stage of one build in a batch.

    ``hit``: the cache held its key before the batch needed it. ``ran``: a job ran it for this
    build. ``shared``: a job for another build ran the same key (this build ran nothing).
    ``failed``, ``skipped`` (an upstream stage failed), ``deferred`` (no cacheable key: the
    caller builds it in its own process)."""

    HIT = "hit"
    RAN = "ran"
    SHARED = "shared"
    FAILED = "failed"
    SKIPPED = "skipped"
    DEFERRED = "deferred"

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass
class Build:
    """One build of a batch: a pipeline over its input, samples and context. ``facets``:
    fingerprints of the input and samples shared with the batch's other builds over the very
    same objects (which the batch's owner promises not to change while it runs)."""

    name: str
    pipeline: Pipeline
    input: Any
    samples: Any
    context: Mapping[str, Any]
    run_id: str
    facets: InputFacets | None = None


@dataclass(frozen=True)
class StageJob:
    """Build stage ``stage`` of build ``build`` under ``key``; ``expect`` holds the key of that
    stage and of every stage it needs, as the batch computed them."""

    build: str
    stage: str
    key: str
    expect: Mapping[str, str]


@dataclass(frozen=True)
class JobResult:
    """What a job reports back: ``ran``, ``hit`` (another process built the key while the
    job waited on its lease) or ``failed`` (with the error, as text: exceptions do not
    always survive a trip between processes)."""

    key: str
    status: str
    seconds: float = 0.0
    worker: str = ""
    error: str | None = None


class Executor(Protocol):
    """Runs jobs somewhere: ``submit`` returns a future of the job's :class:`JobResult`."""

    def submit(self, job: StageJob) -> Future[JobResult]: ...


def worker_name() -> str:
    """``host:pid``: where a job ran, as reports show it."""
    return f"{socket.gethostname()}:{os.getpid()}"


def run_job(build: Build, job: StageJob, cache: Cache) -> JobResult:
    """Build one job's stage here (in whatever process the executor chose): the stages it
    needs are hits in ``cache``, its output is stored there. Errors come back as a failed
    result whose text names the stage."""
    t0 = time.perf_counter()
    try:
        result = run_pipeline(
            build.pipeline,
            build.input,
            build.samples,
            context=build.context,
            cache=cache,
            run_id=build.run_id,
            targets=[job.stage],
            expect_keys=job.expect,
            facets=build.facets,
        )
    except GraphbuildError as err:
        return JobResult(job.key, "failed", time.perf_counter() - t0, worker_name(), str(err))
    except Exception as err:
        text = f"stage '{job.stage}': {type(err).__name__}: {err}"
        return JobResult(job.key, "failed", time.perf_counter() - t0, worker_name(), text)
    record = result.report[job.stage]
    status = "ran" if record.status == StageStatus.RAN else "hit"
    return JobResult(job.key, status, record.seconds, worker_name())


class InlineExecutor:
    """Runs each job in this process as it is submitted (the builds are at hand)."""

    def __init__(self, builds: Iterable[Build], cache: Cache):
        self.builds = {b.name: b for b in builds}
        self.cache = cache

    def submit(self, job: StageJob) -> Future[JobResult]:
        future: Future[JobResult] = Future()
        future.set_result(run_job(self.builds[job.build], job, self.cache))
        return future


@dataclass(frozen=True)
class BatchEvent:
    """One thing that happened in a batch: a job ``queued`` (handed to the executor) or
    finished (``ran``, ``hit``, ``failed``), or a stage of a build resolved without a job
    (``hit``, ``shared``, ``skipped``, ``deferred``)."""

    kind: str
    build: str
    stage: str
    key: str | None = None
    seconds: float = 0.0
    worker: str = ""
    detail: str | None = None


@dataclass
class StageOutcome:
    """One stage of one build: its status in the batch, key, output digest and where and
    how long its job ran (for ``ran``), or why it did not complete."""

    status: BatchStatus
    key: str | None = None
    digest: str | None = None
    seconds: float = 0.0
    worker: str = ""
    detail: str | None = None


@dataclass
class JobRecord:
    """One job: its key and stage, every (build, stage) that needed it, and its result."""

    job: StageJob
    needed_by: list[tuple[str, str]]
    result: JobResult | None = None


@dataclass
class BatchReport:
    """Every stage of every build, and every job the batch ran."""

    stages: dict[str, dict[str, StageOutcome]]
    jobs: list[JobRecord]
    seconds: float = 0.0

    def runs_per_stage(self) -> dict[str, int]:
        """How many times each stage name ran across the batch (a stage every build shares
        by key ran once)."""
        out: dict[str, int] = {}
        for record in self.jobs:
            if record.result is not None and record.result.status == "ran":
                out[record.job.stage] = out.get(record.job.stage, 0) + 1
        return out

    def failures(self) -> dict[str, str]:
        """Build -> the first failure that stopped it."""
        out = {}
        for build, stages in self.stages.items():
            for name, outcome in stages.items():
                if outcome.status == BatchStatus.FAILED:
                    out[build] = f"stage '{name}': {outcome.detail}"
                    break
        return out


class _Batch:
    def __init__(
        self,
        builds: Iterable[Build],
        cache: Cache,
        executor: Executor,
        listeners: Iterable[Callable[[BatchEvent], None]],
    ):
        self.builds = {b.name: b for b in builds}
        self.cache = cache
        self.executor = executor
        self.listeners = list(listeners)
        self.keys = {
            b.name: Keys(b.pipeline, b.input, b.samples, b.context, cache, b.run_id, b.facets)
            for b in self.builds.values()
        }
        self.todo = {name: list(k.order) for name, k in self.keys.items()}
        self.outcomes: dict[str, dict[str, StageOutcome]] = {b: {} for b in self.builds}
        self.inflight: dict[str, tuple[Future[JobResult], JobRecord]] = {}
        self.finished: dict[str, tuple[str, JobRecord]] = {}  # key -> (digest, its job)
        self.jobs: list[JobRecord] = []

    def emit(self, event: BatchEvent) -> None:
        for listener in self.listeners:
            listener(event)

    def run(self) -> BatchReport:
        t0 = time.perf_counter()
        while True:
            while self._wave():
                pass
            if not self.inflight:
                break
            futures = {future: key for key, (future, _) in self.inflight.items()}
            done, _ = wait(futures, return_when=FIRST_COMPLETED)
            for future in done:
                self._finish(futures[future], future)
        return BatchReport(self.outcomes, self.jobs, time.perf_counter() - t0)

    # ----------------------------------------------------------------- keying

    def _wave(self) -> bool:
        """Key every stage whose upstream outputs are known; True when any stage moved."""
        moved = False
        for build, todo in self.todo.items():
            for name in list(todo):
                deps = self.builds[build].pipeline.dependencies(name)
                outcomes = [self.outcomes[build].get(d) for d in deps]
                if any(
                    o is None or o.digest is None and o.status not in _STOPPED for o in outcomes
                ):
                    continue  # an upstream output is not known yet
                todo.remove(name)
                moved = True
                stopped = [d for d, o in zip(deps, outcomes, strict=True) if o.status in _STOPPED]
                if stopped:
                    self._stop(build, name, stopped[0])
                    continue
                self._key(build, name)
        return moved

    def _stop(self, build: str, name: str, upstream: str) -> None:
        status = self.outcomes[build][upstream].status
        kind = BatchStatus.DEFERRED if status == BatchStatus.DEFERRED else BatchStatus.SKIPPED
        why = (
            f"after '{upstream}', built by the caller"
            if kind == BatchStatus.DEFERRED
            else f"upstream '{upstream}' did not complete"
        )
        self._resolve(build, name, StageOutcome(kind, detail=why))

    def _key(self, build: str, name: str) -> None:
        keys = self.keys[build]
        keys.begin(name)
        for dep in self.builds[build].pipeline.dependencies(name):
            keys.states[dep].record.digest = self.outcomes[build][dep].digest
        key = keys.compute_key(name)
        keys.states[name].record.key = key
        if key is None:
            why, _ = keys.why(name, None)
            self._resolve(build, name, StageOutcome(BatchStatus.DEFERRED, detail=why))
            return
        if key in self.inflight:
            self.inflight[key][1].needed_by.append((build, name))
            return
        if key in self.finished:
            digest, record = self.finished[key]
            self._resolve(build, name, self._shared(key, digest, record))
            return
        found = decide(self.cache, key, keys)
        if found.hit:
            digest = found.manifest["artifact"]["digest"]  # type: ignore[index]
            self._resolve(build, name, StageOutcome(BatchStatus.HIT, key, digest))
            return
        self._submit(build, name, key)

    def _submit(self, build: str, name: str, key: str) -> None:
        states = self.keys[build].states
        needed = nx.ancestors(self.builds[build].pipeline.graph, name) | {name}
        expect = {n: states[n].record.key for n in needed if states[n].record.key}
        job = StageJob(build, name, key, expect)
        record = JobRecord(job, [(build, name)])
        self.jobs.append(record)
        self.inflight[key] = (self.executor.submit(job), record)
        self.emit(BatchEvent("queued", build, name, key))

    # ----------------------------------------------------------------- results

    def _finish(self, key: str, future: Future[JobResult]) -> None:
        _, record = self.inflight.pop(key)
        job = record.job
        try:
            result = future.result()
        except Exception as err:  # the executor gave up (a worker that died every retry)
            result = JobResult(key, "failed", error=f"{type(err).__name__}: {err}")
        record.result = result
        manifest = self.cache.lookup(key, count=False) if result.status != "failed" else None
        if result.status != "failed" and manifest is None:
            result = record.result = JobResult(
                key,
                "failed",
                result.seconds,
                result.worker,
                f"the job {result.status} on {result.worker or 'a worker'}, but this process "
                f"finds no cache entry for key {key}: the workers must share the cache "
                "(a shared cache URL, or one directory every worker reaches)",
            )
        self.emit(
            BatchEvent(
                result.status,
                job.build,
                job.stage,
                key,
                result.seconds,
                result.worker,
                result.error,
            )  # fmt: skip
        )
        if result.status == "failed":
            for build, name in record.needed_by:
                self._resolve(
                    build, name, StageOutcome(BatchStatus.FAILED, key, detail=result.error)
                )
            return
        digest = manifest["artifact"]["digest"]  # type: ignore[index]
        self.finished[key] = (digest, record)
        status = BatchStatus.RAN if result.status == "ran" else BatchStatus.HIT
        first, *others = record.needed_by
        outcome = StageOutcome(status, key, digest, result.seconds, result.worker)
        self._resolve(*first, outcome, announce=False)
        for build, name in others:
            self._resolve(build, name, self._shared(key, digest, record))

    def _shared(self, key: str, digest: str, record: JobRecord) -> StageOutcome:
        ran = record.result is not None and record.result.status == "ran"
        status = BatchStatus.SHARED if ran else BatchStatus.HIT
        return StageOutcome(status, key, digest, detail=f"built for {record.job.build}")

    def _resolve(
        self, build: str, name: str, outcome: StageOutcome, *, announce: bool = True
    ) -> None:
        self.outcomes[build][name] = outcome
        if announce and outcome.status != BatchStatus.FAILED:
            self.emit(BatchEvent(outcome.status, build, name, outcome.key, detail=outcome.detail))


_STOPPED = (BatchStatus.FAILED, BatchStatus.SKIPPED, BatchStatus.DEFERRED)


def run_batch(
    builds: Iterable[Build],
    cache: Cache,
    executor: Executor | None = None,
    listeners: Iterable[Callable[[BatchEvent], None]] = (),
) -> BatchReport:
    """Build every stage of every build, each distinct key once, with ``executor`` (default:
    in this process). A failed stage stops its build's dependents; the other builds go on.
    Returns what happened to every stage and every job; nothing is placed."""
    builds = list(builds)
    names = [b.name for b in builds]
    if len(set(names)) != len(names):
        raise GraphbuildError(f"builds of one batch need distinct names: {names}")
    return _Batch(builds, cache, executor or InlineExecutor(builds, cache), listeners).run()
