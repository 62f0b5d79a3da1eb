"""The Q/DQ forms Qualcomm's HTP backend maps fully quantized, applied to a QDQ model.

A QDQ model says what is quantized; QNN's execution provider decides from its *form* which
ops the HTP runs quantized. Checked on onnxruntime-qnn's libQnnHtp (QNN 2.40, v73 to v81),
five forms differ from what the lowering writes by itself:

1. **Activations on the unsigned grid.** An activation in a signed container (int16 or int8,
   the AIMET form of a symmetric activation: keys, values, sin/cos, tanh) makes QNN refuse the
   op producing it quantized (a linear's per-channel weight DequantizeLinear is then put on
   the CPU). The same grid in the unsigned container (uint16 with zero point 32768) is taken:
   ``q_u = q_s + 2^(b-1)``, the zero point likewise, the values identical.
2. **A 16-bit second MatMul input is signed.** With a uint16 second input the HTP's 16x16
   MatMul keeps about 8 bits of it (190 output steps off ORT CPU on a 16x8x16 product); with
   int16 and zero point 0 it agrees (3 steps). Where that input is symmetric it is requantized
   to int16 just before the MatMul (a QNN Convert; the grid is the same, so the values are).
   An asymmetric one has no exact int16 form (QNN refuses int16 with a non-zero zero point).
   ``matmul_int16_requantize=False`` (the qnn option of that name) leaves the requantization
   out: AIMET's quantization sim has no quantizer for it and imports the model strictly only
   without it; the HTP's product is then as far off as above.
3. **Data movement keeps the consumer quantized.** A Reshape, Transpose, Split, Gather...
   between a DequantizeLinear and its reader leaves that reader float on QNN. Each float
   output of such an op gets QuantizeLinear -> DequantizeLinear with its input's encoding
   (the same scale and zero point initializers): exact, since the op preserves the grid.
4. **LayerNormalization's bias as int32.** A float bias makes QNN run the LayerNorm float
   (and its float LayerNorm feeding a quantized Gemm gives wrong rows); the bias becomes
   DequantizeLinear of int32 values with scale ``input scale x gamma scale``, zero point 0
   (:mod:`.qdq_bias`).

5. **A linear's bias Add before a Relu.** AIMET's ``Add -> Relu`` supergroup leaves the Add's
   output unquantized. Where the Add reads dequantized inputs alone (a residual sum),
   onnxruntime drops a Relu before a QuantizeLinear whose grid starts at 0 and QNN runs a
   quantized Add; where it reads a float intermediate (a linear's MatMul output on 3-D
   activations) the linear would run float. That Add's output gets Q -> DQ with the Relu
   output's encoding: exact, since rounding onto a grid that holds 0 commutes with the Relu.

The encodings file needs none of this: QNN's converter derives the same forms from it, and
the grids, hence the values, are the same (docs/design.md's offset is ``-z`` unsigned,
``-2^(b-1) - z`` signed: the same number for both containers).

The pass runs on the lowered, still data-less model (scales and zero points are references
that ``bind`` fills; new ones record what to compute in their metadata) and equally on a
model whose Q/DQ parameters hold data (a QDQ model rebuilt from an encodings file).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import onnx
import onnx_ir as ir

from graphbuild.onnx.lower import (
    QID_KEY,
)
from graphbuild.onnx.naming import Namer
from graphbuild.onnx.passes import FLOAT_TYPES
from graphbuild.quant.quantmap import QuantMap
from graphbuild.targets.qnn.rewrites.qdq_bias import int32_layernorm_biases
from graphbuild.targets.qnn.rewrites.qdq_encoding import _data, _encoding
from graphbuild.targets.qnn.rules.config import GRID_PRESERVING

__all__ = ["MOVEMENT_OPS", "apply_htp_forms"]

#: Ops whose outputs lie on their input's grid and that QNN runs quantized only between
#: Q/DQ: AIMET's grid-preserving ops, less those with no float data output.
MOVEMENT_OPS = GRID_PRESERVING - {"NonZero", "SplitToSequence", "MaxRoiPool", "Col2Im"}

_SIGNED_TO_UNSIGNED = {ir.DataType.INT8: ir.DataType.UINT8, ir.DataType.INT16: ir.DataType.UINT16}


def apply_htp_forms(
    model: onnx.ModelProto,
    qmap: QuantMap | None = None,
    *,
    movement: Collection[str] = MOVEMENT_OPS,
    matmul_int16_requantize: bool = True,
) -> onnx.ModelProto:
    """``model`` (a QDQ model) in the forms the HTP runs fully quantized (see the module).
    ``qmap`` says which data-less quantizers are parameters and which are symmetric; without
    it only quantizers whose zero points hold data are judged. ``matmul_int16_requantize``
    adds form 2; without it every activation is on the unsigned grid."""
    ir_model = ir.serde.deserialize_model(model)
    _Forms(ir_model.graph, qmap).run(movement, matmul_int16_requantize)
    return ir.serde.serialize_model(ir_model)


class _Forms:
    def __init__(self, graph: ir.Graph, qmap: QuantMap | None) -> None:
        self.graph, self.qmap = graph, qmap
        self.namer = Namer(graph)
        self.signed_zero_points: dict[str, ir.Value] = {}  # zero point -> its int16 twin

    def run(self, movement: Collection[str], matmul_int16_requantize: bool) -> None:
        self._requantize_movement(movement)
        self._quantize_before_relu()
        if matmul_int16_requantize:
            self._signed_matmul_inputs()
        self._unsigned_activations(keep_matmul_signed=matmul_int16_requantize)
        int32_layernorm_biases(self.graph, self.namer)

    # -- what a value is --------------------------------------------------------------------

    def _spec_of(self, zero_point: ir.Value):
        meta = zero_point.const_value.metadata_props if zero_point.const_value else {}
        if self.qmap is None or QID_KEY not in meta:
            return None
        qid = int(meta[QID_KEY])
        return self.qmap[qid] if 0 <= qid < len(self.qmap) else None

    def _symmetric_signed(self, zero_point: ir.Value | None) -> bool:
        """A zero point of 0 in a signed container (from its data, else the quant map)."""
        if zero_point is None or zero_point.dtype not in _SIGNED_TO_UNSIGNED:
            return False
        data = _data(zero_point)
        if data is not None:
            return not np.any(data)
        spec = self._spec_of(zero_point)
        return spec is not None and spec.signed and bool(spec.symmetric)

    def _is_parameter(self, zero_point: ir.Value, quantize: ir.Node | None) -> bool:
        spec = self._spec_of(zero_point)
        if spec is not None:
            return spec.param is not None
        x = quantize.inputs[0] if quantize is not None else None
        return quantize is None or (x is not None and x.is_initializer())

    # -- 3. data movement -------------------------------------------------------------------

    def _requantize_movement(self, movement: Collection[str]) -> None:
        for node in list(self.graph):
            if node.domain != "" or node.op_type not in movement or not node.inputs:
                continue
            enc = _encoding(node.inputs[0])
            if enc is None or enc.axis is not None or not _grid_kept(node):
                continue
            for i, out in enumerate(node.outputs):
                # an untyped output is the data input's type (TopK's second one: indices)
                floating = out.dtype in FLOAT_TYPES if out.dtype is not None else i == 0
                if floating and _has_float_readers(out):
                    self._quantize_after(node, out, enc.scale, enc.zero_point)

    def _quantize_after(
        self, node: ir.Node, out: ir.Value, scale: ir.Value, zero: ir.Value | None
    ) -> None:
        """``out``'s float readers read it through Q -> DQ (a QuantizeLinear already reading
        it stays). A graph output moves onto the DQ and keeps its name, unless a quantizer
        annotates ``out`` (its name is then the encoding's)."""
        name = out.name or "t"
        readers = [u for u in out.uses() if u.node.op_type != "QuantizeLinear"]
        annotated = len(readers) < len(out.uses())
        if not readers and (annotated or not out.is_graph_output()):
            return
        q, dq = self._pair(out, scale, zero, name)
        dq_out = dq.outputs[0]
        for use in readers:
            use.node.replace_input_with(use.idx, dq_out)
        if out.is_graph_output() and not annotated:
            outputs = self.graph.outputs
            outputs[outputs.index(out)] = dq_out
            out.name = self.namer.fresh(f"{name}_moved")
            dq_out.name = name
        self.graph.insert_after(node, [q, dq])

    def _pair(
        self, x: ir.Value, scale: ir.Value, zero: ir.Value | None, base: str
    ) -> tuple[ir.Node, ir.Node]:
        inputs = [x, scale] + ([zero] if zero is not None else [])
        qtype = zero.type if zero is not None else ir.TensorType(ir.DataType.UINT8)
        q_out = ir.Value(name=self.namer.fresh(f"{base}_requantized"), shape=x.shape, type=qtype)
        q = ir.Node(
            "", "QuantizeLinear", inputs, outputs=[q_out], name=self.namer.fresh(f"{base}_Q")
        )
        dq_out = ir.Value(name=self.namer.fresh(f"{base}_dq"), shape=x.shape, type=x.type)
        dq = ir.Node(
            "",
            "DequantizeLinear",
            [q_out, scale] + ([zero] if zero is not None else []),
            outputs=[dq_out],
            name=self.namer.fresh(f"{base}_DQ"),
        )
        return q, dq

    # -- 5. an Add in a supergroup with its Relu --------------------------------------------

    def _quantize_before_relu(self) -> None:
        for node in list(self.graph):
            if node.op_type != "Relu" or node.domain != "" or not node.inputs:
                continue
            x = node.inputs[0]
            add = x.producer() if x is not None else None
            if add is None or add.op_type != "Add" or add.domain != "" or len(x.uses()) != 1:
                continue
            if all(_encoding(i) is not None for i in add.inputs):
                continue  # DQ -> Add -> Relu -> Q is a QDQ Add once ORT drops the Relu
            if x.dtype not in FLOAT_TYPES:
                continue
            quantize = next(
                (u.node for u in node.outputs[0].uses() if u.node.op_type == "QuantizeLinear"),
                None,
            )
            if quantize is None or len(quantize.inputs) < 2:
                continue
            scale = quantize.inputs[1]
            if scale is None or scale.shape is None or scale.shape.rank() != 0:
                continue
            zero = quantize.inputs[2] if len(quantize.inputs) > 2 else None
            self._quantize_after(add, x, scale, zero)

    # -- 2. the second input of a MatMul ----------------------------------------------------

    def _signed_matmul_inputs(self) -> None:
        for node in list(self.graph):
            if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) < 2:
                continue
            b = node.inputs[1]
            enc = _encoding(b)
            if enc is None or enc.axis is not None or enc.zero_point is None:
                continue
            if _feeds_second_matmul_inputs(enc.zero_point):
                continue  # already signed for its MatMuls
            dq = b.producer()
            quantize = dq.inputs[0].producer() if dq is not None and dq.inputs[0] else None
            zero = enc.zero_point
            if zero.dtype != ir.DataType.INT16 or self._is_parameter(zero, quantize):
                continue
            if not self._symmetric_signed(zero):
                continue
            q, new_dq = self._pair(b, enc.scale, self._signed_twin(zero), b.name or "t")
            self.graph.insert_before(node, [q, new_dq])
            node.replace_input_with(1, new_dq.outputs[0])

    def _signed_twin(self, zero: ir.Value) -> ir.Value:
        """An int16 copy of ``zero`` that stays signed when ``zero`` moves to uint16."""
        key = zero.name or ""
        if key not in self.signed_zero_points:
            twin = ir.Value(
                name=self.namer.fresh(f"{key}_signed"), shape=zero.shape, type=zero.type
            )
            twin.const_value = _copy_tensor(zero.const_value, twin.name or "")
            self.graph.register_initializer(twin)
            self.signed_zero_points[key] = twin
        return self.signed_zero_points[key]

    # -- 1. unsigned activations ------------------------------------------------------------

    def _unsigned_activations(self, *, keep_matmul_signed: bool) -> None:
        """Signed activation zero points to the unsigned container; with
        ``keep_matmul_signed`` not those read by second MatMul inputs alone (form 2's)."""
        done: set[str] = set()
        for node in list(self.graph):
            if node.op_type != "QuantizeLinear" or node.domain != "" or len(node.inputs) < 3:
                continue
            zero = node.inputs[2]
            if zero is None or zero.name in done or zero.dtype not in _SIGNED_TO_UNSIGNED:
                continue
            if not zero.is_initializer() or self._is_parameter(zero, node):
                continue
            int16 = zero.dtype == ir.DataType.INT16
            if keep_matmul_signed and int16 and _feeds_second_matmul_inputs(zero):
                continue
            done.add(zero.name or "")
            self._to_unsigned(zero)

    def _to_unsigned(self, zero: ir.Value) -> None:
        signed = zero.dtype
        unsigned = _SIGNED_TO_UNSIGNED[signed]
        half = 2 ** (signed.bitwidth - 1)
        data = _data(zero)
        if data is not None:
            shifted = (data.astype(np.int64) + half).astype(unsigned.numpy())
            zero.const_value = ir.Tensor(shifted, name=zero.name)
        else:
            tensor = zero.const_value
            zero.const_value = ir.ExternalTensor(
                location=tensor.location,
                offset=0,
                length=tensor.length,
                dtype=unsigned,
                shape=tensor.shape,
                name=zero.name,
                metadata_props=dict(tensor.metadata_props),
            )
        zero.type = ir.TensorType(unsigned)
        for use in zero.uses():
            if use.node.op_type == "QuantizeLinear":
                use.node.outputs[0].type = ir.TensorType(unsigned)


