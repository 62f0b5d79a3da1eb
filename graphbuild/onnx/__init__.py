"""ONNX formats: the structure-only skeleton, marker lowering, value binding and the ONNX
codecs."""
