"""Known defects of QNN's HTP backend an export can run into, as patterns over the exported
model: the coverage report names every tensor that matches one (``htp_defects``), with what
goes wrong and the test that reproduces it. A defect graphbuild can write around is rewritten
away (:mod:`~graphbuild.targets.qnn.rewrites.patterns`); what is left here is what an export
may still hit.

**A 16-bit Tanh over 16 rows.** Measured on onnxruntime-qnn 2.7.0 (QNN SDK 2.51), every arch
from v68 to v81: a Tanh with 16-bit activations on a ``[1, ..., 1, 16, C]`` tensor (C from 8 to
768) returns, from its third row on, rows of other positions (row 2 holds row 4's values),
60,000 of 65,535 output steps off onnxruntime's CPU. The producer does not decide it: it hits
after LayerNorm -> Mul (the minimal reproduction), RMSNorm -> Mul, a linear or MatMul, an Add
or Sub of a constant, GPT-2's GELU-with-tanh chain, and not after a Mul of a graph input or
directly on one; whether a graph hits it depends on more of the graph than the Tanh's
neighbours, so every such Tanh computed from another op is named. 15, 17, 24, 32 or more
rows, two batches of 16 rows, ``[1, 4, 16, 8]``, 8-bit activations, and Sigmoid, Exp, GELU,
ELU, Sin, Softmax or HardSigmoid in the Tanh's place all compute right. GELU with tanh is
written as ``x * sigmoid(2z)`` (:mod:`~graphbuild.targets.qnn.rewrites.patterns`) and so
never reaches it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import onnx
import onnx_ir as ir

from graphbuild.targets.qnn.rules.onnx_view import source_of

__all__ = ["TANH_16_ROWS", "HtpDefect", "defect_candidates", "defects_at"]


@dataclass(frozen=True)
class HtpDefect:
    """A known defect: its short name (for the summary line), what goes wrong where, and
    the test that reproduces it (it fails the day QNN computes it right)."""

    name: str
    reason: str
    reproduction: str


TANH_16_ROWS = HtpDefect(
    name="16-bit Tanh over 16 rows",
    reason=(
        "QNN HTP defect (onnxruntime-qnn 2.7.0, QNN SDK 2.51, v68-v81): a 16-bit Tanh over "
        "exactly 16 rows ([1, ..., 1, 16, C]) returns rows of other positions, ~60,000 output "
        "steps off, in graphs such as LayerNorm -> Mul, a linear or an Add before it; "
        "check_htp shows whether this graph hits it (other row counts, a batch of 2 and 8-bit "
        "activations compute right)"
    ),
    reproduction="tests/test_htp_forms.py::test_tanh_after_layernorm_and_mul_agrees_with_the_cpu "
    "(layernorm_mul_then('Tanh'): x -> LayerNorm -> Mul -> Tanh on [1, 16, 128], all uint16)",
)

_QDQ = ("QuantizeLinear", "DequantizeLinear")


def defect_candidates(model: onnx.ModelProto) -> list[dict[str, Any]]:
    """The tensors of ``model`` (a lowered export, either format) in a known defect's
    pattern whatever their bit-widths: the graph's part, which :func:`defects_at`
    completes with the bit-widths the export gives them."""
    if not any(n.op_type == "Tanh" and n.domain == "" for n in model.graph.node):
        return []  # the one pattern needs a Tanh: no shapes to infer, no graph to build
    typed = _with_shapes(model)
    graph = ir.serde.deserialize_model(typed).graph
    inputs = {v.name for v in graph.inputs}
    found = []
    for node in graph:
        if node.op_type != "Tanh" or node.domain != "" or not node.inputs:
            continue
        out = node.outputs[0]
        if not _sixteen_rows(out.shape):
            continue
        if _behind_qdq(node.inputs[0]) in inputs:
            continue  # a Tanh of a graph input computes right
        found.append(_entry(out, node, TANH_16_ROWS))
    return sorted(found, key=lambda e: e["tensor"])


def defects_at(candidates: list[dict[str, Any]], bits: Mapping[str, int]) -> list[dict[str, Any]]:
    """The candidates whose tensor the export quantizes as the defect needs (16 bits)."""
    return [c for c in candidates if bits.get(c["tensor"]) == 16]


def _entry(value: ir.Value, node: ir.Node, defect: HtpDefect) -> dict[str, Any]:
    return {
        "tensor": value.name or "",
        "op": node.op_type,
        "source": source_of(node),
        "shape": [int(d) for d in value.shape] if value.shape is not None else None,
        "defect": defect.name,
        "reason": defect.reason,
        "reproduction": defect.reproduction,
    }


def _sixteen_rows(shape: ir.Shape | None) -> bool:
    """``[1, ..., 1, 16, C]`` with every dimension known."""
    if shape is None or len(shape) < 2 or not all(isinstance(d, int) for d in shape):
        return False
    dims = [int(d) for d in shape]
    return dims[-2] == 16 and all(d == 1 for d in dims[:-2])


def _behind_qdq(value: ir.Value | None) -> str | None:
    """The name of the tensor ``value`` quantizes (itself when no Q/DQ produces it)."""
    while value is not None:
        producer = value.producer()
        if producer is None or producer.op_type not in _QDQ or producer.domain != "":
            return value.name
        value = producer.inputs[0]
    return None


def _with_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its values' shapes inferred (data-less initializers: dims only)."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=False)
    except (onnx.shape_inference.InferenceError, ValueError):
        return model
