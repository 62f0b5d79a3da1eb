"""ONNX formats: the structure-only skeleton, marker lowering, value binding and the ONNX
codecs."""

from graphbuild.engine.codecs import declare_codecs

# onnx.codecs imports onnx: registered when a value or a cache entry first needs it
declare_codecs(f"{__name__}.codecs", "onnx", "bound_onnx")
