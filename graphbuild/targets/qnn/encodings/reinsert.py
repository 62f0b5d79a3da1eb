"""Put an encodings document back into a float ONNX graph as float quantize-dequantize, so
numerics can be checked from the ``.encodings`` file alone."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphbuild.errors import ExportError
from graphbuild.onnx.naming import fresh_name
from graphbuild.targets.qnn.encodings.read import TensorEncoding, read_encodings

__all__ = ["insert_fake_quant"]

_MIN_OPSET = 11  # Round and Clip(min, max inputs)


def insert_fake_quant(model: onnx.ModelProto, doc: Mapping[str, Any]) -> onnx.ModelProto:
    """A copy of ``model`` with every tensor of ``doc`` quantize-dequantized in float.

    Each tensor ``t`` gets ``Div(s) -> Round -> Add(z) -> Clip(qmin, qmax) -> Sub(z) -> Mul(s)``
    right after its producer (at the front for initializers and graph inputs), and every
    consumer reads the result. A graph output keeps its name: the producer's output is renamed
    and the chain writes the output. ``model`` is not modified.
    """
    encodings = read_encodings(doc)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _check_opset(out)
    editor = _FakeQuantEditor(out, original=model)
    for enc in encodings.values():
        editor.add(enc)
    editor.finish()
    return out


def _check_opset(model: onnx.ModelProto) -> None:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < _MIN_OPSET:
        raise ExportError(f"fake quantization needs ONNX opset >= {_MIN_OPSET}, got {opset}")


def _graph_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor and node name used in ``graph`` (not its subgraphs)."""
    names = {t.name for t in graph.initializer}
    names.update(v.name for v in (*graph.input, *graph.output, *graph.value_info))
    for node in graph.node:
        names.update(node.output)
        names.update(node.input)
        names.add(node.name)
    return names


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


def _rename_inputs(nodes: Iterable[onnx.NodeProto], renames: Mapping[str, str]) -> None:
    """Point every input in ``renames`` (also inside subgraphs) to its new name."""
    for node in nodes:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        for attr in node.attribute:
            for sub in (attr.g,) if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                _rename_inputs(sub.node, renames)
                for out in sub.output:
                    out.name = renames.get(out.name, out.name)


def _node_axes(node: onnx.NodeProto, rank: int) -> tuple[int, int]:
    """(output-channel axis, input-channel axis) of ``node``'s weight input, as QNN reads it."""
    if node.op_type == "ConvTranspose":
        return 1, 0
    if node.op_type == "MatMul":
        return rank - 1, rank - 2
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return (0, 1) if trans_b else (1, 0)
    return 0, 1


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