def _copy_tensor(tensor: ir.TensorProtocol | None, name: str) -> ir.TensorProtocol | None:
    if isinstance(tensor, ir.ExternalTensor):
        return ir.ExternalTensor(
            location=tensor.location,
            offset=0,
            length=tensor.length,
            dtype=tensor.dtype,
            shape=tensor.shape,
            name=name,
            metadata_props=dict(tensor.metadata_props),
        )
    if tensor is None:
        return None
    return ir.Tensor(tensor.numpy().copy(), name=name)


def _feeds_second_matmul_inputs(zero: ir.Value) -> bool:
    """Whether every Q/DQ pair using ``zero`` feeds only second inputs of MatMuls (the signed
    requantization of form 2, kept as it is)."""
    pairs = [u.node for u in zero.uses() if u.node.op_type == "DequantizeLinear"]
    readers = [u for dq in pairs for u in dq.outputs[0].uses()]
    return bool(readers) and all(
        u.node.op_type == "MatMul" and u.idx == 1 and u.node.domain == "" for u in readers
    )


def _has_float_readers(value: ir.Value) -> bool:
    """Whether ``value`` is read as a float: by an op other than QuantizeLinear, or as a
    graph output."""
    return value.is_graph_output() or any(u.node.op_type != "QuantizeLinear" for u in value.uses())


def _grid_kept(node: ir.Node) -> bool:
    """Whether ``node``'s output lies on its input's grid: a constant Pad only pads zeros."""
    if node.op_type != "Pad":
        return True
    mode = node.attributes.get("mode")
    if mode is not None and mode.as_string() != "constant":
        return True
    value = node.inputs[2] if len(node.inputs) > 2 else None
    if value is None:
        return True
    data = _data(value) if value.is_initializer() else _constant_node_data(value)
    return data is not None and not np.any(data)


def _constant_node_data(value: ir.Value) -> np.ndarray | None:
    node = value.producer()
    if node is None or node.op_type != "Constant":
        return None
    attr = node.attributes.get("value")
    return attr.as_tensor().numpy() if attr is not None else None
