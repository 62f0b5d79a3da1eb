"""The QNN target: an ONNX graph plus a `.encodings` file (``onnx``), or ONNX with Q/DQ nodes
(``onnx_qdq``), built from the shared torch.export front end."""

from graphbuild.targets.qnn import preset as _preset  # noqa: F401  - registers the presets
from graphbuild.targets.qnn.pipeline import FORMATS, QnnOnnxOptions, build_qnn_pipeline

__all__ = ["FORMATS", "QnnOnnxOptions", "build_qnn_pipeline"]
