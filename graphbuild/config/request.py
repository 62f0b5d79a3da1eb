"""The one way a configuration becomes an export request.

``graphbuild export`` (and ``status``, ``graph``) and every variant of a sweep turn a
:class:`~graphbuild.config.Config` into a :class:`~graphbuild.api.ExportRequest` here, so the
two cannot drift: the same configuration gives the same request, pipeline, context and keys
whichever of them built it. The callers load the model, samples and calibration (a sweep
shares one model between its variants) and hand them in.

``graphbuild.api`` imports torch, so it is imported when a request is made, not when the
configuration is loaded: ``graphbuild cache ...`` and ``--help`` stay quick.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from graphbuild.config.settings import Config

if TYPE_CHECKING:
    from graphbuild.api import ExportRequest
    from graphbuild.engine.artifact_store import Cache
    from graphbuild.engine.events import StageEvent
    from graphbuild.engine.pipeline import Pipeline

__all__ = ["export_request"]


def export_request(
    cfg: Config,
    model: Any,
    samples: Any,
    calibration: list[Any] | None,
    *,
    cache: Cache | None,
    force: Iterable[str] | bool = (),
    listeners: Iterable[Callable[[StageEvent], None]] = (),
) -> tuple[ExportRequest, Pipeline]:
    """The export request ``cfg`` describes for ``model`` traced on ``samples``, and its
    pipeline, built now so that an unknown target, format or option is a
    :class:`~graphbuild.errors.ConfigError` before anything runs. The request carries that
    pipeline (``pipeline_factory``), so exporting it builds no other. ``cache`` None: no
    cache."""
    from graphbuild.api import ExportRequest, build_pipeline

    request = ExportRequest(
        model=model,
        data=samples,
        output_directory=cfg.output_dir,
        model_name=cfg.model_name,
        target=cfg.target,
        format=cfg.format,
        options=cfg.export_options(calibration),
        cache=cache if cache is not None else False,
        force=force,
        listeners=listeners,
    )
    pipeline = build_pipeline(request)
    return replace(request, pipeline_factory=lambda _request: pipeline), pipeline
