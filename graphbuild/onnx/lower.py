"""``lower_markers``: turn the ``graphbuild.q`` markers of a skeleton into plain ONNX.

* ``onnx``: markers are removed; the returned name map says which ONNX tensor each quantizer
  annotates (for the encodings file).
* ``onnx_qdq``: each marker becomes QuantizeLinear -> DequantizeLinear.

Value-independent only: scales, zero points and clip bounds are data-less initializers
(external location :data:`QPARAMS_LOCATION`) that :func:`graphbuild.onnx.bind.bind` fills.
Each such initializer records what it holds in its TensorProto ``metadata_props``:
:data:`QID_KEY` (the quantizer), :data:`ROLE_KEY` (one of :data:`ROLES`) and, for role
``quantized``, :data:`SOURCE_KEY` (the state tensor to quantize). Metadata props survive
``onnx_ir`` round trips, unlike extra ``external_data`` keys.

Grids narrower than their container (int8 in [-127, 127]): the exact container is used when
one exists (a 4-bit grid [-8, 7] is int4 whatever container torch stored it in). Otherwise the
container is kept and the input is clamped to the grid's float range first: per-tensor with
``Clip`` (scalar bounds ``{name}_clip_min``/``{name}_clip_max``); per-channel and blocked with
``Max`` then ``Min``, since ``Clip`` takes scalar bounds only: per-channel bounds have shape
``[1, .., C, .., 1]`` (broadcast along ``axis``), blocked bounds the input's full shape.
Grids wider than 16 bits (int32 biases) have no QuantizeLinear type: a quantized parameter
becomes ``DequantizeLinear`` of an int32 initializer ``{name}_quantized`` (role ``quantized``),
which bind computes from the state tensor; a 32-bit activation is an error.

A target's own Q/DQ forms may add references of two more roles: ``bias_scale``, the product of
the scales of quantizers :data:`QID_KEY` and :data:`WEIGHT_QID_KEY` (an int32 bias's scale), and
``bias``, the state tensor :data:`SOURCE_KEY` on that int32 grid. A zero point whose container
is unsigned while its quantizer's grid is signed (or the other way round) is the same grid
shifted by half the container's range.

An LPBQ weight (:mod:`graphbuild.quant.lpbq`) is lowered to the form QNN's HTP takes
(:mod:`graphbuild.onnx.lpbq`): its quantized values (role ``quantized``) dequantized with a
scale that a ``DequantizeLinear`` makes from the integer block scales (role
``block_int_scale``, uint8), the per-channel float scales (``channel_scale``) and zero
points (``channel_zero_point``). A 2-D weight whose only reader is a ``Transpose`` is stored
transposed and the Transpose dropped; its references then carry :data:`PERM_KEY`, the
permutation ``bind`` applies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from graphbuild.errors import ExportError
from graphbuild.onnx.lpbq import (
    MAX_BLOCK_SCALE_BITS,
    PERM_KEY,
    foldable_transpose,
    lpbq_dequantize,
)
from graphbuild.onnx.naming import Namer
from graphbuild.onnx.skeleton import STATE_LOCATION
from graphbuild.quant.lpbq import lpbq_axes
from graphbuild.quant.markers import MARKER_DOMAIN, MARKER_OP
from graphbuild.quant.quantmap import QuantMap, QuantSpec

FORMATS = ("onnx", "onnx_qdq")
QPARAMS_LOCATION = "graphbuild:qparams"
"""External-data location of a data-less scale, zero-point, bound or quantized initializer."""
QID_KEY = "graphbuild.qid"
ROLE_KEY = "graphbuild.role"
SOURCE_KEY = "graphbuild.source"
WEIGHT_QID_KEY = "graphbuild.weight_qid"
ROLES = (
    "scale",
    "zero_point",
    "clip_min",
    "clip_max",
    "quantized",
    "bias",
    "bias_scale",
    "block_int_scale",
    "channel_scale",
    "channel_zero_point",
)

_CONTAINERS = (
    ir.DataType.INT4,
    ir.DataType.UINT4,
    ir.DataType.INT8,
    ir.DataType.UINT8,
    ir.DataType.INT16,
    ir.DataType.UINT16,
)
_OPSET_21 = {ir.DataType.INT4, ir.DataType.UINT4, ir.DataType.INT16, ir.DataType.UINT16}
_FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


def lower_markers(
    skeleton: onnx.ModelProto, qmap: QuantMap, fmt: str
) -> tuple[onnx.ModelProto, dict[int, str]]:
    """Lower every marker of ``skeleton`` for format ``fmt``.

    Returns the lowered model and ``names``: qid -> the ONNX tensor the quantizer annotates
    (``onnx``: the marker's input, or the graph output's name when the marker feeds one;
    ``onnx_qdq``: the tensor entering QuantizeLinear).
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown ONNX format '{fmt}': expected one of {', '.join(FORMATS)}")
    model = ir.serde.deserialize_model(skeleton)
    found = [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if _is_marker(n)]
    lowering = _Lowering(model, qmap)
    # decided on the graph as exported: lowering one marker rewires what others see
    shared = {id(n) for n in found if _has_other_uses(n.inputs[0], n)}
    shared |= _differently_quantized_weights(found)
    for node in found:
        lowering.lower(node, fmt, id(node) in shared)
    model.opset_imports.pop(MARKER_DOMAIN, None)
    _check_no_markers(model)
    return ir.serde.serialize_model(model), lowering.names()


