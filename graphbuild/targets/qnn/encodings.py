"""QNN encodings: write them (1.0.0, 0.6.1, 2.0.0), read them back, and put them back into ONNX.

A quantizer is ``x = s * (q - z)`` with ``q`` in ``[qmin, qmax]`` (DESIGN.md, "QNN encodings
formats"). QNN's 1.0.0 and 0.6.1 store an *offset* on the unsigned grid instead of ``z``; 2.0.0
stores ``z`` itself, as ONNX QuantizeLinear does. :func:`read_encodings` is the inverse of
:func:`build_encodings`, and :func:`insert_fake_quant` turns an encodings document into float
quantize-dequantize in the float ONNX graph, so numerics can be checked from the file alone.

What the formats cannot say, and the conventions used to read them back:

- 1.0.0 and 0.6.1 store no container: symmetric entries are read as signed, asymmetric as
  unsigned (same values, the zero point moves by ``2^(bw-1)``). No format stores a grid narrower
  than its container (int8 in ``[-127, 127]``): the full grid is read back.
- 1.0.0 and 0.6.1 store no axis: per-channel is the output channel of the consuming op, blocked
  is along its input channel; :func:`insert_fake_quant` resolves both from the ONNX graph.
- 2.0.0 has one list for params and activations, so ``is_param`` reads back as ``None``.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from graphbuild.errors import ExportError
from graphbuild.frontend.quantmap import QuantMap, QuantSpec, QuantValues
from graphbuild.onnx.naming import fresh_name

__all__ = [
    "DEFAULT_VERSION",
    "VERSIONS",
    "TensorEncoding",
    "build_encodings",
    "insert_fake_quant",
    "read_encodings",
]

VERSIONS = ("1.0.0", "0.6.1", "2.0.0")
DEFAULT_VERSION = "1.0.0"
_CONTAINER_BITS = (4, 8, 16, 32)
_SECTIONS = (("activation_encodings", False), ("param_encodings", True))
_MIN_OPSET = 11  # Round and Clip(min, max inputs)


def _full_grid(bits: int, signed: bool) -> tuple[int, int]:
    """The integer range of a ``bits``-wide container."""
    if signed:
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def _check_version(version: str) -> None:
    if version not in VERSIONS:
        raise ExportError(
            f"unknown QNN encodings version '{version}'; known: {', '.join(VERSIONS)}"
        )


# ---------------------------------------------------------------------------------- writing


@dataclass(frozen=True, eq=False)
class _Quantizer:
    """One quantizer resolved to numbers: what every format writer reads."""

    name: str
    spec: QuantSpec
    scale: np.ndarray  # float32; (1,) per-tensor, (C,) per-channel, weight rank if blocked
    zero_point: np.ndarray  # int64, same shape as scale

    @property
    def offset(self) -> np.ndarray:
        """QNN's offset on the unsigned grid: ``-z``, or ``-2^(bw-1) - z`` if signed."""
        shift = 2 ** (self.spec.bits - 1) if self.spec.signed else 0
        return -shift - self.zero_point

    @property
    def is_sym(self) -> bool:
        """The spec's own answer, else: every zero point at the grid's centre."""
        if self.spec.symmetric is not None:
            return self.spec.symmetric
        centre = 0 if self.spec.signed else 2 ** (self.spec.bits - 1)
        return bool(np.all(self.zero_point == centre))

    @property
    def section(self) -> str:
        return "param_encodings" if self.spec.param is not None else "activation_encodings"


def build_encodings(
    qmap: QuantMap,
    values: QuantValues,
    names: Mapping[int, str],
    version: str = DEFAULT_VERSION,
) -> dict[str, Any]:
    """The QNN encodings document for every quantizer of ``qmap``, in qid order.

    ``names[qid]`` is the ONNX tensor the quantizer annotates. Two quantizers on one tensor
    are written once when their encodings agree; disagreeing ones are an :class:`ExportError`.
    """
    _check_version(version)
    quantizers = [_resolve(spec, values, names) for spec in sorted(qmap, key=lambda s: s.qid)]
    rows = _unique_rows((q, _ENTRY_WRITERS[version](q)) for q in quantizers)
    return _DOC_WRITERS[version](rows)


