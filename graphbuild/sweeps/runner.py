"""Running a sweep: plan every variant's keys together, run each distinct key once, then place
each variant's files and report.

1. Each variant's configuration is loaded and its export request built (every distinct model
   once) before anything runs: a bad key or value is an error naming the variant.
2. :func:`graphbuild.engine.batch.run_batch` keys all variants' stages wave by wave and hands
   each key the cache lacks to the executor, once, whichever variants need it.
3. Each variant is then exported into its own directory under the sweep's root as an export
   would be (``graphbuild.api``): every stage a hit (a stage that could not travel through the
   cache runs here), the files placed, the reports (numerics, coverage, a device check) read.
4. One row per variant goes into ``sweep.json``, ``sweep.csv`` and ``sweep.png``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphbuild.engine import digest_memo
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.batch import BatchEvent, BatchReport, BatchStatus, run_batch
from graphbuild.errors import ConfigError, GraphbuildError
from graphbuild.sweeps import report as reports
from graphbuild.sweeps.builds import KEEP_VALUES, CacheSpec, VariantBuilds, VariantSpec
from graphbuild.sweeps.executors import make_executor
from graphbuild.sweeps.memory import InMemory
from graphbuild.sweeps.variants import SweepSettings, Variant

__all__ = ["SweepEvent", "SweepResult", "run_sweep"]

DEFAULT_OUTPUT_DIR = "sweep-out"
MAX_DEFAULT_JOBS = 8


@dataclass(frozen=True)
class SweepEvent:
    """Progress of a sweep: ``planned`` (variants built, keys being computed), a batch event
    (``queued``, ``ran``, ``hit``, ``shared``, ``failed``...: :class:`BatchEvent`), ``placed``
    (a variant's files are in place) or ``variant_failed``."""

    kind: str
    variant: str = ""
    stage: str = ""
    seconds: float = 0.0
    worker: str = ""
    detail: str | None = None


@dataclass
class SweepResult:
    """What a sweep did: its rows (one per variant), the summary, the batch's report and the
    files it wrote (``json``, ``csv``, ``png`` when plotted)."""

    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    batch: BatchReport
    files: dict[str, Path] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[str]:
        return [r["variant"] for r in self.rows if r["status"] != "ok"]


def run_sweep(
    settings: SweepSettings,
    *,
    config: str | os.PathLike | None,
    cwd: str | os.PathLike,
    base_overrides: Iterable[tuple[str, Any]] = (),
    output_dir: str | os.PathLike | None = None,
    cache: Cache,
    cache_spec: CacheSpec,
    executor: str = "local",
    jobs: int | None = None,
    ray_address: str | None = None,
    check_numerics: bool = True,
    listeners: Iterable[Callable[[SweepEvent], None]] = (),
    max_retries: int = 3,
    memory: InMemory | None = None,
) -> SweepResult:
    """Run ``settings``' variants of the configuration at ``config`` (found from ``cwd`` when
    None) with ``base_overrides`` applied to all of them; place each under ``output_dir``.
    ``memory``: the model and calibration sets in memory (no config file is searched for),
    whose jobs run in this process."""
    listeners = list(listeners)

    def emit(event: SweepEvent) -> None:
        for listener in listeners:
            listener(event)

    t0 = time.perf_counter()
    variants = settings.variants()
    root = Path(cwd, output_dir or DEFAULT_OUTPUT_DIR).resolve()
    config = str(config) if config is not None else None
    base_overrides = list(base_overrides)
    search = memory is None
    specs = tuple(
        _spec(v, config, cwd, base_overrides, root / v.name, check_numerics, search)
        for v in variants
    )
    builds = VariantBuilds(specs, cache, memory)
    for spec in specs:  # every variant is built (and checked) before anything runs
        try:
            builds[spec.name]
        except ConfigError as err:
            raise ConfigError(f"sweep variant {spec.name}: {err}") from err
    emit(SweepEvent("planned", detail=f"{len(specs)} variants"))
    jobs = jobs if jobs is not None else settings.jobs
    if memory is not None and (executor == "ray" or (jobs or 1) > 1):
        raise ConfigError(
            "a sweep over a model in memory runs its jobs in this process (jobs=1): worker "
            "processes and Ray tasks build their variants from a config file's model"
        )
    if memory is not None:
        jobs = 1
    if jobs is None:  # each worker imports torch and builds the model: not one per CPU of a big box
        jobs = max(1, min(os.cpu_count() or 1, len(specs), MAX_DEFAULT_JOBS))
    runner = make_executor(
        executor,
        specs,
        builds,
        cache_spec,
        jobs=jobs,
        ray_address=ray_address,
        max_retries=max_retries,
    )
    # The sweep built these models and nothing changes them while it runs: a tensor's digest
    # from one variant's keys holds for the next (each model is hashed once, not per variant).
    reusing = digest_memo.reusing_across_runs()
    digest_memo.reuse_across_runs(True)
    cache.keep_values(KEEP_VALUES)  # jobs here reread what others made: keep it decoded
    try:
        batch = run_batch(
            [builds[s.name].build for s in specs],
            cache,
            runner,
            listeners=[lambda e: emit(_from_batch(e))],
        )
        runner.close()
        rows = [_place(v, builds, batch, emit) for v in variants]
    finally:
        runner.close()
        digest_memo.reuse_across_runs(reusing)
        cache.keep_values(None)
    reports.mark_front(rows)
    keys = [a.key for a in settings.axes] or sorted({k for v in variants for k, _ in v.values})
    summary = {
        "variants": len(rows),
        "failed": [r["variant"] for r in rows if r["status"] != "ok"],
        "executor": executor if executor == "ray" or jobs > 1 else "inline",
        "jobs": jobs if executor != "ray" else None,
        "keys": keys,
        "mode": settings.mode,
        "stage_runs": batch.runs_per_stage(),
        "jobs_run": sum(1 for j in batch.jobs if j.result and j.result.status == "ran"),
        "workers": sorted({j.result.worker for j in batch.jobs if j.result and j.result.worker}),
        "batch_seconds": batch.seconds,
        "seconds": time.perf_counter() - t0,
        "output_dir": str(root),
    }
    result = SweepResult(rows, summary, batch, keys=keys)
    result.files = write_reports(result, root)
    return result


def write_reports(result: SweepResult, root: Path) -> dict[str, Path]:
    """``sweep.json``, ``sweep.csv`` and (with matplotlib) ``sweep.png`` under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    files = {"json": root / "sweep.json", "csv": root / "sweep.csv"}
    title = f"{len(result.rows)} variants: " + ", ".join(result.keys)
    skipped = reports.plot(root / "sweep.png", result.rows, title)
    if skipped is None:
        files["png"] = root / "sweep.png"
    else:
        result.summary["plot"] = f"skipped: {skipped}"
    reports.write_json(files["json"], result.summary, result.rows)
    reports.write_csv(files["csv"], result.rows, result.keys)
    return files


def _spec(
    variant: Variant,
    config: str | None,
    cwd: Any,
    base: list[tuple[str, Any]],
    out: Path,
    check_numerics: bool,
    search: bool = True,
) -> VariantSpec:
    """The variant's spec: the sweep's overrides, its directory, its own values, and the
    numerics check on where its target declares one (``Target.numerics_option``: its SQNR is
    what a sweep compares)."""
    from graphbuild.targets.registry import get_target

    overrides = [*base, ("output_dir", str(out)), *variant.overrides]
    spec = VariantSpec(variant.name, config, str(cwd), tuple(overrides), search)
    if check_numerics:
        try:
            target = get_target(spec.load_config().target)
        except ConfigError as err:
            raise ConfigError(f"sweep variant {variant.name}: {err}") from err
        if target.numerics_option is not None:
            numerics = (f"options.{target.numerics_option}", True)
            with_numerics = (*base, numerics, *overrides[len(base) :])
            spec = VariantSpec(variant.name, config, str(cwd), with_numerics, search)
    return spec


def _from_batch(event: BatchEvent) -> SweepEvent:
    return SweepEvent(
        event.kind, event.build, event.stage, event.seconds, event.worker, event.detail
    )


def _place(
    variant: Variant,
    builds: VariantBuilds,
    batch: BatchReport,
    emit: Callable[[SweepEvent], None],
) -> dict[str, Any]:
    """Export one variant into its directory (every stage the batch built is a hit) and
    make its row."""
    from graphbuild.api import export_with_pipeline

    built = builds[variant.name]
    outcomes = batch.stages[variant.name]
    counts = {s.value: 0 for s in (BatchStatus.RAN, BatchStatus.SHARED, BatchStatus.HIT)}
    for outcome in outcomes.values():
        if outcome.status.value in counts:
            counts[outcome.status.value] += 1
    row: dict[str, Any] = {
        "variant": variant.name,
        "values": dict(variant.values),
        "output_dir": str(built.config.output_dir),
        "status": "ok",
        "stages": counts,
        "stage_status": {name: o.status.value for name, o in outcomes.items()},
        "seconds": sum(o.seconds for o in outcomes.values() if o.status == BatchStatus.RAN),
    }
    failure = batch.failures().get(variant.name)
    if failure is not None:
        row.update(status="failed", error=failure)
        emit(SweepEvent("variant_failed", variant.name, detail=failure))
        return row
    t0 = time.perf_counter()
    try:
        artifacts = export_with_pipeline(built.request)
    except GraphbuildError as err:
        row.update(status="failed", error=str(err))
        emit(SweepEvent("variant_failed", variant.name, detail=str(err)))
        return row
    placed = time.perf_counter() - t0
    ran_here = artifacts.report.ran  # deferred stages (no cacheable key) ran in this process
    row["seconds"] += sum(artifacts.report[n].seconds for n in ran_here)
    row["stages"]["ran"] += len(ran_here)
    row["place_seconds"] = placed
    extra = artifacts.report.extra
    row["files"] = {
        kind: {"path": str(path), "bytes": path.stat().st_size}
        for kind, path in artifacts.files.items()
    }
    row["file_bytes"] = sum(f["bytes"] for kind, f in row["files"].items() if kind != "lock")
    row["weight_bytes"] = reports.weight_bytes(extra)
    row["sqnr_db"] = reports.sqnr_by_output(extra.get("numerics"))
    coverage = extra.get("coverage")
    row["coverage"] = coverage.get("summary") if isinstance(coverage, Mapping) else None
    device = extra.get("htp")
    row["device_check"] = device.get("summary") if isinstance(device, Mapping) else None
    row["reports"] = {k: v for k, v in extra.items() if k in ("numerics", "htp")}
    emit(SweepEvent("placed", variant.name, seconds=placed))
    return row