def container_dtype(spec: QuantSpec) -> ir.DataType:
    """The smallest integer container for ``spec.bits`` and ``spec.signed``."""
    for bits, signed, unsigned in (
        (4, ir.DataType.INT4, ir.DataType.UINT4),
        (8, ir.DataType.INT8, ir.DataType.UINT8),
        (16, ir.DataType.INT16, ir.DataType.UINT16),
    ):
        if spec.bits <= bits:
            return signed if spec.signed else unsigned
    if spec.bits <= 32 and spec.qmin >= -(2**31) and spec.qmax < 2**31:
        return ir.DataType.INT32
    raise ExportError(f"quantizer {spec.qid}: no integer container holds a {spec.bits}-bit grid")


def dtype_range(dtype: ir.DataType) -> tuple[int, int]:
    """``(min, max)`` of an integer ONNX data type."""
    bits = dtype.bitwidth
    if dtype.is_signed():
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def qdq_dtype(spec: QuantSpec, opset: int | None = None) -> tuple[ir.DataType, bool]:
    """The QuantizeLinear output type of ``spec`` and whether it holds the grid exactly.

    An exact container other than the one ``spec.bits`` implies is only taken when ``opset``
    (None: any) supports it; the implied container with clamping is the fallback.
    """
    grid = (spec.qmin, spec.qmax)
    container = container_dtype(spec)
    if dtype_range(container) == grid:
        return container, True
    for dtype in _CONTAINERS:
        if dtype_range(dtype) == grid and (opset is None or opset >= min_opset(spec, dtype)):
            return dtype, True
    low, high = dtype_range(container)
    if spec.qmin < low or spec.qmax > high or spec.qmin > spec.qmax:
        raise ExportError(
            f"quantizer {spec.qid}: grid [{spec.qmin}, {spec.qmax}] does not fit "
            f"its {container.name.lower()} container"
        )
    return container, False


def min_opset(spec: QuantSpec, dtype: ir.DataType, input_dtype: ir.DataType | None = None) -> int:
    """The lowest default-domain opset whose Q/DQ ops support this quantizer."""
    if dtype in _OPSET_21 or spec.block_size is not None:
        return 21
    if input_dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return 19
    return 13


def _is_marker(node: ir.Node) -> bool:
    return node.domain == MARKER_DOMAIN and node.op_type == MARKER_OP


