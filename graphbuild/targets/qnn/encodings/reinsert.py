"""Put an encodings document back into a float ONNX graph as float quantize-dequantize, so
numerics can be checked from the ``.encodings`` file alone.

The rewrite is an onnx_ir pass (:class:`InsertFakeQuantPass`, in place on an ``ir.Model``);
:func:`insert_fake_quant` runs it on a copy of a ``ModelProto``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from graphbuild.errors import ExportError
from graphbuild.onnx.naming import Namer
from graphbuild.quant.lpbq import lpbq_axes
from graphbuild.targets.qnn.encodings.grid import weight_axes
from graphbuild.targets.qnn.encodings.read import TensorEncoding, read_encodings

__all__ = ["InsertFakeQuantPass", "insert_fake_quant", "lpbq_grids"]

_MIN_OPSET = 11  # Round and Clip(min, max inputs)


def insert_fake_quant(
    model: onnx.ModelProto,
    doc: Mapping[str, Any],
    *,
    table: Mapping[str, TensorEncoding] | None = None,
) -> onnx.ModelProto:
    """A copy of ``model`` with every tensor of ``doc`` quantize-dequantized in float.

    Each tensor ``t`` gets ``Div(s) -> Round -> Add(z) -> Clip(qmin, qmax) -> Sub(z) -> Mul(s)``
    right after its producer (at the front for initializers and graph inputs), and every
    consumer reads the result. A graph output keeps its name: the producer's output is renamed
    and the chain writes the output. ``model`` is not modified. ``table`` is ``doc`` as
    :func:`read_encodings` reads it, where the caller has read it already.
    """
    encodings = read_encodings(doc) if table is None else table
    _check_opset(model)
    ir_model = ir.serde.deserialize_model(model)  # a new object graph; ``model`` is only read
    result = InsertFakeQuantPass(encodings, dims=lambda: _value_dims(model))(ir_model)
    return ir.serde.serialize_model(result.model)


def _check_opset(model: onnx.ModelProto) -> None:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < _MIN_OPSET:
        raise ExportError(f"fake quantization needs ONNX opset >= {_MIN_OPSET}, got {opset}")


def _value_dims(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    """Static dims of every typed value, with ONNX shape inference where it works."""
    with contextlib.suppress(Exception):  # best effort: an unknown rank is reported when needed
        model = onnx.shape_inference.infer_shapes(model)
    dims: dict[str, tuple[int | None, ...]] = {}
    graph = model.graph
    for info in (*graph.input, *graph.output, *graph.value_info):
        tensor_type = info.type.tensor_type
        if tensor_type.HasField("shape"):
            dims[info.name] = tuple(
                d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim
            )
    return dims


def _channel_shape(enc: TensorEncoding, axis: int, dims: Sequence[int | None]) -> tuple[int, ...]:
    """Shape that broadcasts ``enc``'s per-channel values along ``axis`` of a ``dims`` tensor."""
    n, rank = enc.scale.size, len(dims)
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank or dims[axis] not in (None, n):
        raise ExportError(
            f"tensor '{enc.name}' of shape {tuple(dims)}: {n} channels do not fit axis {axis}"
        )
    return (n,) + (1,) * (rank - 1 - axis)


