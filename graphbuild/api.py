"""Entry points: ``export`` and ``export_with_pipeline``, FastForward-style.

An export builds the pipeline for ``(target, format)``, runs it against the cache, and places
the final files: written into a temporary directory beside the output directory, then moved
into place file by file, the lock file last. A failed export leaves the output directory as it
was.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.concurrent import build_resources
from graphbuild.engine.events import RunReport, StageEvent
from graphbuild.engine.pipeline import Pipeline
from graphbuild.engine.plan import plan
from graphbuild.errors import ArgumentTypeError, ConfigError, ExportError
from graphbuild.output.directory import LOCK_FILE, check_output_directory
from graphbuild.output.placement import FilePlacement, json_safe, place_outputs
from graphbuild.targets.registry import (
    DEFAULT_TARGET,
    PipelineFactory,
    PipelineRegistry,
    build_default_registry,
    find_target,
)

__all__ = ["ExportRequest", "ExportArtifacts", "export", "export_with_pipeline", "LOCK_FILE"]


@dataclass
class ExportRequest:
    """Everything an export needs. ``options`` is the target's options dataclass (for the qnn
    target ``QnnOnnxOptions``, for executorch ``ExecuTorchOptions``), a dict of its fields, or
    for a custom pipeline a plain dict of context values."""

    model: torch.nn.Module
    data: Any
    output_directory: str | os.PathLike
    model_name: str
    target: str = DEFAULT_TARGET
    format: str | None = None
    options: Any = None
    registry: PipelineRegistry | None = None
    pipeline_factory: PipelineFactory | None = None
    cache: Cache | str | os.PathLike | bool | None = None
    verbose: bool | None = None
    force: Iterable[str] | bool = ()
    listeners: Iterable[Callable[[StageEvent], None]] = ()
    check_fingerprints: bool = False
    jobs: int | None = None
    memory: int | None = None

    def __post_init__(self) -> None:
        if self.format is None:
            target = find_target(self.target)
            if target is None:
                raise ConfigError(f"target '{self.target}' is not registered: give its format")
            self.format = target.default_format
        name = str(self.model_name)
        if not name or "/" in name or "\\" in name or os.sep in name or name in (".", ".."):
            raise ExportError(
                f"model name {self.model_name!r} must be a plain file name without a path "
                "separator; put the directory in output_directory"
            )

    def check(self, *, own_pipeline: bool = False) -> None:
        """Refuse, before any stage runs, arguments of the wrong type: an
        :class:`ArgumentTypeError` naming the argument, not a bare ``TypeError`` from inside
        a stage. The output directory and the cache are checked where they are opened.
        ``own_pipeline``: the caller brings the pipeline, which decides what the model and
        data may be (as a ``pipeline_factory``'s does)."""
        if not isinstance(self.output_directory, (str, os.PathLike)):
            got = _kind(self.output_directory)
            raise ArgumentTypeError(
                f"output_directory must be a path (str or os.PathLike), got {got}"
            )
        builtin = (
            not own_pipeline
            and self.pipeline_factory is None
            and find_target(self.target) is not None
        )
        if builtin and not isinstance(self.model, torch.nn.Module):
            raise ArgumentTypeError(
                f"the model must be a torch.nn.Module, got {_kind(self.model)}; pass the "
                "module (model, not model.forward or a factory that builds it)"
            )
        if builtin and self.data is None:
            raise ArgumentTypeError(
                "the sample inputs (data) are None: give the positional inputs the model is "
                "traced on, a tuple such as (torch.randn(1, 3, 224, 224),), or () for none"
            )
        options = self.target_options()
        calibration = (
            options.get("calibration")
            if isinstance(options, Mapping)
            else getattr(options, "calibration", None)
        )
        if calibration is not None and (
            isinstance(calibration, (str, bytes, Mapping, torch.Tensor))
            or not isinstance(calibration, Iterable)
        ):
            raise ArgumentTypeError(
                f"calibration must be a list of batches (each a tuple of positional inputs or "
                f"a tensor), got {_kind(calibration)}"
            )

    def target_options(self) -> Any:
        """The options as the target declares them (``Target.options_type``); for a target
        known only to a custom registry, as given (a dict or an object with ``to_context``)."""
        target = find_target(self.target)
        return target.make_options(self.options) if target is not None else self.options

    def context(self) -> dict[str, Any]:
        options = self.target_options()
        if options is None:
            ctx: dict[str, Any] = {}
        elif hasattr(options, "to_context"):
            ctx = options.to_context()
        elif isinstance(options, Mapping):
            ctx = dict(options)
        else:
            raise ConfigError(
                f"options for target '{self.target}' must be a dict or have to_context(), "
                f"not {type(options).__name__}"
            )
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
    """``None``: the default location (in front of ``$GRAPHBUILD_CACHE_URL`` when set);
    ``False``: no cache; a URL (``redis://...``): the default location in front of that
    shared cache; a path or a Cache as given."""
    from graphbuild.cache.remote import default_cache_url, is_cache_url

    if cache is False:
        return None
    if isinstance(cache, Cache):
        return cache
    if cache is None or cache is True:
        return Cache(url=default_cache_url())
    if isinstance(cache, str) and is_cache_url(cache):
        return Cache(url=cache)
    if not isinstance(cache, (str, os.PathLike)):
        raise ArgumentTypeError(
            "cache must be a gb.Cache, a directory, a redis:// URL, None (the default "
            f"location) or False (no cache), got {_kind(cache)}"
        )
    return Cache(cache)


def build_pipeline(request: ExportRequest) -> Pipeline:
    if request.pipeline_factory is not None:
        return request.pipeline_factory(request)
    registry = request.registry or build_default_registry()
    return registry.get(request.target, request.format)(request)


def export_with_pipeline(
    request: ExportRequest, pipeline: Pipeline | None = None
) -> ExportArtifacts:
    """Build the export described by ``request`` with ``pipeline`` and place its files.

    ``pipeline``: a :class:`~graphbuild.engine.pipeline.Pipeline` you built or edited (for
    instance ``build_qnn_pipeline(request, fmt="onnx")`` with a stage inserted); its
    ``products`` become the files. None: the pipeline of the request's ``pipeline_factory``,
    else of its ``(target, format)``. Giving both a pipeline and a ``pipeline_factory`` is an
    :class:`ArgumentTypeError`, as is an argument of the wrong type."""
    if not isinstance(request, ExportRequest):
        hint = (
            "; the pipeline goes second: export_with_pipeline(request, pipeline)"
            if isinstance(request, Pipeline)
            else ""
        )
        raise ArgumentTypeError(
            f"export_with_pipeline takes an ExportRequest first, got {_kind(request)}{hint}"
        )
    if pipeline is not None and not isinstance(pipeline, Pipeline):
        hint = (
            "; a function that builds a pipeline from the request goes in "
            "ExportRequest(pipeline_factory=...)"
            if callable(pipeline)
            else ""
        )
        raise ArgumentTypeError(
            f"pipeline must be a graphbuild Pipeline, got {_kind(pipeline)}{hint}"
        )
    if pipeline is not None and request.pipeline_factory is not None:
        raise ArgumentTypeError(
            "both a pipeline and the request's pipeline_factory were given: pass one"
        )
    request.check(own_pipeline=pipeline is not None)
    check_output_directory(Path(request.output_directory), request.model_name)
    if pipeline is None:
        pipeline = build_pipeline(request)
    with _request_cache(request) as cache:
        return _run_and_place(request, pipeline, cache)


@contextlib.contextmanager
def _request_cache(request: ExportRequest) -> Iterator[Cache | None]:
    """The request's cache (:func:`resolve_cache`), closed on the way out when it was opened
    here from a path or URL (its index connections are not left to the garbage collector); a
    ``gb.Cache`` the caller passed stays open."""
    cache = resolve_cache(request.cache)
    try:
        yield cache
    finally:
        if cache is not None and cache is not request.cache:
            cache.close()


def _run_and_place(
    request: ExportRequest, pipeline: Pipeline, cache: Cache | None
) -> ExportArtifacts:
    """Run ``pipeline`` on ``cache`` and place the products (:func:`export_with_pipeline`)."""
    listeners = list(request.listeners)
    if request.verbose:
        listeners.append(_print_event)
    context = request.context()
    jobs, memory = build_resources(request.jobs, request.memory, pipeline.parallel_safe)
    t0 = time.perf_counter()
    result = pipeline.run(
        request.model,
        request.data,
        context=context,
        cache=cache,
        force=request.force,
        listeners=listeners,
        run_id=request.run_id(),
        check=request.check_fingerprints,
        background_writes=True,  # the cache is written while the files are placed
        jobs=jobs,
        memory=memory,
    )
    for name, stage in pipeline.reports.items():  # what the pipeline declares
        if stage in result.outputs:
            result.report.extra[name] = result.outputs[stage]
    note = _model_outputs_note(request.model, result.outputs)
    if note:
        result.report.extra["model_outputs"] = note
    try:
        files, lock, out_dir = _place(request, pipeline, result, context, cache)
    finally:
        result.wait_for_cache()
    result.report.seconds = time.perf_counter() - t0
    return ExportArtifacts(pipeline.name, result.captured, files, result.report, out_dir, lock)


def _model_outputs_note(model: Any, outputs: Mapping[str, Any]) -> dict[str, Any]:
    """What the capture of a transformers model left out of its ``ModelOutput``
    (``frontend.capture.plain_outputs``); read only for such a model, whose captured
    program is then loaded (from the cache on a warm export) for its notes."""
    from graphbuild.frontend.capture import is_transformers_model

    if not is_transformers_model(model) or "capture" not in outputs:
        return {}
    notes = getattr(outputs["capture"], "notes", None) or {}
    return dict(notes.get("model_outputs") or {})


def _place(
    request: ExportRequest, pipeline: Pipeline, result: Any, context: dict[str, Any], cache: Any
) -> tuple[dict[str, Path], dict[str, Any], Path]:
    """Place the products and the lock file, whose header carries the run's reports."""
    out_dir = Path(request.output_directory)
    header = {
        "target": request.target,
        "format": request.format,
        "model_name": request.model_name,
        "pipeline": pipeline.name,
    }
    if result.report.extra:
        header["reports"] = json_safe(dict(result.report.extra))
    placement = FilePlacement(out_dir, request.model_name, context.get("external_data"), header)
    files, lock = place_outputs(pipeline, result, placement, cache)
    return files, lock, out_dir


def export(
    model: torch.nn.Module,
    data: Any,
    output_directory: str | os.PathLike,
    model_name: str,
    *,
    target: str = DEFAULT_TARGET,
    format: str | None = None,
    options: Any = None,
    registry: PipelineRegistry | None = None,
    pipeline_factory: PipelineFactory | None = None,
    cache: Cache | str | os.PathLike | bool | None = None,
    verbose: bool | None = None,
    force: Iterable[str] | bool = (),
    listeners: Iterable[Callable[[StageEvent], None]] = (),
    check_fingerprints: bool = False,
    jobs: int | None = None,
    memory: int | None = None,
) -> ExportArtifacts:
    """Export ``model`` (traced on ``data``) to ``output_directory/model_name.*``.

    ``cache``: a Cache, a path, a shared cache URL (``redis://host:port/db``, layered behind
    the default directory), None for the default location, False for none.
    ``check_fingerprints`` recomputes every stage that hits and fails loudly when its output
    differs from the cached one (graphbuild's own test of its cache keys). ``jobs``: stages
    built at once (independent ones: an LLM's parts), within ``memory`` bytes of what they
    declare they hold (1: one at a time; None, the default, or 0: one per core; memory None:
    most of the free memory; docs/parallel-builds.md), for a pipeline whose stages may run at
    once (the llm format's); others run one at a time."""
    return export_with_pipeline(
        ExportRequest(
            model=model,
            data=data,
            output_directory=output_directory,
            model_name=model_name,
            target=target,
            format=format,
            options=options,
            registry=registry,
            pipeline_factory=pipeline_factory,
            cache=cache,
            verbose=verbose,
            force=force,
            listeners=listeners,
            check_fingerprints=check_fingerprints,
            jobs=jobs,
            memory=memory,
        )
    )


def status(request: ExportRequest) -> RunReport:
    """What an export would run and why, without running anything."""
    request.check()
    pipeline = build_pipeline(request)
    with _request_cache(request) as cache:
        return plan(
            pipeline,
            request.model,
            request.data,
            context=request.context(),
            cache=cache,
            run_id=request.run_id(),
        )


def _kind(value: Any) -> str:
    """``int 7``, ``function build``: what a wrong argument was, for the message."""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if callable(value) and isinstance(name, str):
        return f"{type(value).__name__} {name}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _print_event(event: StageEvent) -> None:
    if event.kind.value in ("hit", "ran", "cutoff", "failed"):
        print(f"[graphbuild] {event.stage:<16} {event.kind.value:<7} {event.seconds:7.2f}s")