def _check_no_markers(model: ir.Model) -> None:
    left = [
        n for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.domain == MARKER_DOMAIN
    ]
    if left:
        raise ExportError(f"graphbuild nodes left after lowering: {[n.name for n in left]}")


@dataclass
class _QParams:
    """Scale and zero-point initializers of one quantizer (shared by its Q and DQ)."""

    scale: ir.Value
    zero_point: ir.Value


class _Lowering:
    """State shared across the markers of one model: names, qid -> tensor, qparams."""

    def __init__(self, model: ir.Model, qmap: QuantMap):
        self.qmap = qmap
        self.opset = model.opset_imports.get("", 0)
        self.namer = Namer(model.graph)
        self.annotated: dict[int, ir.Value] = {}
        self.sources: dict[int, ir.Value] = {}
        self.qparams: dict[int, _QParams] = {}

    def lower(self, node: ir.Node, fmt: str, shared: bool = False) -> None:
        qid = _qid(node)
        if not 0 <= qid < len(self.qmap) or self.qmap[qid].qid != qid:
            raise ExportError(f"marker '{node.name}' has qid {qid}, which the quant map lacks")
        source = node.inputs[0]
        if qid in self.sources and self.sources[qid] is not source:
            raise ExportError(
                f"quantizer {qid} marks two different tensors: "
                f"'{self.sources[qid].name}' and '{source.name}'"
            )
        self.sources[qid] = source
        if shared:
            self._unshare_weight(node, qid)
        if fmt == "onnx":
            value = _strip(node, keep_identity=shared and not node.inputs[0].is_initializer())
        else:
            value = self._qdq(node, self.qmap[qid])
        self.annotated.setdefault(qid, value)

    def _unshare_weight(self, node: ir.Node, qid: int) -> None:
        """Give a quantized weight that other nodes also read (a tied embedding) its own
        initializer, bound from the same state tensor: quantizing it must not change what
        the float consumers read, in torch or in QNN (which applies a param encoding to
        every reader of the tensor)."""
        x = node.inputs[0]
        if not x.is_initializer():
            return
        tensor = x.const_value
        if not isinstance(tensor, ir.ExternalTensor) or tensor.location != STATE_LOCATION:
            return
        name = self.namer.fresh(f"{x.name}.q{qid}")
        copy = ir.Value(name=name, shape=x.shape, type=x.type)
        copy.const_value = ir.ExternalTensor(
            location=STATE_LOCATION,
            offset=0,
            length=tensor.length,
            dtype=tensor.dtype,
            shape=tensor.shape,
            name=name,
            metadata_props={SOURCE_KEY: x.name},
        )
        _owning_graph(x).register_initializer(copy)
        node.replace_input_with(0, copy)

    def names(self) -> dict[int, str]:
        """qid -> tensor name, read at the end: a later marker may rename a tensor."""
        return {qid: value.name for qid, value in sorted(self.annotated.items())}

    def _qdq(self, node: ir.Node, spec: QuantSpec) -> ir.Value:
        x = node.inputs[0]
        if spec.block_scale_bits is not None:
            return self._lpbq(node, spec, x)
        if spec.bits <= 16:
            dtype, exact = qdq_dtype(spec, self.opset)
        else:
            dtype, exact = container_dtype(spec), True
        self._check_opset(spec, dtype, x)
        qp = self._qparams(spec, x, dtype)
        if dtype == ir.DataType.INT32:
            new_nodes, y = self._dequantize_param(spec, x, qp)
        else:
            new_nodes, y = self._quantize_dequantize(spec, x, qp, exact)
        _replace(node, new_nodes, y)
        self._drop_if_unused(x)
        return x

    def _lpbq(self, node: ir.Node, spec: QuantSpec, x: ir.Value) -> ir.Value:
        """An LPBQ weight in the HTP's form (see :mod:`graphbuild.onnx.lpbq`)."""
        if not x.is_initializer():
            raise ExportError(
                f"quantizer {spec.qid} ({spec.op} at {spec.node}) is LPBQ, which quantizes "
                f"weights; '{x.name}' is an activation"
            )
        if int(spec.block_scale_bits or 0) > MAX_BLOCK_SCALE_BITS:
            raise ExportError(
                f"quantizer {spec.qid}: {spec.block_scale_bits}-bit LPBQ block scales do not fit "
                f"the uint8 QNN reads them as (at most {MAX_BLOCK_SCALE_BITS} bits); use the "
                "onnx format, whose encodings say them"
            )
        dtype, _ = qdq_dtype(spec, self.opset)
        self._check_opset(spec, dtype, x)
        dims, grid = _static_shape(spec, x), _qparam_shape(spec, x)
        channel, block = lpbq_axes(grid, int(spec.axis or 0), spec.channel_axis)
        transpose = foldable_transpose(node.outputs[0])
        perm = None
        if transpose is not None:
            dims, grid, perm = dims[::-1], grid[::-1], "1,0"
            channel, block = 1 - channel, 1 - block
        qid, channels = spec.qid, (grid[channel],)
        quantized = self._initializer(x, "quantized", qid, dtype, dims, x.name, perm)
        ints = self._initializer(x, "block_int_scale", qid, ir.DataType.UINT8, grid, perm=perm)
        chan = self._initializer(x, "channel_scale", qid, x.dtype, channels)
        chan_zp = self._initializer(x, "channel_zero_point", qid, ir.DataType.UINT8, channels)
        zero_point = self._initializer(x, "zero_point", qid, dtype, grid, perm=perm)
        fresh = self.namer.fresh
        nodes, y = lpbq_dequantize(
            quantized,
            ints,
            chan,
            chan_zp,
            zero_point,
            channel_axis=channel,
            block_axis=block,
            block_size=int(spec.block_size or 0),
            names=(
                fresh(f"{x.name}_scale_DequantizeLinear"),
                fresh(f"{x.name}_scale"),
                fresh(f"{x.name}_DequantizeLinear"),
                fresh(f"{x.name}_dq"),
            ),
            out_type=x.type,
        )
        if transpose is None:
            _replace(node, nodes, y)
        else:  # the Transpose's readers read the transposed weight
            graph = node.graph
            graph.insert_before(node, nodes)
            t_out = transpose.outputs[0]
            name = t_out.name
            t_out.replace_all_uses_with(y, replace_graph_outputs=True)
            graph.remove(transpose, safe=True)
            graph.remove(node, safe=True)
            t_out.name = None
            y.name = name
        self._drop_if_unused(x)
        return x

    def _check_opset(self, spec: QuantSpec, dtype: ir.DataType, x: ir.Value) -> None:
        if x.dtype not in _FLOATS:
            raise ExportError(f"quantizer {spec.qid}: '{x.name}' is {x.dtype}, not a float tensor")
        need = min_opset(spec, dtype, x.dtype)
        if self.opset < need:
            raise ExportError(
                f"quantizer {spec.qid} ({dtype.name.lower()}, {spec.granularity.lower()}) "
                f"needs QuantizeLinear/DequantizeLinear from opset {need}; the skeleton has "
                f"opset {self.opset}: export with opset >= {need}"
            )

    def _qparams(self, spec: QuantSpec, x: ir.Value, dtype: ir.DataType) -> _QParams:
        if spec.qid not in self.qparams:
            shape = _qparam_shape(spec, x)
            self.qparams[spec.qid] = _QParams(
                self._initializer(x, "scale", spec.qid, x.dtype, shape),
                self._initializer(x, "zero_point", spec.qid, dtype, shape),
            )
        return self.qparams[spec.qid]

    def _initializer(
        self,
        x: ir.Value,
        role: str,
        qid: int,
        dtype: ir.DataType,
        shape: tuple[int, ...],
        source: str | None = None,
        perm: str | None = None,
    ) -> ir.Value:
        name = self.namer.fresh(f"{x.name}_{role}")
        meta = {QID_KEY: str(qid), ROLE_KEY: role}
        if source is not None:
            meta[SOURCE_KEY] = source
        if perm is not None:
            meta[PERM_KEY] = perm
        tensor = ir.ExternalTensor(
            location=QPARAMS_LOCATION,
            offset=0,
            length=math.ceil(dtype.bitwidth * math.prod(shape) / 8),
            dtype=dtype,
            shape=ir.Shape(shape),
            name=name,
            metadata_props=meta,
        )
        value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))
        value.const_value = tensor
        _owning_graph(x).register_initializer(value)
        return value

    def _quantize_dequantize(
        self, spec: QuantSpec, x: ir.Value, qp: _QParams, exact: bool
    ) -> tuple[list[ir.Node], ir.Value]:
        nodes = [] if exact else self._clamp(spec, x)
        clamped = nodes[-1].outputs[0] if nodes else x
        attrs = _qdq_attributes(spec)
        q = self._node("QuantizeLinear", [clamped, qp.scale, qp.zero_point], attrs, x, "quantized")
        q.outputs[0].type = ir.TensorType(qp.zero_point.dtype)
        dq = self._node("DequantizeLinear", [q.outputs[0], qp.scale, qp.zero_point], attrs, x, "dq")
        return [*nodes, q, dq], dq.outputs[0]

    def _clamp(self, spec: QuantSpec, x: ir.Value) -> list[ir.Node]:
        shape = _bound_shape(spec, x)
        low = self._initializer(x, "clip_min", spec.qid, x.dtype, shape)
        high = self._initializer(x, "clip_max", spec.qid, x.dtype, shape)
        if spec.axis is None:
            return [self._node("Clip", [x, low, high], {}, x, "clipped")]
        floor = self._node("Max", [x, low], {}, x, "floored")
        return [floor, self._node("Min", [floor.outputs[0], high], {}, x, "clipped")]

    def _dequantize_param(
        self, spec: QuantSpec, x: ir.Value, qp: _QParams
    ) -> tuple[list[ir.Node], ir.Value]:
        if not x.is_initializer():
            raise ExportError(
                f"quantizer {spec.qid}: a {spec.bits}-bit grid has no QuantizeLinear type; "
                f"only parameters (not the activation '{x.name}') can be lowered to "
                "DequantizeLinear of a precomputed int32 tensor"
            )
        shape = tuple(x.shape.numpy())
        quantized = self._initializer(
            x, "quantized", spec.qid, ir.DataType.INT32, shape, source=x.name
        )
        dq = self._node(
            "DequantizeLinear", [quantized, qp.scale, qp.zero_point], _qdq_attributes(spec), x, "dq"
        )
        return [dq], dq.outputs[0]

    @staticmethod
    def _drop_if_unused(x: ir.Value) -> None:
        """Drop a float initializer that only its (now int32) quantizer read."""
        if x.is_initializer() and not x.uses() and not x.is_graph_output():
            _owning_graph(x).initializers.pop(x.name)

    def _node(
        self, op: str, inputs: list[ir.Value], attrs: dict, x: ir.Value, suffix: str
    ) -> ir.Node:
        shape = None if x.shape is None else ir.Shape(x.shape)
        out = ir.Value(name=self.namer.fresh(f"{x.name}_{suffix}"), shape=shape, type=x.type)
        return ir.Node(
            "",
            op,
            inputs,
            attributes=ir.convenience.convert_attributes(attrs),
            outputs=[out],
            name=self.namer.fresh(f"{x.name}_{op}"),
        )


