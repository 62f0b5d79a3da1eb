"""The QNN target: an ONNX graph plus a `.encodings` file (``onnx``), or ONNX with Q/DQ nodes
(``onnx_qdq``), built from the shared torch.export front end.

Importing this package declares the target and nothing more (no torch, no torchao): the
pipeline module, which registers the quantizer presets, is imported when a pipeline is built.
"""

from __future__ import annotations

from typing import Any

from graphbuild.targets.base import Request, Target
from graphbuild.targets.qnn.options import CONFIG_SCHEMA, FORMATS, PRESETS, QnnOnnxOptions


def build_qnn_pipeline(request: Request, fmt: str | None = None) -> Any:
    """The QNN pipeline for ``request`` (see ``graphbuild.targets.qnn.pipeline``)."""
    from graphbuild.targets.qnn.pipeline import build_qnn_pipeline as build

    return build(request, fmt)


TARGET = Target(
    name="qnn",
    description="Qualcomm QNN: float ONNX + AIMET .encodings (onnx), or ONNX with Q/DQ (onnx_qdq)",
    formats=FORMATS,
    options_type=QnnOnnxOptions,
    build_pipeline=build_qnn_pipeline,
    config_schema=CONFIG_SCHEMA,
    presets=PRESETS,
)

__all__ = ["FORMATS", "TARGET", "QnnOnnxOptions", "build_qnn_pipeline"]
