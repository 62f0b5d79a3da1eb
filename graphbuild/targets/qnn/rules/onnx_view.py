"""The HTP rules' view of an ONNX model (:class:`~graphbuild.targets.qnn.rules.plan.GraphView`).

The view is the float model QNN would be given: a QDQ model's QuantizeLinear ->
DequantizeLinear pairs are looked through (the dequantized tensor is the one the pair
quantizes), so both formats of an export have the same view and the same tensor names as the
encodings use.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import onnx
import onnx_ir as ir

from graphbuild.onnx.passes import FLOAT_TYPES
from graphbuild.targets.qnn.rules.plan import GraphView, OpNode

__all__ = ["onnx_view", "source_of"]

_FX_NODE = "pkg.torch.onnx.fx_node"
#: ops the rules treat as another: onnxruntime's RMSNorm is ONNX's RMSNormalization
_SAME_RULES = {"SimplifiedLayerNormalization": "RMSNormalization"}
_CLASSES = "pkg.torch.onnx.class_hierarchy"
_TARGET = re.compile(r"target=(?:torch\.ops\.)?([\w.]+)")
_FX_NAME = re.compile(r"%(\S+) :")


def source_of(node: ir.Node) -> str:
    """Where an exported ONNX node came from: ``aten.lstm.input in torch.nn.modules.rnn.LSTM``
    (from the exporter's node metadata; empty when it left none)."""
    fx = node.metadata_props.get(_FX_NODE, "")
    match = _TARGET.search(fx)
    target = match.group(1) if match else ""
    classes = re.findall(r"'([^']+)'", node.metadata_props.get(_CLASSES, ""))
    modules = [c for c in classes if not c.startswith(("aten.", "torch.ops.", "<"))]
    where = modules[-1] if modules else ""
    if target and where:
        return f"{target} in {where}"
    return target or where


def _origin(node: ir.Node) -> str:
    """The name of the torch node an exported ONNX node lowers (empty when unknown)."""
    match = _FX_NAME.match(node.metadata_props.get(_FX_NODE, ""))
    return match.group(1) if match else ""


def onnx_view(model: onnx.ModelProto | ir.Model) -> GraphView:
    """The view of ``model``'s main graph (subgraphs are not quantized on HTP)."""
    proto = model if isinstance(model, onnx.ModelProto) else ir.serde.serialize_model(model)
    m = ir.serde.deserialize_model(_with_types(proto))
    graph = m.graph
    alias = _qdq_aliases(graph)

    def name(v: ir.Value | None) -> str | None:
        if v is None:
            return None
        n = v.name or ""
        while n in alias:  # a folded weight's Q/DQ -> the folded chain -> the weight
            n = alias[n]
        return n

    floats: set[str] = set()
    constants: set[str] = set()
    transposed: dict[str, str] = {}
    for v in graph.inputs:
        if v.dtype in FLOAT_TYPES:
            floats.add(v.name)
    scalars: dict[str, float] = {}
    for n, v in graph.initializers.items():
        constants.add(n)
        if v.dtype in FLOAT_TYPES:
            floats.add(n)
        value = _scalar(v.const_value)
        if value is not None:
            scalars[n] = value
    lpbq = _lpbq_weights(graph, alias)
    constants.update(lpbq)  # stored quantized, they stand for the float weight
    floats.update(lpbq)
    ops: list[OpNode] = []
    folded = _quantizer_inputs_folded(graph)
    for node in graph:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and node.domain == "":
            continue
        outputs = tuple(name(o) or "" for o in node.outputs)
        inputs = tuple(name(i) for i in node.inputs)
        for o, value in zip(outputs, node.outputs, strict=True):
            if value.dtype in FLOAT_TYPES:
                floats.add(o)
        if node in folded:
            constants.update(outputs)  # onnxruntime folds it before QNN sees the graph
            source = _stands_for(node, scalars, name)
            for out in node.outputs if source is not None else ():
                if out.name:  # a weight's clip, reshape or split: still that weight
                    alias[out.name] = source
            continue
        if node.op_type == "Constant":
            constants.update(outputs)
            attr = node.attributes.get("value")
            value = _scalar(attr.as_tensor()) if attr is not None else None
            if value is not None:
                scalars[outputs[0]] = value
        if node.op_type == "Transpose" and inputs and inputs[0] in constants:
            transposed[outputs[0]] = inputs[0]
        ops.append(
            OpNode(
                name=node.name or outputs[0],
                op_type=_SAME_RULES.get(node.op_type, node.op_type)
                if node.domain == ""
                else node.op_type,
                inputs=inputs,
                outputs=outputs,
                depthwise=_depthwise(node),
                groups=_groups(node),
                cast_from_float=node.op_type == "Cast" and _from_float(node),
                source=source_of(node),
                origin=_origin(node),
            )
        )
    outputs = [name(v) or "" for v in graph.outputs]
    inputs = [v.name or "" for v in graph.inputs]
    return GraphView(ops, inputs, outputs, floats, constants, transposed, scalars)


#: ops onnxruntime's constant folding leaves alone (or that are not one value per input):
#: Q/DQ (QDQ handling keeps them), random ops, control flow; Constant and a constant's
#: Transpose have their own places in the view
_NOT_FOLDED = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "Constant",
        "Transpose",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "If",
        "Loop",
        "Scan",
    }
)


