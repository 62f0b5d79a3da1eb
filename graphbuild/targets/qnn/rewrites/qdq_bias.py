"""Form 4 of the Q/DQ forms (:mod:`.qdq_forms`): LayerNormalization's bias as int32.

A float bias makes QNN run the LayerNorm float (and its float LayerNorm feeding a quantized
Gemm gives wrong rows); the bias becomes DequantizeLinear of int32 values with scale ``input
scale x gamma scale``, zero point 0: data where the bias and the scales hold data, references
``bind`` computes where they are references.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphbuild.onnx.lower import (
    QID_KEY,
    QPARAMS_LOCATION,
    ROLE_KEY,
    SOURCE_KEY,
    WEIGHT_QID_KEY,
)
from graphbuild.onnx.naming import Namer
from graphbuild.onnx.skeleton import STATE_LOCATION
from graphbuild.targets.qnn.rewrites.qdq_encoding import _data, _Encoding, _encoding

__all__ = ["int32_bias", "int32_layernorm_biases"]


def int32_layernorm_biases(graph: ir.Graph, namer: Namer) -> None:
    """Form 4 on every LayerNormalization of ``graph`` whose input and gamma are dequantized
    per tensor and per tensor or channel, and whose bias is a float initializer."""
    for node in list(graph):
        if node.op_type != "LayerNormalization" or node.domain != "" or len(node.inputs) < 3:
            continue
        x, gamma, bias = node.inputs[:3]
        x_enc, g_enc = _encoding(x), _encoding(gamma)
        if x_enc is None or g_enc is None or x_enc.axis is not None or bias is None:
            continue
        if not bias.is_initializer() or bias.dtype != ir.DataType.FLOAT:
            continue
        made = _int32_bias(graph, namer, bias, x_enc, g_enc)
        if made is None:
            continue
        dq = ir.Node(
            "",
            "DequantizeLinear",
            list(made),
            attributes=ir.convenience.convert_attributes(
                {"axis": 0} if g_enc.axis is not None else {}
            ),
            outputs=[
                ir.Value(name=namer.fresh(f"{bias.name}_dq"), shape=bias.shape, type=bias.type)
            ],
            name=namer.fresh(f"{bias.name}_DequantizeLinear"),
        )
        graph.insert_before(node, [dq])
        node.replace_input_with(2, dq.outputs[0])
        if not bias.uses() and not bias.is_graph_output():
            graph.initializers.pop(bias.name or "")


def _int32_bias(
    graph: ir.Graph, namer: Namer, bias: ir.Value, x: _Encoding, gamma: _Encoding
) -> tuple[ir.Value, ir.Value] | None:
    """(int32 values, float scale) initializers of ``bias``: data where the bias and the
    scales hold data, references ``bind`` computes where they are references."""
    shape = tuple(bias.shape) if bias.shape is not None else None
    if shape is None or len(shape) != 1 or not isinstance(shape[0], int):
        return None
    channels = shape[0]
    if gamma.axis is not None and (gamma.scale.shape is None or gamma.scale.shape[0] != channels):
        return None
    scale_shape = (channels,) if gamma.axis is not None else ()
    base = bias.name or "bias"
    values = ir.Value(
        name=namer.fresh(f"{base}_quantized"),
        shape=ir.Shape(shape),
        type=ir.TensorType(ir.DataType.INT32),
    )
    scale = ir.Value(
        name=namer.fresh(f"{base}_scale"),
        shape=ir.Shape(scale_shape),
        type=ir.TensorType(ir.DataType.FLOAT),
    )
    arrays = [_data(v) for v in (bias, x.scale, gamma.scale)]
    if all(a is not None for a in arrays):
        b, sx, sg = arrays
        s = (np.float32(sx.reshape(-1)[0]) * sg.astype(np.float32)).reshape(scale_shape)
        values.const_value = ir.Tensor(int32_bias(b, s), name=values.name)
        scale.const_value = ir.Tensor(s.astype(np.float32), name=scale.name)
    else:
        refs = _reference_keys(bias, x.scale, gamma.scale)
        if refs is None:
            return None
        source, x_qid, g_qid = refs
        for value, role, dtype, dims in (
            (values, "bias", ir.DataType.INT32, shape),
            (scale, "bias_scale", ir.DataType.FLOAT, scale_shape),
        ):
            meta = {QID_KEY: x_qid, WEIGHT_QID_KEY: g_qid, ROLE_KEY: role}
            if role == "bias":
                meta[SOURCE_KEY] = source
            value.const_value = ir.ExternalTensor(
                location=QPARAMS_LOCATION,
                offset=0,
                length=dtype.bitwidth * int(np.prod(dims, dtype=np.int64)) // 8,
                dtype=dtype,
                shape=ir.Shape(dims),
                name=value.name,
                metadata_props=meta,
            )
    graph.register_initializer(values)
    graph.register_initializer(scale)
    return values, scale


def _reference_keys(
    bias: ir.Value, x_scale: ir.Value, g_scale: ir.Value
) -> tuple[str, str, str] | None:
    """(bias state name, input qid, gamma qid) when all three are bind references."""
    tensors = [v.const_value for v in (bias, x_scale, g_scale)]
    if not all(isinstance(t, ir.ExternalTensor) for t in tensors):
        return None
    b, sx, sg = tensors
    if b.location != STATE_LOCATION or QID_KEY not in sx.metadata_props:
        return None
    if QID_KEY not in sg.metadata_props:
        return None
    source = b.metadata_props.get(SOURCE_KEY, bias.name or "")
    return source, sx.metadata_props[QID_KEY], sg.metadata_props[QID_KEY]


def int32_bias(bias: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``round(bias / scale)`` on the int32 grid (the scale a scalar or one per channel)."""
    q = np.round(bias.astype(np.float32) / scale.astype(np.float32))
    return np.clip(q, -(2**31), 2**31 - 1).astype(np.int32)