def _resolve(spec: QuantSpec, values: QuantValues, names: Mapping[int, str]) -> _Quantizer:
    where = f"quantizer {spec.qid} ({spec.op or 'op?'} at {spec.node or 'node?'})"
    if spec.qid not in names:
        raise ExportError(f"{where} has no ONNX tensor name")
    if spec.qid not in values.values:
        raise ExportError(f"{where} has no scale / zero point values")
    qp = values[spec.qid]
    scale = qp.scale.detach().cpu().to(torch.float32).numpy().copy()
    if scale.size == 0 or not np.all(np.isfinite(scale)) or np.any(scale <= 0):
        raise ExportError(f"{where}: scales must be finite and positive, got {scale.tolist()}")
    zero_point = _zero_points(qp.zero_point, scale.shape, where)
    if spec.block_size is None:
        scale, zero_point = scale.reshape(-1), zero_point.reshape(-1)
    if spec.axis is None and scale.size != 1:
        raise ExportError(f"{where} is per-tensor but has {scale.size} scales")
    return _Quantizer(names[spec.qid], spec, scale, zero_point)


def _zero_points(zero_point: torch.Tensor, shape: tuple[int, ...], where: str) -> np.ndarray:
    """Integer zero points shaped like the scales (a single one is broadcast)."""
    z = zero_point.detach().cpu()
    if z.is_floating_point():
        if not torch.equal(z, z.round()):
            raise ExportError(f"{where}: zero points must be integers, got {z.tolist()}")
        z = z.round()
    zp = z.to(torch.int64).numpy()
    if zp.size == 1:
        return np.full(shape, int(zp.reshape(-1)[0]), dtype=np.int64)
    if zp.size != math.prod(shape):
        raise ExportError(f"{where}: {zp.size} zero points for {math.prod(shape)} scales")
    return zp.reshape(shape).astype(np.int64)


def _unique_rows(rows: Iterable[tuple[_Quantizer, Any]]) -> list[tuple[_Quantizer, Any]]:
    """One row per tensor name; a second, different encoding of the same tensor is an error."""
    seen: dict[str, tuple[_Quantizer, Any]] = {}
    for q, entry in rows:
        first = seen.setdefault(q.name, (q, entry))
        if first[0] is q:
            continue
        if (first[0].section, first[1]) != (q.section, entry):
            raise ExportError(
                f"tensor '{q.name}' has conflicting encodings from quantizers "
                f"{first[0].spec.qid} and {q.spec.qid}"
            )
    return list(seen.values())


def _floats(a: np.ndarray) -> list[float]:
    return [float(v) for v in a.reshape(-1)]


def _ints(a: np.ndarray) -> list[int]:
    return [int(v) for v in a.reshape(-1)]


def _entry_1_0_0(q: _Quantizer) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": q.name,
        "dtype": "INT",
        "enc_type": q.spec.granularity,
        "bw": q.spec.bits,
        "is_sym": q.is_sym,
        "scale": _floats(q.scale),
        "offset": _ints(q.offset),
    }
    if q.spec.block_size is not None:
        entry["block_size"] = q.spec.block_size
    return entry


def _entry_0_6_1(q: _Quantizer) -> list[dict[str, Any]]:
    if q.spec.block_size is not None:
        raise ExportError(
            f"tensor '{q.name}': encodings version 0.6.1 cannot express blocked quantization; "
            "use 1.0.0 or 2.0.0"
        )
    span = 2**q.spec.bits - 1
    return [
        {
            "bitwidth": q.spec.bits,
            "dtype": "int",
            "is_symmetric": str(q.is_sym),
            "min": s * o,
            "max": s * (o + span),
            "offset": o,
            "scale": s,
        }
        for s, o in zip(_floats(q.scale), _ints(q.offset), strict=True)
    ]


def _entry_2_0_0(q: _Quantizer) -> dict[str, Any]:
    dtype, bits = _container(q.spec)
    lo, hi = _full_grid(bits, q.spec.signed)
    if np.any(q.zero_point < lo) or np.any(q.zero_point > hi):
        raise ExportError(f"tensor '{q.name}': zero points do not fit in {dtype}")
    entry: dict[str, Any] = {"name": q.name, "output_dtype": dtype}
    per_tensor = q.spec.axis is None
    entry["y_scale"] = float(q.scale.reshape(-1)[0]) if per_tensor else q.scale.tolist()
    if np.any(q.zero_point != 0):
        zp = q.zero_point
        entry["y_zero_point"] = int(zp.reshape(-1)[0]) if per_tensor else zp.tolist()
    if not per_tensor:
        entry["axis"] = q.spec.axis
    if q.spec.block_size is not None:
        entry["block_size"] = q.spec.block_size
    return entry


def _container(spec: QuantSpec) -> tuple[str, int]:
    """The smallest ONNX integer type holding ``[qmin, qmax]`` with the spec's signedness."""
    for bits in _CONTAINER_BITS:
        lo, hi = _full_grid(bits, spec.signed)
        if lo <= spec.qmin and spec.qmax <= hi:
            return f"{'int' if spec.signed else 'uint'}{bits}", bits
    raise ExportError(
        f"quantizer {spec.qid}: grid [{spec.qmin}, {spec.qmax}] fits no 4/8/16/32-bit container"
    )


