"""LPBQ weights in the QDQ form Qualcomm's HTP takes them.

onnxruntime's QNN execution provider (``LowPowerBlockQuantizedMatMulFusion``, onnxruntime-qnn
2.7) fuses a MatMul whose weight is a blocked ``DequantizeLinear`` whose scale is itself a
``DequantizeLinear`` of the integer block scales::

    per_block_int_scale (uint8) --DQ(per_channel_float_scale, 0, axis=channel)--> scale
    weight (int4 constant) ------DQ(scale, 0, axis=block, block_size)-----------> MatMul

and gives QNN one LPBQ tensor. Checked on its HTP backend (v81): this form compiles with no
CPU fallback and no float op; the same weight as ``QuantizeLinear -> DequantizeLinear`` of a
float constant (aimet-onnx's form) leaves a copy of the scale ``DequantizeLinear`` on the CPU
(onnxruntime duplicates a DQ with two readers); a ``Transpose`` between the weight and the
MatMul (how the exporter writes a ``linear``) or a Gemm stops the fusion, and a plain blocked
weight runs as a float16 MatMul. So the weight is stored quantized, and a 2-D weight read
through a ``Transpose`` is stored transposed instead (:func:`foldable_transpose`).
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["MAX_BLOCK_SCALE_BITS", "PERM_KEY", "foldable_transpose", "lpbq_dequantize"]

MAX_BLOCK_SCALE_BITS = 7
"""The widest integer block scales the form holds: QNN's execution provider reads them as
uint8, and ``2^k`` itself is one of them."""

PERM_KEY = "graphbuild.perm"
"""Metadata of a reference bound transposed: the permutation, as comma-separated axes."""


def foldable_transpose(value: ir.Value) -> ir.Node | None:
    """The ``Transpose`` of a 2-D ``value`` that is its only reader, when that Transpose
    swaps the two axes (the exporter's ``linear``): the weight can be stored transposed."""
    if value.shape is None or len(value.shape) != 2 or value.is_graph_output():
        return None
    uses = list(value.uses())
    if len(uses) != 1:
        return None
    node = uses[0].node
    if node.domain not in ("", "ai.onnx") or node.op_type != "Transpose":
        return None
    perm = node.attributes.get("perm")
    if perm is not None and list(perm.as_ints()) != [1, 0]:
        return None
    return node


def lpbq_dequantize(
    quantized: ir.Value,
    block_int_scale: ir.Value,
    channel_scale: ir.Value,
    channel_zero_point: ir.Value,
    zero_point: ir.Value,
    *,
    channel_axis: int,
    block_axis: int,
    block_size: int,
    names: tuple[str, str, str, str],
    out_type: ir.TypeProtocol | None,
) -> tuple[list[ir.Node], ir.Value]:
    """The two ``DequantizeLinear`` nodes of the form above; ``names`` are the scale DQ's
    node and output and the weight DQ's node and output. Returns them and the weight."""
    scale_node, scale_name, weight_node, weight_name = names
    scale = ir.Value(name=scale_name, shape=block_int_scale.shape, type=channel_scale.type)
    scale_dq = ir.Node(
        "",
        "DequantizeLinear",
        [block_int_scale, channel_scale, channel_zero_point],
        attributes=[ir.AttrInt64("axis", channel_axis)],
        outputs=[scale],
        name=scale_node,
    )
    weight = ir.Value(name=weight_name, shape=quantized.shape, type=out_type)
    weight_dq = ir.Node(
        "",
        "DequantizeLinear",
        [quantized, scale, zero_point],
        attributes=[ir.AttrInt64("axis", block_axis), ir.AttrInt64("block_size", block_size)],
        outputs=[weight],
        name=weight_node,
    )
    return [scale_dq, weight_dq], weight
