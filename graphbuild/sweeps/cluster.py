"""One export's stages as Ray tasks on a cluster (``graphbuild export --executor ray``).

The sweep's batch (:func:`~graphbuild.engine.batch.run_batch`) with a single build: every stage
whose key the cache lacks is one Ray task, run as soon as the stages it needs are done, so an
LLM's parts are built at once on the cluster's workers. The cache (a shared Redis, or one
directory every node reaches) carries the artifacts between them; a key's lease keeps two
workers from building it, and a task whose worker died is retried by Ray (its lease expires,
the retry builds the key again). Each task asks Ray for what its stage declares it holds
(:meth:`~graphbuild.engine.pipeline.Pipeline.declare_cost`: ``memory`` bytes, ``cores`` CPUs).

Then this process exports as usual: every stage a hit, the files placed from the cache. The
report's timeline says which worker built which stage, and when (seconds from the start,
queued and finished as this process saw them).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.batch import BatchEvent, BatchReport, StageJob, run_batch
from graphbuild.engine.events import EventKind, StageEvent
from graphbuild.errors import ExportError
from graphbuild.sweeps.builds import CacheSpec, VariantBuilds, VariantSpec
from graphbuild.sweeps.executors import RayJobs

__all__ = ["ClusterExport", "export_on_cluster"]

_KINDS = {
    "queued": EventKind.STARTED,
    "ran": EventKind.RAN,
    "failed": EventKind.FAILED,
    "hit": EventKind.HIT,
    "shared": EventKind.HIT,
    "skipped": EventKind.SKIPPED,
}


@dataclass
class ClusterExport:
    """What :func:`export_on_cluster` did: the export's artifacts (report with the cluster's
    timeline), the batch's report, and how many times each stage ran on the cluster."""

    artifacts: Any
    batch: BatchReport
    timeline: list[dict[str, Any]] = field(default_factory=list)

    @property
    def stage_runs(self) -> dict[str, int]:
        return self.batch.runs_per_stage()


def export_on_cluster(
    config: str | os.PathLike | None,
    cwd: str | os.PathLike,
    overrides: Iterable[Any],
    cache: Cache,
    *,
    cache_url: str | None,
    ray_address: str | None,
    max_retries: int = 3,
    listeners: Iterable[Callable[[StageEvent], None]] = (),
) -> ClusterExport:
    """Build the export that ``config`` with ``overrides`` describes on the Ray cluster at
    ``ray_address`` (None: a local one), through ``cache`` (whose workers open ``cache_url``,
    or, without one, the same directory), then place its files here."""
    from graphbuild.api import export_with_pipeline

    listeners = list(listeners)
    spec = VariantSpec("export", str(config) if config else None, str(cwd), tuple(overrides))
    builds = VariantBuilds((spec,), cache)
    built = builds["export"]
    directory = None if cache_url else str(cache.path)
    cache_spec = CacheSpec(directory, cache_url, lease_seconds=cache.lease_seconds)
    pipeline = built.pipeline

    def resources(job: StageJob) -> dict[str, Any]:
        cost = pipeline.cost(job.stage)
        return {"num_cpus": cost.cores, **({"memory": cost.memory} if cost.memory else {})}

    t0 = time.perf_counter()
    queued: dict[str, float] = {}
    timeline: list[dict[str, Any]] = []

    def on_event(event: BatchEvent) -> None:
        now = round(time.perf_counter() - t0, 4)
        if event.kind == "queued":
            queued[event.stage] = now
        elif event.kind in ("ran", "failed", "hit") and event.stage in queued:
            timeline.append(
                {
                    "stage": event.stage,
                    "worker": event.worker,
                    "start": queued[event.stage],
                    "end": now,
                    "status": event.kind,
                }
            )
        kind = _KINDS.get(event.kind)
        if kind is None:
            return
        worker = event.worker or ("ray" if kind is EventKind.STARTED else "")
        error = ExportError(event.detail) if kind is EventKind.FAILED else None
        stage_event = StageEvent(
            kind, event.stage, event.key, event.seconds, event.detail, error, worker
        )
        for listener in listeners:
            listener(stage_event)

    executor = RayJobs(
        (spec,), cache_spec, ray_address, max_retries=max_retries, resources=resources
    )
    try:
        batch = run_batch([built.build], cache, executor, listeners=[on_event])
    finally:
        executor.close()
    failures = batch.failures()
    if failures:
        raise ExportError(f"the export failed on the cluster: {failures['export']}")
    request = replace(built.request, listeners=listeners, cache=cache)
    artifacts = export_with_pipeline(request)  # every stage a hit: the files placed here
    artifacts.report.timeline = sorted(timeline, key=lambda e: (e["start"], e["stage"]))
    return ClusterExport(artifacts, batch, artifacts.report.timeline)
