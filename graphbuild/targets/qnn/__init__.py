"""The QNN target: an ONNX graph plus a `.encodings` file (``onnx``), ONNX with Q/DQ nodes
(``onnx_qdq``), or a QNN context binary prepared on Qualcomm's HTP backend with its EPContext
ONNX model (``context``, the ``htp`` extra), built from the shared torch.export front end.

Importing this package declares the target and nothing more (no torch, no torchao): the
pipeline module is imported when a pipeline is built, and the preset module (torchao) when
the quantize stage runs, never to compute a key (see ``frontend.presets``).
"""

from __future__ import annotations

from graphbuild.targets.base import ExportFlag, Target, lazy_builder
from graphbuild.targets.qnn.options import CONFIG_SCHEMA, FORMATS, PRESETS, QnnOnnxOptions

build_qnn_pipeline = lazy_builder("graphbuild.targets.qnn.build", "build_qnn_pipeline")

TARGET = Target(
    name="qnn",
    description=(
        "Qualcomm QNN: float ONNX + AIMET .encodings (onnx), ONNX with Q/DQ (onnx_qdq), or "
        "an HTP context binary + EPContext ONNX (context)"
    ),
    formats=FORMATS,
    options_type=QnnOnnxOptions,
    build_pipeline=build_qnn_pipeline,
    config_schema=CONFIG_SCHEMA,
    presets=PRESETS,
    export_flags=(
        ExportFlag(
            "strict-coverage",
            "strict_coverage",
            "Fail (exit 1) when the coverage report finds a tensor the device runs quantized "
            "left float.",
        ),
        ExportFlag(
            "check-htp",
            "check_htp",
            "Compile the export on Qualcomm's HTP backend (the htp extra) with CPU fallback "
            "disabled and compare its outputs with onnxruntime's CPU.",
        ),
    ),
    numerics_option="check_numerics",
)

__all__ = ["FORMATS", "TARGET", "QnnOnnxOptions", "build_qnn_pipeline"]
