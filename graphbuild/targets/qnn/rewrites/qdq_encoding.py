"""What a QDQ model's values say, for the Q/DQ forms (:mod:`.qdq_forms`, :mod:`.qdq_bias`):
the encoding a DequantizeLinear output carries, and the numbers a constant holds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir


@dataclass(frozen=True)
class _Encoding:
    """The Q/DQ parameters a DequantizeLinear output carries."""

    scale: ir.Value
    zero_point: ir.Value | None
    axis: int | None


def _encoding(value: ir.Value | None) -> _Encoding | None:
    """The encoding of a DequantizeLinear's output (None for any other value)."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "DequantizeLinear" or node.domain != "":
        return None
    axis = node.attributes.get("axis")
    scale = node.inputs[1]
    per_tensor = scale is not None and scale.shape is not None and scale.shape.rank() == 0
    zero = node.inputs[2] if len(node.inputs) > 2 else None
    return _Encoding(scale, zero, None if per_tensor else (axis.as_int() if axis else 1))


def _data(value: ir.Value | None) -> np.ndarray | None:
    """The numbers a constant holds (None for a bind reference or a non-constant)."""
    tensor = value.const_value if value is not None else None
    if tensor is None or isinstance(tensor, ir.ExternalTensor):
        return None
    return tensor.numpy()