def _qid(node: ir.Node) -> int:
    attr = node.attributes.get("qid")
    if attr is None:
        raise ExportError(f"marker '{node.name}' has no 'qid' attribute")
    return attr.as_int()


def _owning_graph(x: ir.Value) -> ir.Graph:
    graph = x.graph
    if graph is None:
        raise ExportError(f"tensor '{x.name}' belongs to no graph")
    return graph


def _static_shape(spec: QuantSpec, x: ir.Value) -> tuple[int, ...]:
    dims = tuple(x.shape) if x.shape is not None else None
    if dims is None or not all(isinstance(d, int) for d in dims):
        raise ExportError(
            f"quantizer {spec.qid}: '{x.name}' needs a static shape for its "
            f"{spec.granularity.lower()} parameters, got {dims}"
        )
    return dims


def _qparam_shape(spec: QuantSpec, x: ir.Value) -> tuple[int, ...]:
    """Scale/zero-point shape: scalar, ``[C]``, or the input's shape with ``axis`` blocked."""
    if spec.axis is None:
        return ()
    dims = _static_shape(spec, x)
    axis = spec.axis % len(dims)
    if spec.block_size is None:
        return (dims[axis],)
    blocked = list(dims)
    blocked[axis] = math.ceil(dims[axis] / spec.block_size)
    return tuple(blocked)


