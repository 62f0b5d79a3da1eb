"""Entry points: ``export`` and ``export_with_pipeline``, FastForward-style.

An export builds the pipeline for ``(target, format)``, runs it against the cache, and places
the final files: written into a temporary directory beside the output directory, then moved
into place file by file, the lock file last. A failed export leaves the output directory as it
was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .artifacts import FileArtifact
from .cache import Cache
from .errors import ConfigError, ExportError
from .hashing import Hasher
from .pipeline import Pipeline
from .scheduler import RunReport, StageEvent, plan_status, toolchain_versions
from .stages.bind import BoundModel, save_model
from .targets.qnn import QnnOnnxOptions
from .targets.registry import PipelineFactory, PipelineRegistry, build_default_registry

LOCK_FILE = "graphbuild.lock.json"

__all__ = ["ExportRequest", "ExportArtifacts", "export", "export_with_pipeline", "LOCK_FILE"]


@dataclass
class ExportRequest:
    """Everything an export needs; ``options`` is a ``QnnOnnxOptions`` or a plain dict of
    context values for custom pipelines."""

    model: torch.nn.Module
    data: Any
    output_directory: str | os.PathLike
    model_name: str
    target: str = "qnn"
    format: str = "onnx"
    options: Any = None
    registry: PipelineRegistry | None = None
    pipeline_factory: PipelineFactory | None = None
    cache: Cache | str | os.PathLike | bool | None = None
    verbose: bool | None = None
    force: Iterable[str] | bool = ()
    listeners: Iterable[Callable[[StageEvent], None]] = ()

    def __post_init__(self) -> None:
        name = str(self.model_name)
        if not name or "/" in name or "\\" in name or os.sep in name or name in (".", ".."):
            raise ExportError(
                f"model name {self.model_name!r} must be a plain file name without a path "
                "separator; put the directory in output_directory"
            )

    def qnn_options(self) -> QnnOnnxOptions:
        if self.options is None:
            return QnnOnnxOptions()
        if isinstance(self.options, QnnOnnxOptions):
            return self.options
        if isinstance(self.options, Mapping):
            try:
                return QnnOnnxOptions(**self.options)
            except TypeError as err:
                raise ConfigError(f"bad QNN export options: {err}") from err
        raise ConfigError(f"options must be QnnOnnxOptions or a dict, not {type(self.options)}")

    def context(self) -> dict[str, Any]:
        if isinstance(self.options, Mapping) and self.target != "qnn":
            ctx = dict(self.options)
        elif self.options is None and self.target != "qnn":
            ctx = {}
        else:
            ctx = self.qnn_options().to_context()
        ctx.update(model_name=self.model_name, target=self.target, format=self.format)
        return ctx

    def run_id(self) -> str:
        return f"{self.target}:{self.model_name}"


@dataclass
class ExportArtifacts:
    """What an export produced: the pipeline's name, captured stage outputs, the files
    written (kind -> path) and the run report."""

    pipeline_name: str
    captured_outputs: Mapping[str, Any]
    files: dict[str, Path]
    report: RunReport
    output_directory: Path
    lock: dict[str, Any] = field(default_factory=dict)


def resolve_cache(cache: Cache | str | os.PathLike | bool | None) -> Cache | None:
    """``None``: the default location; ``False``: no cache; a path or a Cache as given."""
    if cache is False:
        return None
    if isinstance(cache, Cache):
        return cache
    if cache is None or cache is True:
        return Cache()
    return Cache(cache)


def build_pipeline(request: ExportRequest) -> Pipeline:
    if request.pipeline_factory is not None:
        return request.pipeline_factory(request)
    registry = request.registry or build_default_registry()
    return registry.get(request.target, request.format)(request)


def export_with_pipeline(request: ExportRequest) -> ExportArtifacts:
    """Build the export described by ``request`` and place its files."""
    pipeline = build_pipeline(request)
    cache = resolve_cache(request.cache)
    listeners = list(request.listeners)
    if request.verbose:
        listeners.append(_print_event)
    t0 = time.perf_counter()
    result = pipeline.run(
        request.model,
        request.data,
        context=request.context(),
        cache=cache,
        force=request.force,
        listeners=listeners,
        run_id=request.run_id(),
    )
    out_dir = Path(request.output_directory)
    files, lock = place_outputs(pipeline, result, request, out_dir)
    result.report.seconds = time.perf_counter() - t0
    if "check_numerics" in result.outputs:
        result.report.extra["numerics"] = result.outputs["check_numerics"]
    return ExportArtifacts(pipeline.name, result.captured, files, result.report, out_dir, lock)


def export(
    model: torch.nn.Module,
    data: Any,
    output_directory: str | os.PathLike,
    model_name: str,
    *,
    target: str = "qnn",
    format: str = "onnx",
    options: Any = None,
    registry: PipelineRegistry | None = None,
    pipeline_factory: PipelineFactory | None = None,
    cache: Cache | str | os.PathLike | bool | None = None,
    verbose: bool | None = None,
    force: Iterable[str] | bool = (),
    listeners: Iterable[Callable[[StageEvent], None]] = (),
) -> ExportArtifacts:
    """Export ``model`` (traced on ``data``) to ``output_directory/model_name.*``."""
    return export_with_pipeline(
        ExportRequest(
            model,
            data,
            output_directory,
            model_name,
            target,
            format,
            options,
            registry,
            pipeline_factory,
            cache,
            verbose,
            force,
            listeners,
        )
    )


def status(request: ExportRequest) -> RunReport:
    """What an export would run and why, without running anything."""
    pipeline = build_pipeline(request)
    return plan_status(
        pipeline,
        request.model,
        request.data,
        context=request.context(),
        cache=resolve_cache(request.cache),
        run_id=request.run_id(),
    )


def _print_event(event: StageEvent) -> None:
    if event.kind.value in ("hit", "ran", "cutoff", "failed"):
        print(f"[graphbuild] {event.stage:<16} {event.kind.value:<7} {event.seconds:7.2f}s")


# --------------------------------------------------------------------------- placement


def _placeable(value: Any) -> bool:
    if isinstance(value, (BoundModel, FileArtifact)):
        return True
    return isinstance(value, Mapping) and bool(value) and all(map(_placeable, value.values()))


def place_outputs(
    pipeline: Pipeline, result: Any, request: ExportRequest, out_dir: Path
) -> tuple[dict[str, Path], dict[str, Any]]:
    """Write every placeable sink output (bound ONNX models, files) and the lock file into a
    temporary directory beside ``out_dir``, then move them into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        written: dict[str, Path] = {}
        external = request.context().get("external_data")
        for sink in pipeline.products:
            value = result.outputs.get(sink)
            if value is None or not _placeable(value):
                continue
            items = value.items() if isinstance(value, Mapping) else [(sink, value)]
            for kind, item in items:
                for path in _write(item, tmp, request.model_name, external):
                    written[_kind(path.name, request.model_name, kind)] = path
        lock = _lock(pipeline, result.report, request, written)
        (tmp / LOCK_FILE).write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n")
        out_dir.mkdir(parents=True, exist_ok=True)
        final: dict[str, Path] = {}
        stale = {f"{request.model_name}.onnx.data"} - {p.name for p in written.values()}
        for kind, path in written.items():
            final[kind] = out_dir / path.name
            os.replace(path, final[kind])
        for name in stale:
            (out_dir / name).unlink(missing_ok=True)
        os.replace(tmp / LOCK_FILE, out_dir / LOCK_FILE)
        final["lock"] = out_dir / LOCK_FILE
        return final, lock
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write(item: Any, tmp: Path, model_name: str, external: bool | None) -> list[Path]:
    if isinstance(item, BoundModel):
        return list(save_model(item, tmp / f"{model_name}.onnx", external_data=external))
    path = tmp / item.name
    path.write_bytes(item.data)
    return [path]


def _kind(filename: str, model_name: str, fallback: str) -> str:
    if filename.startswith(model_name + "."):
        return filename[len(model_name) + 1 :]
    return fallback


def _file_digest(path: Path) -> str:
    h = Hasher()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _lock(
    pipeline: Pipeline, report: RunReport, request: ExportRequest, files: Mapping[str, Path]
) -> dict[str, Any]:
    """graphbuild.lock.json: every output's digest, every stage's key and reads, versions.
    Deterministic for a given build, so a warm rebuild rewrites the same bytes."""
    return {
        "target": request.target,
        "format": request.format,
        "model_name": request.model_name,
        "pipeline": pipeline.name,
        "toolchain": toolchain_versions(),
        "files": {
            p.name: {"xxh3_128": _file_digest(p), "bytes": p.stat().st_size}
            for p in sorted(files.values())
        },
        "stages": {
            s.name: {
                "key": s.key,
                "output": s.digest,
                "reads": list(pipeline._stage(s.name).reads or ["<everything>"]),
                "depends_on": pipeline.dependencies(s.name),
            }
            for s in report.stages
        },
    }