class _FakeQuantEditor:
    """Collects fake-quant chains for one graph, then rewires and inserts them in one pass."""

    def __init__(self, model: onnx.ModelProto, original: onnx.ModelProto):
        graph = model.graph
        self.graph, self.original = graph, original
        self.inits = {t.name: t for t in graph.initializer}
        self.inputs = {v.name for v in graph.input}
        self.outputs = {v.name for v in graph.output}
        self.producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        for node in graph.node:
            for i, name in enumerate(node.input):
                self.consumers[name].append((node, i))
        self.used = _graph_names(graph)
        self.renames: dict[str, str] = {}
        self.front: list[onnx.NodeProto] = []
        self.after: dict[int, list[onnx.NodeProto]] = defaultdict(list)
        self.new_inits: list[onnx.TensorProto] = []
        self._dims: dict[str, tuple[int | None, ...]] | None = None

    def fresh(self, base: str) -> str:
        """A name not yet used in the graph, based on ``base``."""
        return fresh_name(base, self.used)

    def add(self, enc: TensorEncoding) -> None:
        """Plan the chain for ``enc``'s tensor and the rewiring of its readers."""
        name = enc.name
        position = self._position(name)
        scale, zero_point = self._constants(enc)
        if name in self.outputs:
            src, dst = self._detach_output(name), name
        else:
            src, dst = name, self.fresh(f"{name}_fq")
            self.renames[name] = dst
        chain = self._chain(src, dst, scale, zero_point, enc)
        (self.front if position < 0 else self.after[position]).extend(chain)

    def finish(self) -> None:
        """Rewire the readers and put the chains and their constants into the graph."""
        _rename_inputs(self.graph.node, self.renames)
        nodes: list[onnx.NodeProto] = list(self.front)
        for i, node in enumerate(self.graph.node):
            nodes.append(node)
            nodes.extend(self.after.get(i, ()))
        copies = [onnx.NodeProto() for _ in nodes]
        for copy, node in zip(copies, nodes, strict=True):
            copy.CopyFrom(node)
        del self.graph.node[:]
        self.graph.node.extend(copies)
        self.graph.initializer.extend(self.new_inits)

    def _position(self, name: str) -> int:
        """-1 for initializers and graph inputs, else the producing node's index."""
        if name in self.inits or name in self.inputs:
            return -1
        if name not in self.producer:
            raise ExportError(f"the encodings name tensor '{name}', which the model does not have")
        return self.producer[name]

    def _detach_output(self, name: str) -> str:
        """Rename the definition of graph output ``name`` so the chain can write ``name``."""
        if name in self.inputs:
            raise ExportError(f"tensor '{name}' is both a graph input and output; cannot encode")
        raw = self.fresh(f"{name}_raw")
        if name in self.inits:
            self.inits[name].name = raw
            return raw
        outputs = self.graph.node[self.producer[name]].output
        outputs[list(outputs).index(name)] = raw
        return raw

    def _tensor_dims(self, name: str) -> tuple[int | None, ...]:
        if name in self.inits:
            return tuple(self.inits[name].dims)
        if self._dims is None:
            self._dims = _value_dims(self.original)
        if name not in self._dims:
            raise ExportError(f"tensor '{name}': rank unknown, cannot lay out its encodings")
        return self._dims[name]

    def _axes(self, enc: TensorEncoding, rank: int) -> tuple[int, int]:
        """The axis to broadcast along: stated (2.0.0), else from the consuming op (1.0.0, 0.6.1)."""
        if not enc.axis_implied:
            return int(enc.axis or 0), int(enc.axis or 0)
        weight_of = [n for n, i in self.consumers.get(enc.name, ()) if i == 1]
        return _node_axes(weight_of[0], rank) if weight_of else (0, 1)

    def _constants(self, enc: TensorEncoding) -> tuple[np.ndarray, np.ndarray]:
        """Scale and zero point as float32 arrays that broadcast against the tensor."""
        if enc.name in self.inits and self.inits[enc.name].data_type != onnx.TensorProto.FLOAT:
            raise ExportError(f"tensor '{enc.name}' is not float32; cannot fake-quantize it")
        scale, zero_point = enc.scale, enc.zero_point.astype(np.float32)
        if enc.granularity == "PER_TENSOR":
            return scale.reshape(()), zero_point.reshape(())
        dims = self._tensor_dims(enc.name)
        channel_axis, block_axis = self._axes(enc, len(dims))
        if enc.granularity == "PER_CHANNEL":
            shape = _channel_shape(enc, channel_axis, dims)
            return scale.reshape(shape), zero_point.reshape(shape)
        return _expand_blocks(scale, enc, block_axis, dims), _expand_blocks(
            zero_point, enc, block_axis, dims
        )

    def _const(self, base: str, value: np.ndarray) -> str:
        name = self.fresh(base)
        self.new_inits.append(numpy_helper.from_array(value.astype(np.float32), name))
        return name

    def _chain(
        self, src: str, dst: str, scale: np.ndarray, zero_point: np.ndarray, enc: TensorEncoding
    ) -> list[onnx.NodeProto]:
        """``Div -> Round -> Add -> Clip -> Sub -> Mul`` from ``src`` to ``dst``."""
        base = f"{enc.name}_fq"
        s = self._const(f"{base}_scale", scale)
        z = self._const(f"{base}_zero_point", zero_point)
        lo = self._const(f"{base}_qmin", np.array(enc.qmin))
        hi = self._const(f"{base}_qmax", np.array(enc.qmax))
        steps = [("Div", [s]), ("Round", []), ("Add", [z]), ("Clip", [lo, hi]), ("Sub", [z])]
        nodes, value = [], src
        for op, extra in steps:
            out = self.fresh(f"{base}_{op.lower()}")
            nodes.append(helper.make_node(op, [value, *extra], [out], name=out))
            value = out
        nodes.append(helper.make_node("Mul", [value, s], [dst], name=self.fresh(f"{base}_mul")))
        return nodes
