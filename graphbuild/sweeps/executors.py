"""Where a sweep's jobs run: this process, a local pool of processes, or Ray tasks.

Every executor runs :func:`graphbuild.engine.batch.run_job` on a variant built from its
:class:`~.builds.VariantSpec`, against the cache a :class:`~.builds.CacheSpec` opens: the cache
is the only transport. Jobs carry keys and names, results are small; nothing else travels.

- ``inline`` (``--jobs 1``): in this process, with the variants it has already built.
- ``local`` (``--jobs N``, the default): a pool of N processes started fresh (``spawn``: a
  fork of a process running torch's threads is unsafe). A worker that dies breaks the pool:
  the jobs it had fail, with the reason.
- ``ray`` (``--executor ray --ray-address ADDRESS``, the ``ray`` extra): one Ray task per job,
  on the cluster at ADDRESS (``auto``: the one this machine belongs to; none: a local one
  started for the sweep). Ray schedules them and retries a task whose worker died (up to
  ``max_retries`` times); the dead worker left no entry a reader accepts and its lease
  expires, so the retry builds the key again. Workers open the cache with the sweep's URL in
  front of their own local directory (``$GRAPHBUILD_CACHE_DIR`` where they run), or, without
  a URL, the sweep's directory, which every node must then reach at the same path.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from typing import TYPE_CHECKING, Any

from graphbuild.engine.batch import JobResult, StageJob, run_job, worker_name
from graphbuild.errors import ConfigError, GraphbuildError

if TYPE_CHECKING:
    from graphbuild.sweeps.builds import CacheSpec, VariantBuilds, VariantSpec

__all__ = ["EXECUTORS", "InlineJobs", "PoolJobs", "RayJobs", "make_executor"]

EXECUTORS = ("local", "ray")

# A worker process's variants and cache, made on its first job (one sweep per process).
_WORKER: dict[str, Any] = {}


def _worker_state(specs: tuple[VariantSpec, ...], cache_spec: CacheSpec) -> Any:
    key = (specs, cache_spec)
    if _WORKER.get("key") != key:
        from graphbuild.sweeps.builds import VariantBuilds

        warnings.filterwarnings("ignore")  # the sweep reports; workers' library notes are noise
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        from graphbuild.engine import digest_memo
        from graphbuild.sweeps.builds import KEEP_VALUES

        cache = cache_spec.open()
        cache.keep_values(KEEP_VALUES)  # jobs here reread what earlier jobs made
        digest_memo.reuse_across_runs(True)  # this process built its models; nothing edits them
        _WORKER.update(key=key, builds=VariantBuilds(specs, cache), cache=cache)
    return _WORKER


def run_in_worker(
    specs: tuple[VariantSpec, ...], cache_spec: CacheSpec, job: StageJob
) -> JobResult:
    """A job in a worker process: build its variant (once per process), then its stage."""
    try:
        state = _worker_state(specs, cache_spec)
        build = state["builds"][job.build].build
    except (GraphbuildError, OSError) as err:
        return JobResult(job.key, "failed", 0.0, worker_name(), f"variant {job.build}: {err}")
    return run_job(build, job, state["cache"])


class InlineJobs:
    """Runs each job in this process as it is submitted."""

    def __init__(self, builds: VariantBuilds):
        self.builds = builds

    def submit(self, job: StageJob) -> Future[JobResult]:
        future: Future[JobResult] = Future()
        future.set_result(run_job(self.builds[job.build].build, job, self.builds.cache))
        return future

    def close(self) -> None:
        pass


def _init_pool_worker(
    specs: tuple[VariantSpec, ...], cache_spec: CacheSpec, torch_log_level: int
) -> None:
    _WORKER.update(specs=specs, cache_spec=cache_spec)
    if torch_log_level:  # the parent's (the CLI lowers torch's): torch sets its own on import
        import torch  # noqa: F401

        logging.getLogger("torch").setLevel(torch_log_level)


def _pool_job(job: StageJob) -> JobResult:
    return run_in_worker(_WORKER["specs"], _WORKER["cache_spec"], job)


class PoolJobs:
    """Runs jobs on a pool of ``jobs`` fresh local processes."""

    def __init__(self, specs: tuple[VariantSpec, ...], cache_spec: CacheSpec, jobs: int):
        self.pool = ProcessPoolExecutor(
            max_workers=jobs,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_pool_worker,
            initargs=(specs, cache_spec, logging.getLogger("torch").level),
        )

    def submit(self, job: StageJob) -> Future[JobResult]:
        return self.pool.submit(_pool_job, job)

    def close(self) -> None:  # idempotent
        self.pool.shutdown(wait=True, cancel_futures=True)


def _ray_job(shared: tuple[tuple[VariantSpec, ...], CacheSpec], job: StageJob) -> JobResult:
    specs, cache_spec = shared
    return run_in_worker(specs, cache_spec, job)


class RayJobs:
    """Runs each job as a Ray task on the cluster at ``address``."""

    def __init__(
        self,
        specs: tuple[VariantSpec, ...],
        cache_spec: CacheSpec,
        address: str | None,
        *,
        max_retries: int = 3,
        resources: Callable[[StageJob], Mapping[str, Any]] | None = None,
    ):
        try:
            import ray
        except ImportError as err:
            raise ConfigError("--executor ray needs Ray: pip install 'graphbuild[ray]'") from err
        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            local = {"include_dashboard": False} if address is None else {}
            with contextlib.redirect_stdout(None):
                ray.init(address=address, log_to_driver=False, configure_logging=False, **local)
        self.shared = ray.put((specs, cache_spec))
        self.task = ray.remote(max_retries=max_retries, retry_exceptions=False, num_cpus=1)(
            _ray_job
        )
        self.resources = resources  # a job's Ray resource requests (num_cpus, memory)
        self.largest = largest_node(ray.nodes()) if resources is not None else {}

    def submit(self, job: StageJob) -> Future[JobResult]:
        wanted = dict(self.resources(job)) if self.resources is not None else {}
        wanted = within_largest_node(wanted, self.largest)
        task = self.task.options(**wanted) if wanted else self.task
        return task.remote(self.shared, job).future()

    def close(self) -> None:  # idempotent
        if self.started:
            self.ray.shutdown()
            self.started = False


#: Ray's names of the resources a stage's declared cost asks for, by ``ray.nodes()``'s names.
_RAY_RESOURCES = {"num_cpus": "CPU", "memory": "memory"}


def largest_node(nodes: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The most of each requestable resource (``num_cpus``, ``memory``) one live node of the
    cluster has, from ``ray.nodes()``."""
    largest: dict[str, float] = {}
    for node in nodes:
        if not node.get("Alive", True):
            continue
        offered = node.get("Resources") or {}
        for option, name in _RAY_RESOURCES.items():
            if name in offered:
                largest[option] = max(largest.get(option, 0.0), float(offered[name]))
    return largest