def _expand_blocks(
    values: np.ndarray, enc: TensorEncoding, axis: int, dims: Sequence[int | None]
) -> np.ndarray:
    """Per-block values repeated along ``axis`` to the full shape of the tensor."""
    rank, block = len(dims), int(enc.block_size or 0)
    axis = axis + rank if axis < 0 else axis
    if None in dims or not 0 <= axis < rank or block <= 0:
        raise ExportError(f"tensor '{enc.name}': cannot lay blocks of {block} on {tuple(dims)}")
    shape = [int(d or 0) for d in dims]
    grid = list(shape)
    grid[axis] = -(-shape[axis] // block)
    if values.size != math.prod(grid) or (values.ndim == rank and values.shape != tuple(grid)):
        raise ExportError(
            f"tensor '{enc.name}' of shape {tuple(dims)}: {values.shape} block values do not "
            f"match blocks of {block} along axis {axis} (expected {tuple(grid)})"
        )
    full = np.repeat(values.reshape(grid), block, axis=axis)
    return np.take(full, np.arange(shape[axis]), axis=axis)


def lpbq_grids(
    enc: TensorEncoding, channel_axis: int, block_axis: int, rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """An LPBQ encoding's effective block scales and integer block scales laid out on the
    block grid of its tensor (rank ``rank``, channels along ``channel_axis``, blocks along
    ``block_axis``): 1.0.0 lists them channel-major, 2.0.0 in the tensor's own layout."""
    ints = np.asarray(enc.block_int_scale)
    if not enc.axis_implied:
        return enc.scale, ints
    channels = enc.scale.shape[0]
    ones = (1,) * (rank - 2)

    def laid(a: np.ndarray) -> np.ndarray:
        a = a.reshape(channels, -1, *ones)
        return np.moveaxis(a, (0, 1), (channel_axis, block_axis))

    return laid(enc.scale), laid(ints)


class InsertFakeQuantPass(ir.passes.InPlacePass):
    """Quantize-dequantize, in float, every tensor an encodings document names.

    Each tensor ``t`` gets ``Div(s) -> Round -> Add(z) -> Clip(qmin, qmax) -> Sub(z) -> Mul(s)``
    right after its producer (at the front for initializers and graph inputs) and every reader,
    in subgraphs too, reads the result. A graph output keeps its name: its producer's output is
    renamed ``{t}_raw`` and the chain writes ``t``. Scales and zero points become float32
    initializers. ``dims`` gives static shapes of activations, computed only when a
    per-channel or blocked activation needs one.
    """

    def __init__(
        self,
        encodings: Mapping[str, TensorEncoding],
        dims: Callable[[], Mapping[str, tuple[int | None, ...]]] | None = None,
    ):
        super().__init__()
        self.encodings = encodings
        self._dims_source = dims
        self._dims: Mapping[str, tuple[int | None, ...]] | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self._namer = Namer(graph)
        self._values = {v.name: v for v in graph.inputs}
        self._values.update(graph.initializers)
        for node in graph:
            self._values.update((v.name, v) for v in node.outputs if v.name)
        self._dims = None
        front: list[ir.Node] = []
        after: dict[int, list[ir.Node]] = {}
        for enc in self.encodings.values():
            value = self._value(enc.name)
            producer = value.producer()
            chain = self._chain(value, enc)
            if producer is None:
                front.extend(chain)
            else:
                after.setdefault(id(producer), []).extend(chain)
        for node in list(graph):
            if id(node) in after:
                graph.insert_after(node, after[id(node)])
        if front:
            first = next(iter(graph), None)
            if first is None:
                graph.extend(front)
            else:
                graph.insert_before(first, front)
        return ir.passes.PassResult(model, modified=bool(self.encodings))

    # ------------------------------------------------------------------ one tensor

    def _fresh(self, base: str) -> str:
        return self._namer.fresh(base)

    def _value(self, name: str) -> ir.Value:
        if name not in self._values:
            raise ExportError(f"the encodings name tensor '{name}', which the model does not have")
        return self._values[name]

    def _chain(self, value: ir.Value, enc: TensorEncoding) -> list[ir.Node]:
        """The chain for ``value``, its readers (and graph-output slot) moved onto the result."""
        scale, zero_point = self._constants(value, enc)
        graph = value.graph
        uses = list(value.uses())
        output_at = [i for i, out in enumerate(graph.outputs) if out is value]
        name = enc.name
        if output_at:
            if value.is_graph_input():
                raise ExportError(
                    f"tensor '{name}' is both a graph input and output; cannot encode"
                )
            self._rename(value, self._fresh(f"{name}_raw"))
            dst = name
        else:
            dst = self._fresh(f"{name}_fq")
        nodes = self._chain_nodes(value, dst, scale, zero_point, enc)
        result = nodes[-1].outputs[0]
        result.type, result.shape = value.type, value.shape  # the chain keeps dtype and shape
        for use in uses:
            use.node.replace_input_with(use.idx, result)
        for i in output_at:
            graph.outputs[i] = result
        return nodes

    def _rename(self, value: ir.Value, name: str) -> None:
        """Give ``value`` (an op output or an initializer) a new name."""
        graph = value.graph
        if value.is_initializer():
            graph.initializers.pop(value.name)
            value.name = name
            graph.register_initializer(value)
        else:
            value.name = name

    def _tensor_dims(self, value: ir.Value) -> tuple[int | None, ...]:
        if value.is_initializer() and value.const_value is not None:
            return tuple(value.const_value.shape)
        if self._dims is None:
            self._dims = self._dims_source() if self._dims_source is not None else {}
        if value.name not in self._dims:
            raise ExportError(f"tensor '{value.name}': rank unknown, cannot lay out its encodings")
        return self._dims[value.name]

    def _axes(self, value: ir.Value, enc: TensorEncoding, rank: int) -> tuple[int, int]:
        """The axis to broadcast along: stated (2.0.0), else from the consuming op (1.0.0, 0.6.1)."""
        if not enc.axis_implied:
            return int(enc.axis or 0), int(enc.axis or 0)
        weight_of = [use.node for use in value.uses() if use.idx == 1]
        if not weight_of:
            return 0, 1
        node = weight_of[0]
        return weight_axes(node.op_type, rank, bool(node.attributes.get_int("transB", 0)))

    def _lpbq_axes(self, value: ir.Value, enc: TensorEncoding, rank: int) -> tuple[int, int]:
        """(channel axis, block axis) of an LPBQ encoding on ``value``: from the consuming op
        for 1.0.0, the stated block axis and the other varying axis for 2.0.0."""
        if enc.axis_implied:
            return self._axes(value, enc, rank)
        block = int(enc.axis or 0) % rank
        return lpbq_axes(enc.scale.shape, block, None)

    def _constants(self, value: ir.Value, enc: TensorEncoding) -> tuple[np.ndarray, np.ndarray]:
        """Scale and zero point as float32 arrays that broadcast against the tensor."""
        if value.is_initializer() and value.dtype != ir.DataType.FLOAT:
            raise ExportError(f"tensor '{enc.name}' is not float32; cannot fake-quantize it")
        scale, zero_point = enc.scale, enc.zero_point.astype(np.float32)
        if enc.granularity == "PER_TENSOR":
            return scale.reshape(()), zero_point.reshape(())
        dims = self._tensor_dims(value)
        if enc.granularity == "LPBQ":
            channel_axis, block_axis = self._lpbq_axes(value, enc, len(dims))
            grid, _ = lpbq_grids(enc, channel_axis, block_axis, len(dims))
            full = _expand_blocks(grid, enc, block_axis, dims)
            return full, np.zeros(full.shape, dtype=np.float32)
        channel_axis, block_axis = self._axes(value, enc, len(dims))
        if enc.granularity == "PER_CHANNEL":
            shape = _channel_shape(enc, channel_axis, dims)
            return scale.reshape(shape), zero_point.reshape(shape)
        return _expand_blocks(scale, enc, block_axis, dims), _expand_blocks(
            zero_point, enc, block_axis, dims
        )

    def _const(self, graph: ir.Graph, base: str, array: np.ndarray) -> ir.Value:
        name = self._fresh(base)
        tensor = ir.tensor(array.astype(np.float32), name=name)
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
        """``Div -> Round -> Add -> Clip -> Sub -> Mul`` from ``src`` to a value named ``dst``."""
        graph = src.graph
        base = f"{enc.name}_fq"
        s = self._const(graph, f"{base}_scale", scale)
        z = self._const(graph, f"{base}_zero_point", zero_point)
        lo = self._const(graph, f"{base}_qmin", np.array(enc.qmin))
        hi = self._const(graph, f"{base}_qmax", np.array(enc.qmax))
        steps = [("Div", [s]), ("Round", []), ("Add", [z]), ("Clip", [lo, hi]), ("Sub", [z])]
        nodes: list[ir.Node] = []
        current = src
        for op, extra in steps:
            out = self._fresh(f"{base}_{op.lower()}")
            node = ir.node(op, [current, *extra], name=out, outputs=[ir.Value(name=out)])
            nodes.append(node)
            current = node.outputs[0]
        mul = ir.node(
            "Mul", [current, s], name=self._fresh(f"{base}_mul"), outputs=[ir.Value(name=dst)]
        )
        nodes.append(mul)
        return nodes
