"""The quantizer marker ``graphbuild::q(x, qid)``: one op that stands for any quantizer.

In the torch graph it is an identity custom op; in ONNX it is a node of domain ``graphbuild``
with an integer attribute ``qid``. It never reaches a written file: ``lower_markers`` removes it
(``onnx``) or turns it into QuantizeLinear/DequantizeLinear (``onnx_qdq``).
"""

from __future__ import annotations

import torch

MARKER_DOMAIN = "graphbuild"
MARKER_OP = "q"


@torch.library.custom_op("graphbuild::q", mutates_args=())
def q(x: torch.Tensor, qid: int) -> torch.Tensor:
    """Identity at run time; marks ``x`` as quantized by quantizer ``qid``."""
    return x.clone()


@q.register_fake
def _q_fake(x: torch.Tensor, qid: int) -> torch.Tensor:
    return torch.empty_like(x)


MARKER_TARGET = torch.ops.graphbuild.q.default


def is_marker(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is MARKER_TARGET


_onnx_translation = None


def onnx_translation_table() -> dict:
    """``custom_translation_table`` entry turning each marker into ``graphbuild.q``."""
    global _onnx_translation
    if _onnx_translation is None:
        import onnxscript
        from onnx import defs

        if not defs.has(MARKER_OP, MARKER_DOMAIN):
            types = [
                f"tensor({t})"
                for t in ("float", "float16", "bfloat16", "double", "int8", "uint8", "int16")
                + ("uint16", "int32", "int64")
            ]
            defs.register_schema(
                defs.OpSchema(
                    MARKER_OP,
                    MARKER_DOMAIN,
                    1,
                    inputs=[defs.OpSchema.FormalParameter("x", "T")],
                    outputs=[defs.OpSchema.FormalParameter("y", "T")],
                    type_constraints=[("T", types, "any numeric tensor")],
                    attributes=[defs.OpSchema.Attribute("qid", defs.OpSchema.AttrType.INT, "")],
                )
            )
        opset = onnxscript.values.Opset(MARKER_DOMAIN, 1)

        def marker_to_onnx(x, qid: int):
            return opset.q(x, qid=qid)

        _onnx_translation = {MARKER_TARGET: marker_to_onnx}
    return _onnx_translation
