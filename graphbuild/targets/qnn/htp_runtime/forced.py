"""HTP against onnxruntime's CPU op by op: every quantized activation forced to the CPU's value.

End to end, two exact implementations of a quantized model differ by a few output steps with
16-bit activations: where one op lands a value a step away (fixed-point requantization on the
HTP, float on the CPU), the step travels on through every later layer. So, as the numerics
check does against torch, the QDQ model is cut at each quantized activation: the
``DequantizeLinear`` that ends a ``QuantizeLinear -> DequantizeLinear`` pair becomes a graph
output (what the HTP computes for it) and its readers get a fresh ``Q -> DQ`` pair fed with the
CPU's value. Each op then computes on the HTP from exactly the CPU's quantized inputs, and each
tensor's difference counts that op's own rounding alone. The islands stay QDQ node units, so
QNN builds them quantized as it does the whole model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from graphbuild.targets.qnn.htp_runtime.backend import HtpTarget
from graphbuild.targets.qnn.htp_runtime.compare import grid_steps, run_cpu, scalar_constants
from graphbuild.targets.qnn.htp_runtime.errors import HtpRefusedError
from graphbuild.targets.qnn.htp_runtime.session import open_session

__all__ = ["ForcedComparison", "forced_comparison"]

_HTP = "__htp"
_IN = "__cpu"


@dataclass(frozen=True)
class ForcedComparison:
    """Per quantized activation, |HTP - CPU| in its steps with the op's inputs forced to the
    CPU's values: how many were forced, the largest difference and where; per graph output,
    the same. ``error`` says why it could not run (QNN refused the cut model)."""

    tensors: int
    max_steps: float
    worst: str | None
    outputs: dict[str, float | None] = field(default_factory=dict)
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "max_error_steps": self.max_steps,
            "worst": self.worst,
            "outputs": dict(self.outputs),
            "error": self.error,
        }


@dataclass(frozen=True)
class _Cut:
    quantize: onnx.NodeProto
    dequantize: onnx.NodeProto
    step: float

    @property
    def tensor(self) -> str:
        return self.dequantize.output[0]


def _cuts(model: onnx.ModelProto) -> list[_Cut]:
    """The per-tensor Q -> DQ pairs on activations an op computes (not weights, graph inputs
    or graph outputs)."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    constants = {i.name for i in graph.initializer}
    constants |= {n.output[0] for n in graph.node if n.op_type == "Constant"}
    outputs = {o.name for o in graph.output}
    scalars = scalar_constants(model)
    cuts = []
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or node.output[0] in outputs:
            continue
        q = producer.get(node.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            continue
        source = producer.get(q.input[0])
        if source is None or q.input[0] in constants or source.op_type == "Constant":
            continue
        scale = scalars.get(node.input[1])
        if scale is None or scale.size != 1:
            continue
        cuts.append(_Cut(q, node, float(scale.reshape(-1)[0])))
    return cuts


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _cut_model(model: onnx.ModelProto, cuts: list[_Cut], shapes: Mapping[str, tuple]) -> bytes:
    """``model`` with each cut tensor computed into ``<t>__htp`` and read from ``<t>__cpu``."""
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    graph = cut.graph
    by_name = {n.name: n for n in graph.node if n.name}
    extra = []
    for c in cuts:
        t = c.tensor
        dq = by_name.get(c.dequantize.name) or next(n for n in graph.node if n.output[:1] == [t])
        dq.output[0] = t + _HTP
        graph.output.append(helper.make_tensor_value_info(t + _HTP, onnx.TensorProto.FLOAT, None))
        graph.input.append(
            helper.make_tensor_value_info(t + _IN, onnx.TensorProto.FLOAT, list(shapes[t]))
        )
        q_in, dq_in = list(c.quantize.input), list(c.dequantize.input)
        extra.append(
            helper.make_node(
                "QuantizeLinear",
                [t + _IN, *q_in[1:]],
                [t + _IN + "_q"],
                name=t + _IN + "_q",
                **_attrs(c.quantize),
            )
        )
        extra.append(
            helper.make_node(
                "DequantizeLinear",
                [t + _IN + "_q", *dq_in[1:]],
                [t],
                name=t + _IN + "_dq",
                **_attrs(c.dequantize),
            )
        )
    graph.node.extend(extra)
    return cut.SerializeToString()


def forced_comparison(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    target: HtpTarget,
    steps: Mapping[str, float | None],
) -> ForcedComparison:
    """Cut ``model`` (a QDQ model with its weights) at every quantized activation, feed each
    cut the CPU's value and compare what the HTP computes, tensor by tensor and per output
    (``steps``: each output's quantization step)."""
    cuts = _cuts(model)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for c in cuts:
        probe.graph.output.append(
            helper.make_tensor_value_info(c.tensor, onnx.TensorProto.FLOAT, None)
        )
    cpu = run_cpu(probe.SerializeToString(), feeds)
    shapes = {c.tensor: tuple(np.shape(cpu[c.tensor])) for c in cuts}
    try:
        session = open_session(_cut_model(model, cuts, shapes), target)
    except HtpRefusedError as refused:
        return ForcedComparison(len(cuts), 0.0, None, error=refused.onnxruntime_message)
    forced_feeds = dict(feeds)
    forced_feeds.update({c.tensor + _IN: cpu[c.tensor] for c in cuts})
    wanted = set(session.input_names)
    got = session.run({k: v for k, v in forced_feeds.items() if k in wanted})
    worst, worst_name = 0.0, None
    for c in cuts:
        diff = grid_steps(got[c.tensor + _HTP], cpu[c.tensor], c.step)
        if worst_name is None or diff > worst:
            worst, worst_name = diff, c.tensor
    outputs = {}
    for o in model.graph.output:
        step = steps.get(o.name)
        outputs[o.name] = grid_steps(got[o.name], cpu[o.name], step) if step else None
    return ForcedComparison(len(cuts), worst, worst_name, outputs)