def _doc_1_0_0(rows: Sequence[tuple[_Quantizer, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {"version": "1.0.0"}
    for section, _ in _SECTIONS:
        doc[section] = [entry for q, entry in rows if q.section == section]
    doc["excluded_layers"] = []
    return doc


def _doc_0_6_1(rows: Sequence[tuple[_Quantizer, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {"version": "0.6.1"}
    for section, _ in _SECTIONS:
        doc[section] = {q.name: entry for q, entry in rows if q.section == section}
    return doc


def _doc_2_0_0(rows: Sequence[tuple[_Quantizer, Any]]) -> dict[str, Any]:
    return {"version": "2.0.0", "encodings": [entry for _, entry in rows]}


_ENTRY_WRITERS: dict[str, Callable[[_Quantizer], Any]] = {
    "1.0.0": _entry_1_0_0,
    "0.6.1": _entry_0_6_1,
    "2.0.0": _entry_2_0_0,
}
_DOC_WRITERS: dict[str, Callable[[Sequence[tuple[_Quantizer, Any]]], dict[str, Any]]] = {
    "1.0.0": _doc_1_0_0,
    "0.6.1": _doc_0_6_1,
    "2.0.0": _doc_2_0_0,
}


# ---------------------------------------------------------------------------------- reading


@dataclass(frozen=True, eq=False)
class TensorEncoding:
    """One tensor's encoding as read from a document, in ``x = scale * (q - zero_point)`` form.

    ``scale`` (float32) and ``zero_point`` (int64, the container's own convention) have one
    element per-tensor, one per channel, and for blocked the block grid (2.0.0) or its flat
    C-order form (1.0.0). ``axis_implied`` says the format did not store ``axis`` (1.0.0 / 0.6.1):
    it then holds the usual convention (0 per-channel, 1 blocked) and the consuming op decides.
    ``is_param`` is ``None`` when the format does not separate params (2.0.0).
    """

    name: str
    scale: np.ndarray
    zero_point: np.ndarray
    qmin: int
    qmax: int
    bits: int
    signed: bool
    is_param: bool | None
    axis: int | None = None
    block_size: int | None = None
    axis_implied: bool = False

    @property
    def granularity(self) -> str:
        if self.block_size is not None:
            return "PER_BLOCK"
        return "PER_TENSOR" if self.axis is None else "PER_CHANNEL"


def read_encodings(doc: Mapping[str, Any]) -> dict[str, TensorEncoding]:
    """Every tensor's encoding in ``doc`` (1.0.0, 0.6.1 or 2.0.0), by tensor name."""
    version = _doc_version(doc)
    try:
        encodings = list(_READERS[version](doc))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ExportError(f"malformed {version} encodings: {type(exc).__name__}: {exc}") from exc
    out: dict[str, TensorEncoding] = {}
    for enc in encodings:
        if out.setdefault(enc.name, enc) is not enc:
            raise ExportError(f"tensor '{enc.name}' is encoded more than once")
    return out


def _doc_version(doc: Mapping[str, Any]) -> str:
    """The document's version; a legacy file without one is 0.6.1 if its sections are objects."""
    version = doc.get("version")
    if version is None and any(isinstance(doc.get(s), dict) for s, _ in _SECTIONS):
        return "0.6.1"
    _check_version(str(version))
    return str(version)


def _read_doc_1_0_0(doc: Mapping[str, Any]) -> Iterable[TensorEncoding]:
    for section, is_param in _SECTIONS:
        for entry in doc.get(section, []):
            yield _read_1_0_0(entry, is_param)


def _read_doc_0_6_1(doc: Mapping[str, Any]) -> Iterable[TensorEncoding]:
    for section, is_param in _SECTIONS:
        for name, channels in doc.get(section, {}).items():
            yield _read_0_6_1(name, channels, is_param)


def _read_doc_2_0_0(doc: Mapping[str, Any]) -> Iterable[TensorEncoding]:
    return (_read_2_0_0(entry) for entry in doc["encodings"])


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def _zero_point_from_offset(offset: np.ndarray, bits: int, signed: bool) -> np.ndarray:
    return -offset - (2 ** (bits - 1) if signed else 0)


# The axis 1.0.0 leaves unsaid: output channel per-channel, input channel blocked.
_IMPLIED_AXIS = {"PER_TENSOR": None, "PER_CHANNEL": 0, "PER_BLOCK": 1}


def _read_1_0_0(entry: Mapping[str, Any], is_param: bool) -> TensorEncoding:
    name = entry["name"]
    if entry.get("dtype", "INT") != "INT":
        raise ExportError(f"tensor '{name}': {entry['dtype']} encodings are not integer grids")
    bits, signed = int(entry["bw"]), _truthy(entry["is_sym"])
    scale = np.asarray(entry["scale"], dtype=np.float32).reshape(-1)
    offset = np.asarray(entry["offset"], dtype=np.int64).reshape(-1)
    enc_type = entry.get("enc_type", "PER_TENSOR" if scale.size == 1 else "PER_CHANNEL")
    if enc_type not in _IMPLIED_AXIS:
        raise ExportError(f"tensor '{name}': unsupported enc_type '{enc_type}'")
    axis, blocked = _IMPLIED_AXIS[enc_type], enc_type == "PER_BLOCK"
    return TensorEncoding(
        name,
        scale,
        _zero_point_from_offset(offset, bits, signed),
        *_full_grid(bits, signed),
        bits=bits,
        signed=signed,
        is_param=is_param,
        axis=axis,
        block_size=int(entry["block_size"]) if blocked else None,
        axis_implied=axis is not None,
    )


def _read_0_6_1(name: str, channels: Sequence[Mapping[str, Any]], is_param: bool) -> TensorEncoding:
    bits, signed = int(channels[0]["bitwidth"]), _truthy(channels[0]["is_symmetric"])
    pairs = [_scale_offset_0_6_1(c, bits) for c in channels]
    offset = np.asarray([o for _, o in pairs], dtype=np.int64)
    return TensorEncoding(
        name,
        np.asarray([s for s, _ in pairs], dtype=np.float32),
        _zero_point_from_offset(offset, bits, signed),
        *_full_grid(bits, signed),
        bits=bits,
        signed=signed,
        is_param=is_param,
        axis=0 if len(channels) > 1 else None,
        axis_implied=len(channels) > 1,
    )


def _scale_offset_0_6_1(channel: Mapping[str, Any], bits: int) -> tuple[float, int]:
    """A channel's scale and offset, from ``scale``/``offset`` or else from ``min``/``max``."""
    if "scale" in channel and "offset" in channel:
        return float(channel["scale"]), int(channel["offset"])
    lo, hi = float(channel["min"]), float(channel["max"])
    scale = (hi - lo) / (2**bits - 1)
    return scale, round(lo / scale)


def _parse_dtype(dtype: str) -> tuple[int, bool]:
    match = re.fullmatch(r"(u?)int(\d+)", dtype)
    if match is None:
        raise ExportError(f"output_dtype '{dtype}' is not an integer type")
    return int(match.group(2)), match.group(1) == ""


def _read_2_0_0(entry: Mapping[str, Any]) -> TensorEncoding:
    bits, signed = _parse_dtype(entry["output_dtype"])
    scale = np.asarray(entry["y_scale"], dtype=np.float32)
    scale = scale.reshape(1) if scale.ndim == 0 else scale
    zp = np.asarray(entry.get("y_zero_point", 0), dtype=np.int64)
    block_size = entry.get("block_size")
    return TensorEncoding(
        entry["name"],
        scale,
        np.broadcast_to(zp, scale.shape).astype(np.int64),
        *_full_grid(bits, signed),
        bits=bits,
        signed=signed,
        is_param=None,
        axis=entry.get("axis"),
        block_size=None if block_size is None else int(block_size),
    )


_READERS: dict[str, Callable[[Mapping[str, Any]], Iterable[TensorEncoding]]] = {
    "1.0.0": _read_doc_1_0_0,
    "0.6.1": _read_doc_0_6_1,
    "2.0.0": _read_doc_2_0_0,
}


# ------------------------------------------------------------------------- fake quantization


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


def dumps_encodings(doc: Mapping[str, Any]) -> str:
    """The encodings document as text: one entry per line, so the file stays readable and
    diffable while large models are written by the C JSON encoder (``indent`` would switch
    to the slow pure-Python one)."""
    compact = json.JSONEncoder(separators=(", ", ": ")).encode

    def block(value: Any, depth: int) -> str:
        pad, inner = "  " * depth, "  " * (depth + 1)
        if (
            isinstance(value, dict)
            and depth == 0
            or (
                isinstance(value, dict)
                and value
                and all(isinstance(v, list) for v in value.values())
            )
        ):
            items = [f"{inner}{compact(k)}: {block(v, depth + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}" if items else "{}"
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            return "[\n" + ",\n".join(inner + compact(v) for v in value) + f"\n{pad}]"
        return compact(value)

    return block(dict(doc), 0) + "\n"