def _quantizer_inputs_folded(graph: ir.Graph) -> set[ir.Node]:
    """The ops that compute a QuantizeLinear's input from constants alone, read by nothing
    else (a weight clipped to a restricted integer range: ``Max``/``Min`` on the initializer
    before its quantizer). onnxruntime folds them before partitioning: QNN never runs them,
    and the quantized tensor is the weight. (A DequantizeLinear output is no constant to
    onnxruntime; constant ops read by compute ops are left to the rules.)"""
    constant = set(graph.initializers) | {
        o.name for n in graph if n.op_type == "Constant" for o in n.outputs if o.name
    }
    candidates: list[ir.Node] = []
    for node in graph:
        if node.domain != "" or node.op_type in _NOT_FOLDED:
            continue
        given = [i.name for i in node.inputs if i is not None]
        if given and all(i in constant for i in given):
            candidates.append(node)
            constant.update(o.name for o in node.outputs if o.name)
    kept: set[ir.Node] = set()
    for node in reversed(candidates):  # readers before the ops they read
        readers = [u.node for o in node.outputs for u in o.uses()]
        if readers and all(r.op_type == "QuantizeLinear" or r in kept for r in readers):
            kept.add(node)
    return kept


def _stands_for(
    node: ir.Node, scalars: dict[str, float], name: Callable[[ir.Value | None], str | None]
) -> str | None:
    """The one tensor a folded ``node`` computes from, by its view name: of its float inputs
    that are not scalars, the one with the output's shape (``Max(w, lo)`` with broadcast
    bounds), else the one they all come from (``Unsqueeze(w, axes)``, a ``Concat`` of slices
    of ``w``); None when it combines several."""
    data = [
        i
        for i in node.inputs
        if i is not None and i.dtype in FLOAT_TYPES and (i.name or "") not in scalars
    ]
    shape = node.outputs[0].shape if len(node.outputs) == 1 else None
    same = [i for i in data if shape is not None and i.shape == shape]
    if len(same) == 1:
        return name(same[0])
    sources = {name(i) for i in data}
    return sources.pop() if len(sources) == 1 else None


def _scalar(tensor: ir.TensorProtocol | None) -> float | None:
    """The value of a one-element tensor whose data is at hand (not external)."""
    if tensor is None or isinstance(tensor, ir.ExternalTensor) or tensor.size != 1:
        return None
    try:
        return float(tensor.numpy().reshape(-1)[0])
    except (TypeError, ValueError):
        return None


def _with_types(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every value's type inferred (the exporter types only some of them).
    Initializers are data-less references at this point; inference reads their dims only."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=False)
    except (onnx.shape_inference.InferenceError, ValueError):
        return model


def _qdq_aliases(graph: ir.Graph) -> dict[str, str]:
    """DequantizeLinear output -> the tensor its QuantizeLinear quantizes (also for a
    DequantizeLinear of a precomputed integer constant: its float initializer's name)."""
    alias: dict[str, str] = {}
    for node in graph:
        if node.op_type != "DequantizeLinear" or node.domain != "":
            continue
        src = node.inputs[0]
        producer = src.producer() if src is not None else None
        if producer is not None and producer.op_type == "QuantizeLinear":
            x = producer.inputs[0]
            base = x.name if x is not None else None
        elif src is not None and src.name and src.name.endswith("_quantized"):
            base = src.name[: -len("_quantized")]
        else:
            base = None
        out = node.outputs[0].name
        if base and out:
            alias[out] = alias.get(base, base)
    return alias


def _lpbq_weights(graph: ir.Graph, alias: dict[str, str]) -> set[str]:
    """The float weights an LPBQ weight's ``DequantizeLinear`` stands for: it dequantizes a
    precomputed constant with a scale another ``DequantizeLinear`` makes
    (:mod:`graphbuild.onnx.lpbq`)."""
    out: set[str] = set()
    for node in graph:
        if node.op_type != "DequantizeLinear" or node.domain != "" or len(node.inputs) < 2:
            continue
        src, scale = node.inputs[0], node.inputs[1]
        maker = scale.producer() if scale is not None else None
        if src is None or not src.is_initializer() or maker is None:
            continue
        if maker.op_type == "DequantizeLinear" and node.outputs[0].name in alias:
            out.add(alias[node.outputs[0].name])
    return out


def _groups(node: ir.Node) -> int:
    attr = node.attributes.get("group")
    return attr.as_int() if attr is not None else 1


def _depthwise(node: ir.Node) -> bool:
    """A grouped Conv with one input channel per group (ConvTranspose: Cin == groups), or a
    3-D convolution: AIMET starts no supergroup with either."""
    if node.op_type not in ("Conv", "ConvTranspose"):
        return False
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    shape = weight.shape if weight is not None else None
    if shape is not None and len(shape) == 5:
        return True
    groups = _groups(node)
    if groups == 1 or shape is None:
        return False
    if node.op_type == "Conv":
        return shape[1] == 1
    return shape[0] == groups


def _from_float(node: ir.Node) -> bool:
    x = node.inputs[0] if node.inputs else None
    to = node.attributes.get("to")
    if x is None or to is None:
        return False
    return x.dtype in FLOAT_TYPES and ir.DataType(to.as_int()) in FLOAT_TYPES
