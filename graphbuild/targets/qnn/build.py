"""The qnn target's pipeline for each format: one ONNX graph (``onnx``, ``onnx_qdq``,
``context``: :mod:`.pipeline.build`) or a causal LM's part graphs (``llm``: :mod:`.llm.pipeline`)."""

from __future__ import annotations

from typing import Any

from graphbuild.engine.pipeline import Pipeline
from graphbuild.errors import ConfigError
from graphbuild.targets.base import Request
from graphbuild.targets.qnn.options import FORMATS


def build_qnn_pipeline(request: Request, fmt: str | None = None, **options: Any) -> Pipeline:
    """The pipeline of ``request`` in format ``fmt`` (default: the request's)."""
    fmt = fmt or request.format
    if fmt not in FORMATS:
        raise ConfigError(
            f"unknown format '{fmt}' for target qnn; known: {', '.join(FORMATS)} "
            "(a custom format passes fmt= to build_qnn_pipeline)"
        )
    if fmt == "llm":
        from graphbuild.targets.qnn.llm.pipeline import build_llm_pipeline

        return build_llm_pipeline(request, **options)
    from graphbuild.targets.qnn.pipeline.build import build_qnn_pipeline as build_onnx

    return build_onnx(request, fmt, **options)