def within_largest_node(wanted: Mapping[str, Any], largest: Mapping[str, float]) -> dict[str, Any]:
    """``wanted`` with each request no larger than the largest node offers: Ray queues a task
    that no node can hold until one that can joins, so a stage declaring more memory (or
    cores) than any node has would wait forever; it runs on the largest node instead, as a
    local build runs a stage larger than its budget alone rather than never."""
    out = dict(wanted)
    for option, most in largest.items():
        if option in out and out[option] > most:
            out[option] = int(most) if option == "memory" else most
    return out


def make_executor(
    kind: str,
    specs: tuple[VariantSpec, ...],
    builds: VariantBuilds,
    cache_spec: CacheSpec,
    *,
    jobs: int,
    ray_address: str | None = None,
    max_retries: int = 3,
) -> InlineJobs | PoolJobs | RayJobs:
    """The executor a sweep asked for."""
    if kind == "ray":
        return RayJobs(specs, cache_spec, ray_address, max_retries=max_retries)
    if kind != "local":
        raise ConfigError(f"unknown executor {kind!r}; known: {', '.join(EXECUTORS)}")
    if ray_address:
        raise ConfigError("--ray-address is for --executor ray")
    if jobs <= 1:
        return InlineJobs(builds)
    return PoolJobs(specs, cache_spec, jobs)
