"""PipelineRegistry: pipelines by (target, format)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from graphbuild.errors import ExportError

if TYPE_CHECKING:
    from graphbuild.api import ExportRequest
    from graphbuild.engine.pipeline import Pipeline

PipelineFactory = Callable[["ExportRequest"], "Pipeline"]


class PipelineRegistry:
    """Maps ``(target, format)`` to a factory building the export pipeline for a request."""

    def __init__(self) -> None:
        self._factories: dict[tuple[str, str], PipelineFactory] = {}

    def register(
        self, target: str, format: str, factory: PipelineFactory, *, replace: bool = False
    ) -> None:
        key = (target, format)
        if key in self._factories and not replace:
            raise ExportError(
                f"a pipeline for target '{target}', format '{format}' is already registered; "
                "pass replace=True to override it"
            )
        self._factories[key] = factory

    def get(self, target: str, format: str) -> PipelineFactory:
        try:
            return self._factories[(target, format)]
        except KeyError:
            known = ", ".join(f"{t}/{f}" for t, f in self.keys()) or "none"
            raise ExportError(
                f"no pipeline for target '{target}', format '{format}'; known: {known}"
            ) from None

    def keys(self) -> list[tuple[str, str]]:
        return sorted(self._factories)

    def __contains__(self, key: object) -> bool:
        return key in self._factories


def build_default_registry() -> PipelineRegistry:
    """A registry with graphbuild's built-in pipelines: ``qnn/onnx`` and ``qnn/onnx_qdq``."""
    from graphbuild.targets.qnn import build_qnn_pipeline

    registry = PipelineRegistry()
    for fmt in ("onnx", "onnx_qdq"):
        registry.register("qnn", fmt, build_qnn_pipeline)
    return registry
