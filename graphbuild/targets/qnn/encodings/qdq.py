"""Put an encodings document back into a float ONNX graph as QuantizeLinear/DequantizeLinear:
the QDQ model a QNN tool builds from the ``onnx`` format's pair (float model + ``.encodings``),
which the HTP check compiles on Qualcomm's backend.

Each tensor the document names gets ``QuantizeLinear -> DequantizeLinear`` with the encoding's
scale and zero point in its integer container (int4/uint4, int8/uint8, int16/uint16; opset 21
for 4- and 16-bit), per channel with ``axis`` and blocked with ``block_size`` where the document
says so. A 32-bit parameter (an int32 bias) has no QuantizeLinear type: it becomes
``DequantizeLinear`` of its precomputed int32 values. An LPBQ weight takes the form QNN's
HTP runs (:mod:`graphbuild.onnx.lpbq`): its int4 values, stored, dequantized with the scale a
``DequantizeLinear`` makes of its integer block scales, a ``linear``'s Transpose folded into
the stored weight. The rewrite is :class:`InsertQdqPass`, the fake-quant pass of
:mod:`.reinsert` with real Q/DQ chains.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from graphbuild.errors import ExportError
from graphbuild.onnx.lpbq import MAX_BLOCK_SCALE_BITS, foldable_transpose, lpbq_dequantize
from graphbuild.targets.qnn.encodings.read import TensorEncoding, read_encodings
from graphbuild.targets.qnn.encodings.reinsert import (
    InsertFakeQuantPass,
    _channel_shape,
    _expand_blocks,
    _value_dims,
    lpbq_grids,
)

__all__ = ["InsertQdqPass", "insert_qdq"]

_QDQ_OPSET = 21  # int4/uint4, int16/uint16 and blocked Q/DQ


def insert_qdq(
    model: onnx.ModelProto,
    doc: Mapping[str, Any],
    *,
    table: Mapping[str, TensorEncoding] | None = None,
) -> onnx.ModelProto:
    """A copy of ``model`` with every tensor of ``doc`` behind QuantizeLinear/DequantizeLinear
    (``model``, a float ONNX model at opset 21 or later, is not modified)."""
    encodings = read_encodings(doc) if table is None else table
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < _QDQ_OPSET:
        raise ExportError(
            f"rebuilding Q/DQ from the encodings needs ONNX opset >= {_QDQ_OPSET} (int4, int16 "
            f"and blocked QuantizeLinear); the model has opset {opset}: export with opset=21"
        )
    ir_model = ir.serde.deserialize_model(model)
    result = InsertQdqPass(encodings, dims=lambda: _value_dims(model))(ir_model)
    return ir.serde.serialize_model(result.model)


def _container(enc: TensorEncoding) -> tuple[ir.DataType, np.dtype]:
    """The integer type holding ``enc``'s grid, and the numpy type its values are made in."""
    for bits, signed, unsigned, np_signed, np_unsigned in (
        (4, ir.DataType.INT4, ir.DataType.UINT4, np.int8, np.uint8),
        (8, ir.DataType.INT8, ir.DataType.UINT8, np.int8, np.uint8),
        (16, ir.DataType.INT16, ir.DataType.UINT16, np.int16, np.uint16),
    ):
        if enc.bits <= bits:
            return (
                (signed, np.dtype(np_signed)) if enc.signed else (unsigned, np.dtype(np_unsigned))
            )
    if enc.bits <= 32 and enc.signed:
        return ir.DataType.INT32, np.dtype(np.int32)
    raise ExportError(f"tensor '{enc.name}': no integer container holds a {enc.bits}-bit grid")


