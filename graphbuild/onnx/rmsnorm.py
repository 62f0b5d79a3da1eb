"""``aten.rms_norm`` as one ONNX op at every opset.

From opset 23 the exporter writes ONNX's own ``RMSNormalization``. Below it, it spells the
norm out (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul): QNN then runs that chain float,
and an encodings file has no single tensor for the norm. There it becomes
``SimplifiedLayerNormalization`` (onnxruntime's RMSNorm, in the default domain: what its
transformer optimizer fuses RMSNorm into, and what QNN's execution provider maps to its own
RmsNorm). The translation writes a ``graphbuild.RMSNorm`` node (a registered schema, so the
exporter types it); :func:`name_rms_norms` renames it after the export.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx_ir as ir
import torch

from graphbuild.quant.markers import MARKER_DOMAIN

__all__ = ["NATIVE_OPSET", "ONNXRUNTIME_OP", "name_rms_norms", "translation_table"]

NATIVE_OPSET = 23
"""The first opset with ``RMSNormalization``."""
ONNXRUNTIME_OP = "SimplifiedLayerNormalization"
_OP = "RMSNorm"
_FLOAT_EPS = float(torch.finfo(torch.float32).eps)  # torch's default for a float32 input


def translation_table(opset: int) -> dict[Any, Callable[..., Any]]:
    """The ``custom_translation_table`` entry for ``aten.rms_norm`` (empty from opset 23)."""
    if opset >= NATIVE_OPSET:
        return {}
    import onnxscript
    from onnx import defs

    if not defs.has(_OP, MARKER_DOMAIN):
        floats = [f"tensor({t})" for t in ("float", "float16", "bfloat16", "double")]
        attr = defs.OpSchema.Attribute
        defs.register_schema(
            defs.OpSchema(
                _OP,
                MARKER_DOMAIN,
                1,
                inputs=[
                    defs.OpSchema.FormalParameter("x", "T"),
                    defs.OpSchema.FormalParameter("scale", "T"),
                ],
                outputs=[defs.OpSchema.FormalParameter("y", "T")],
                type_constraints=[("T", floats, "float tensors")],
                attributes=[
                    attr("axis", defs.OpSchema.AttrType.INT, ""),
                    attr("epsilon", defs.OpSchema.AttrType.FLOAT, ""),
                ],
            )
        )
    ours = onnxscript.values.Opset(MARKER_DOMAIN, 1)
    onnx_ops = onnxscript.values.Opset("", opset)

    def rms_norm_to_onnx(x, normalized_shape, weight=None, eps=None):
        shape = [int(d) for d in normalized_shape]
        if weight is None:
            one = onnx_ops.CastLike(onnx_ops.Constant(value_float=1.0), x)
            weight = onnx_ops.Expand(one, onnx_ops.Constant(value_ints=shape))
        epsilon = _FLOAT_EPS if eps is None else float(eps)
        return ours.RMSNorm(x, weight, axis=-len(shape), epsilon=epsilon)

    return {torch.ops.aten.rms_norm.default: rms_norm_to_onnx}


def name_rms_norms(graph: ir.Graph) -> None:
    """Every ``graphbuild.RMSNorm`` becomes onnxruntime's ``SimplifiedLayerNormalization``."""
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.domain == MARKER_DOMAIN and node.op_type == _OP:
            node.domain, node.op_type = "", ONNXRUNTIME_OP