def _bound_shape(spec: QuantSpec, x: ir.Value) -> tuple[int, ...]:
    """Clip-bound shape: scalar, ``[1, .., C, .., 1]`` per channel, full shape blocked."""
    if spec.axis is None:
        return ()
    dims = _static_shape(spec, x)
    if spec.block_size is not None:
        return dims
    axis = spec.axis % len(dims)
    return tuple(d if i == axis else 1 for i, d in enumerate(dims))


def _qdq_attributes(spec: QuantSpec) -> dict[str, int]:
    attrs: dict[str, int] = {}
    if spec.axis is not None:
        attrs["axis"] = spec.axis
    if spec.block_size is not None:
        attrs["block_size"] = spec.block_size
    return attrs


def _replace(node: ir.Node, new_nodes: Iterable[ir.Node], y: ir.Value) -> None:
    """Put ``new_nodes`` in place of marker ``node``; ``y`` takes over its output and name."""
    graph = node.graph
    out = node.outputs[0]
    graph.insert_before(node, list(new_nodes))
    name = out.name
    out.replace_all_uses_with(y, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    out.name = None
    y.name = name


def _has_other_uses(x: ir.Value, node: ir.Node) -> bool:
    """Whether ``x`` has float readers besides ``node``: graph outputs, or nodes that are
    not themselves markers (another marker reading ``x`` quantizes it too)."""
    return x.is_graph_output() or any(
        use.node is not node and not _is_marker(use.node) for use in x.uses()
    )


def _differently_quantized_weights(markers: list[ir.Node]) -> set[int]:
    """Markers (by id) of an initializer that an earlier marker quantizes with another qid (a
    tied embedding table and output layer): each gets its own copy of the initializer, since
    one tensor carries one encoding (and AIMET refuses such shared weights)."""
    first: dict[str, int] = {}
    later: set[int] = set()
    for node in markers:
        x = node.inputs[0]
        if x is None or not x.is_initializer():
            continue
        if first.setdefault(x.name or "", _qid(node)) != _qid(node):
            later.add(id(node))
    return later


def _strip(node: ir.Node, keep_identity: bool = False) -> ir.Value:
    """Remove marker ``node``; returns the tensor it annotated. With ``keep_identity`` (the
    tensor has unquantized readers too) the marker becomes an Identity whose output carries
    the encoding, so only the marker's readers see quantized values."""
    graph = node.graph
    x, out = node.inputs[0], node.outputs[0]
    if keep_identity:
        node.domain, node.op_type = "", "Identity"
        node.attributes.clear()
        return out
    if not out.is_graph_output():
        out.replace_all_uses_with(x)
        graph.remove(node, safe=True)
        return x
    if _renamable(x, graph):
        name = out.name
        out.replace_all_uses_with(x, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        out.name = None
        x.name = name
        return x
    node.domain, node.op_type = "", "Identity"  # x is an input, initializer or output
    node.attributes.clear()
    return out


def _renamable(x: ir.Value, graph: ir.Graph) -> bool:
    producer = x.producer()
    return (
        producer is not None
        and producer.graph is graph
        and not x.is_graph_output()
        and not x.is_graph_input()
    )
