"""Int32 bias encodings, found in the ONNX graph and derived as AIMET derives them.

aimet-onnx 2.42 (``QuantizationSimModel._concretize_int32_bias_quantizers``, on by default for
2.0.0 exports) gives the bias of a Conv, ConvTranspose, Gemm, or MatMul followed by an Add of a
rank-1 initializer an int32 encoding with zero point 0 and the *analytic* scale
``input scale x weight scale`` (float32), per channel along axis 0 when the weight is per
channel along the op's output channel, per tensor when the weight is per tensor, and for a
blocked weight the largest product over each channel's blocks. Only biases whose input and
weight are both quantized get one; the input's quantizer may sit behind grid-preserving ops
(Reshape, Flatten, Transpose, ...: the list of ``aimet_onnx.common.onnx._utils.
_is_grid_preserving_op``) and float-to-float casts, the weight's behind Transposes. Where AIMET
would fall back to a statistical scale (a weight quantized along another axis, a bias of
another length), no bias encoding is written: the bias stays float, as without the option.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from graphbuild.onnx.lower import QID_KEY
from graphbuild.quant.quantmap import QuantSpec
from graphbuild.targets.qnn.encodings.grid import weight_axes
from graphbuild.targets.qnn.rules.config import GRID_PRESERVING

__all__ = ["BiasScale", "find_int32_biases"]

_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})


@dataclass(frozen=True, eq=False)
class BiasScale:
    """One bias to encode: its initializer, the op reading it, the weight quantizer it follows,
    and its float32 scales (one, or one per output channel)."""

    name: str
    node: str
    weight_qid: int
    scale: np.ndarray
    per_tensor: bool


def find_int32_biases(
    model: onnx.ModelProto,
    quantizers: Mapping[int, tuple[QuantSpec, np.ndarray]],
    names: Mapping[int, str],
) -> list[BiasScale]:
    """Every bias of ``model`` that gets an int32 encoding, in graph order.

    ``quantizers`` maps each qid to its spec and float32 scales, ``names`` to the tensor it
    annotates. In a Q/DQ model a DequantizeLinear output counts as quantized by the quantizer
    its scale initializer records (``graphbuild.qid`` metadata, see ``onnx.lower``).
    """
    graph = _Graph(model, quantizers, names)
    return [b for node in model.graph.node if (b := graph.bias_of(node)) is not None]


class _Graph:
    """The lookups bias detection needs, built once per model."""

    def __init__(
        self,
        model: onnx.ModelProto,
        quantizers: Mapping[int, tuple[QuantSpec, np.ndarray]],
        names: Mapping[int, str],
    ):
        graph = model.graph
        self.quantizers, self.names = quantizers, names
        self.inits = {t.name: t for t in graph.initializer}
        self.producer = {out: n for n in graph.node for out in n.output if out}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.readers.setdefault(name, []).append(node)
        self.outputs = {o.name for o in graph.output}
        self.dtypes = {
            v.name: v.type.tensor_type.elem_type
            for v in (*graph.input, *graph.value_info, *graph.output)
        }
        self.quantized: dict[str, int] = {}
        for qid, name in sorted(names.items()):
            self.quantized.setdefault(name, qid)
        for node in graph.node:
            qid = self._dq_qid(node)
            if qid is not None:
                self.quantized.setdefault(node.output[0], qid)

    def _dq_qid(self, node: onnx.NodeProto) -> int | None:
        if node.op_type != "DequantizeLinear" or len(node.input) < 2:
            return None
        scale = self.inits.get(node.input[1])
        meta = {p.key: p.value for p in scale.metadata_props} if scale is not None else {}
        return int(meta[QID_KEY]) if QID_KEY in meta else None

    def bias_of(self, node: onnx.NodeProto) -> BiasScale | None:
        found = self._bias_input(node)
        if found is None:
            return None
        bias, channels = found
        x_qid = self._effective_quantizer(node.input[0])
        weight = self._weight(node)
        if x_qid is None or weight is None:
            return None
        _, x_scale = self.quantizers[x_qid]
        if x_scale.size != 1:
            return None
        w_qid, axis_in_op, rank = weight
        w_spec, w_scale = self.quantizers[w_qid]
        product = np.float32(x_scale.reshape(-1)[0]) * w_scale.astype(np.float32)
        if w_spec.axis is None:
            return BiasScale(bias, node.name, w_qid, product.reshape(1), per_tensor=True)
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        expected = weight_axes(node.op_type, rank, bool(trans_b))[0]
        if w_spec.block_size is None:
            scale = product.reshape(-1)
            if axis_in_op(w_spec.axis) != expected or scale.size != channels:
                return None
        else:
            if product.ndim != 2 or rank != 2:
                return None
            channel = 1 - w_spec.axis
            if axis_in_op(channel) != expected or product.shape[channel] != channels:
                return None
            scale = product.max(axis=w_spec.axis)
        return BiasScale(bias, node.name, w_qid, scale, per_tensor=False)

    def _bias_input(self, node: onnx.NodeProto) -> tuple[str, int] | None:
        """The bias initializer ``node`` adds and its length, if it has one AIMET encodes."""
        if node.op_type in ("Conv", "ConvTranspose", "Gemm"):
            bias = node.input[2] if len(node.input) > 2 else ""
            readers = (node,)
        elif node.op_type == "MatMul":
            readers = tuple(self.readers.get(node.output[0], ()))
            if len(readers) != 1 or readers[0].op_type != "Add" or node.output[0] in self.outputs:
                return None
            (add,) = readers
            if list(add.input).count(node.output[0]) != 1:
                return None
            bias = next(i for i in add.input if i != node.output[0])
        else:
            return None
        init = self.inits.get(bias) if bias else None
        if init is None or len(init.dims) != 1 or init.data_type not in _FLOATS:
            return None
        if bias in self.quantized or bias in self.outputs:
            return None  # already encoded: AIMET honours an existing bias encoding
        if [id(n) for n in self.readers.get(bias, ())] != [id(n) for n in readers]:
            return None  # shared bias: no single analytic scale
        return bias, int(init.dims[0])

    def _effective_quantizer(self, tensor: str) -> int | None:
        """The quantizer whose grid ``tensor`` is on: its own, or the nearest upstream one
        reached through grid-preserving ops and float-to-float casts only."""
        seen: set[str] = set()
        while tensor not in self.quantized:
            node = self.producer.get(tensor)
            if node is None or tensor in seen or not node.input:
                return None
            seen.add(tensor)
            if not (node.op_type in GRID_PRESERVING and node.domain in ("", "ai.onnx")) and not (
                self._is_float_cast(node)
            ):
                return None
            tensor = node.input[0]
        return self.quantized[tensor]

    def _is_float_cast(self, node: onnx.NodeProto) -> bool:
        if node.op_type != "Cast":
            return False
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        return to in _FLOATS and self.dtypes.get(node.input[0], onnx.TensorProto.FLOAT) in _FLOATS

    def _weight(self, node: onnx.NodeProto) -> tuple[int, Callable[[int], int], int] | None:
        """(qid, where an axis of the quantized weight lands in ``node``'s weight input, rank)
        for a weight parameter reached through Transposes only."""
        if len(node.input) < 2:
            return None
        tensor, perms = node.input[1], []
        while tensor not in self.quantized:
            producer = self.producer.get(tensor)
            if producer is None or producer.op_type != "Transpose":
                return None
            perms.append(next((list(a.ints) for a in producer.attribute if a.name == "perm"), None))
            tensor = producer.input[0]
        qid = self.quantized[tensor]
        spec, _ = self.quantizers[qid]
        init = self.inits.get(self.names.get(qid, ""))
        if spec.param is None or init is None:
            return None
        rank = len(init.dims)

        def axis_in_op(axis: int) -> int:
            position = axis % rank
            for perm in reversed(perms):  # innermost Transpose first
                order = perm if perm is not None else list(reversed(range(rank)))
                position = order.index(position)
            return position

        return qid, axis_in_op, rank
