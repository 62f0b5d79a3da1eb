"""Codecs for ONNX artifacts: skeletons (no weights) and bound models (skeleton + tensors).

A bound model is stored as its data-less skeleton plus one blob per tensor, so a re-export
after a weight change stores only the tensors that changed, and placement streams blobs into
``<name>.onnx.data`` without building the whole model in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

from graphbuild.engine.codecs import Codec, Encoded, Part, array_token, register_codec
from graphbuild.hashing import digest_bytes
from graphbuild.onnx.bind import BoundModel, array_bytes


class OnnxCodec(Codec):
    name = "onnx"
    types = (onnx.ModelProto,)

    def encode(self, value: onnx.ModelProto) -> Encoded:
        return Encoded(self.name, None, [Part(value.SerializeToString(deterministic=True))])

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        model = onnx.ModelProto()
        model.ParseFromString(bytes(parts[0]))
        return model

    def snapshot(self, value: onnx.ModelProto) -> Any:
        return digest_bytes(value.SerializeToString(deterministic=True))


def _array_part(array: np.ndarray, digest: str = "") -> Part:
    """The array's bytes, under ``digest`` when the value knows it (bind hashed them as it
    computed them, or took them from the state's digests): not hashed a second time."""
    return Part(array_bytes(array), digest)


class BoundModelCodec(Codec):
    name = "bound_onnx"
    types = (BoundModel,)

    def encode(self, value: BoundModel) -> Encoded:
        names = sorted(value.tensors)
        meta = [[n, _dtype_name(value.tensors[n]), list(value.tensors[n].shape)] for n in names]
        parts = [Part(value.model.SerializeToString(deterministic=True))]
        parts += [_array_part(value.tensors[n], value.digests.get(n, "")) for n in names]
        return Encoded(self.name, meta, parts)

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        model = onnx.ModelProto()
        model.ParseFromString(bytes(parts[0]))
        tensors = {}
        for (name, dtype, shape), data in zip(meta, parts[1:], strict=True):
            tensors[name] = np.frombuffer(bytearray(data), dtype=_np_dtype(dtype)).reshape(shape)
        return BoundModel(model, tensors, {})

    def snapshot(self, value: BoundModel) -> Any:
        # the graph in full; each array by its bytes (numpy keeps no version counter)
        arrays = [(n, array_token(value.tensors[n])) for n in sorted(value.tensors)]
        return [digest_bytes(value.model.SerializeToString(deterministic=True)), arrays]


def _dtype_name(array: np.ndarray) -> str:
    return str(array.dtype)


def _np_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


register_codec(OnnxCodec())
register_codec(BoundModelCodec())