class InsertQdqPass(InsertFakeQuantPass):
    """QuantizeLinear -> DequantizeLinear for every tensor an encodings document names (an
    int32 parameter: DequantizeLinear of its quantized values). Readers and graph outputs are
    moved onto the DequantizeLinear as :class:`InsertFakeQuantPass` does."""

    def _constants(self, value: ir.Value, enc: TensorEncoding) -> tuple[np.ndarray, np.ndarray]:
        """Scale and zero point in the shapes Q/DQ take: a scalar, one per channel along
        ``axis``, or the block grid; the Q/DQ attributes are kept for :meth:`_chain_nodes`."""
        if value.is_initializer() and value.dtype != ir.DataType.FLOAT:
            raise ExportError(f"tensor '{enc.name}' is not float32; cannot quantize it")
        _, np_type = _container(enc)
        scale = np.asarray(enc.scale, np.float32)
        zero_point = np.asarray(enc.zero_point).astype(np_type)
        self._attrs: dict[str, int] = {}
        self._broadcast: tuple[int, ...] = ()
        if enc.granularity == "PER_TENSOR":
            return scale.reshape(()), zero_point.reshape(())
        dims = self._tensor_dims(value)
        channel_axis, block_axis = self._axes(value, enc, len(dims))
        if enc.granularity == "PER_CHANNEL":
            self._broadcast = _channel_shape(enc, channel_axis, dims)  # checks the count
            self._attrs = {"axis": channel_axis}
            return scale.reshape(-1), zero_point.reshape(-1)
        block = int(enc.block_size or 0)
        rank = len(dims)
        axis = block_axis + rank if block_axis < 0 else block_axis
        if None in dims or not 0 <= axis < rank or block <= 0:
            raise ExportError(f"tensor '{enc.name}': cannot lay blocks of {block} on {dims}")
        grid = tuple(-(-int(d) // block) if i == axis else int(d) for i, d in enumerate(dims))
        if scale.size != int(np.prod(grid)):
            raise ExportError(
                f"tensor '{enc.name}' of shape {tuple(dims)}: {scale.size} block scales do not "
                f"match blocks of {block} along axis {axis} (expected {grid})"
            )
        self._attrs = {"axis": axis, "block_size": block}
        return scale.reshape(grid), zero_point.reshape(grid)

    def _chain(self, value: ir.Value, enc: TensorEncoding) -> list[ir.Node]:
        if enc.granularity == "LPBQ":
            return self._lpbq_chain(value, enc)
        return super()._chain(value, enc)

    def _lpbq_chain(self, value: ir.Value, enc: TensorEncoding) -> list[ir.Node]:
        """An LPBQ weight in the HTP's form; its readers (or those of the Transpose folded
        into it) read the dequantized weight."""
        tensor = value.const_value if value.is_initializer() else None
        if tensor is None or value.dtype != ir.DataType.FLOAT:
            raise ExportError(
                f"tensor '{enc.name}': an LPBQ encoding quantizes a float32 weight; this is "
                "not a constant of the model"
            )
        if int(enc.block_scale_bits or 0) > MAX_BLOCK_SCALE_BITS:
            raise ExportError(
                f"tensor '{enc.name}': {enc.block_scale_bits}-bit LPBQ block scales do not fit "
                f"the uint8 QNN reads them as (at most {MAX_BLOCK_SCALE_BITS} bits)"
            )
        x = tensor.numpy().astype(np.float32)
        dims = tuple(int(d) for d in x.shape)
        channel, block = self._lpbq_axes(value, enc, len(dims))
        grid, ints = lpbq_grids(enc, channel, block, len(dims))
        scale = _expand_blocks(grid.astype(np.float32), enc, block, dims)
        q = np.clip(np.round(x / scale), enc.qmin, enc.qmax).astype(np.int8)
        transpose = foldable_transpose(value)
        if transpose is not None:
            q, ints, channel, block = q.T, ints.T, 1 - channel, 1 - block
        graph, name = value.graph, enc.name
        dtype, _ = _container(enc)
        channels = np.asarray(enc.channel_scale, np.float32).reshape(-1)
        nodes, y = lpbq_dequantize(
            self._typed_const(graph, f"{name}_quantized", np.ascontiguousarray(q), dtype),
            self._typed_const(graph, f"{name}_block_int_scale", ints.astype(np.uint8)),
            self._typed_const(graph, f"{name}_channel_scale", channels),
            self._typed_const(
                graph, f"{name}_channel_zero_point", np.zeros_like(channels, np.uint8)
            ),
            self._typed_const(graph, f"{name}_zero_point", np.zeros(ints.shape, np.int8), dtype),
            channel_axis=channel,
            block_axis=block,
            block_size=int(enc.block_size or 0),
            names=tuple(self._fresh(f"{name}_{s}") for s in ("scale_dq", "scale", "dq", "dq_out")),
            out_type=value.type,
        )
        target = value if transpose is None else transpose.outputs[0]
        target.replace_all_uses_with(y, replace_graph_outputs=True)
        if transpose is not None:
            graph.remove(transpose, safe=True)
        if not value.uses() and not value.is_graph_output():
            graph.initializers.pop(value.name)
        return nodes

    def _typed_const(
        self, graph: ir.Graph, base: str, array: np.ndarray, dtype: ir.DataType | None = None
    ) -> ir.Value:
        name = self._fresh(base)
        tensor = ir.tensor(array, dtype=dtype, name=name)
        value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
        value.const_value = tensor
        graph.register_initializer(value)
        return value

    def _chain_nodes(
        self,
        src: ir.Value,
        dst: str,
        scale: np.ndarray,
        zero_point: np.ndarray,
        enc: TensorEncoding,
    ) -> list[ir.Node]:
        graph = src.graph
        dtype, _ = _container(enc)
        s = self._typed_const(graph, f"{enc.name}_scale", scale)
        z = self._typed_const(graph, f"{enc.name}_zero_point", zero_point, dtype)
        attrs = dict(self._attrs)
        if dtype == ir.DataType.INT32:
            quantized = self._typed_const(
                graph, f"{enc.name}_quantized", self._int32_values(src, scale, zero_point, enc)
            )
            dq = ir.node(
                "DequantizeLinear",
                [quantized, s, z],
                attributes=attrs,
                name=self._fresh(f"{enc.name}_dq"),
                outputs=[ir.Value(name=dst)],
            )
            return [dq]
        q_name = self._fresh(f"{enc.name}_q")
        q = ir.node(
            "QuantizeLinear",
            [src, s, z],
            attributes=attrs,
            name=q_name,
            outputs=[ir.Value(name=q_name)],
        )
        dq = ir.node(
            "DequantizeLinear",
            [q.outputs[0], s, z],
            attributes=attrs,
            name=self._fresh(f"{enc.name}_dq"),
            outputs=[ir.Value(name=dst)],
        )
        return [q, dq]

    def _int32_values(
        self, src: ir.Value, scale: np.ndarray, zero_point: np.ndarray, enc: TensorEncoding
    ) -> np.ndarray:
        """``clip(round(x / s) + z)`` of a constant, in int32 (a 32-bit grid has no Q op)."""
        if src.const_value is None:
            raise ExportError(
                f"tensor '{enc.name}': a {enc.bits}-bit activation has no QuantizeLinear type; "
                "only a constant (an int32 bias) can be quantized to 32 bits"
            )
        if self._attrs.get("block_size"):
            raise ExportError(f"tensor '{enc.name}': a blocked 32-bit encoding is not supported")
        shape = self._broadcast or ()
        x = src.const_value.numpy().astype(np.float64)
        s = scale.astype(np.float64).reshape(shape)
        z = zero_point.astype(np.float64).reshape(shape)
        q = np.clip(np.round(x / s) + z, enc.qmin, enc.qmax)
        return q.astype(np.int32)
