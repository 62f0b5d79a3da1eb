"""The HTP rules' view of an aten graph: each op as the ONNX op the exporter makes of it.

Names are fx node names (the exporter names ONNX tensors after them). Where the exporter
makes several ONNX ops of one aten op and QNN would see the difference, the view spells them
out: ``linear`` on a batch of vectors is ``MatMul`` (+ ``Add`` for the bias), on a matrix with a
bias ``Gemm``; the intermediate tensor is named ``<node>.matmul`` and exists only in the view.
Ops the preset does not quantize at all (recurrent layers) are :data:`UNSUPPORTED`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.fx import GraphModule, Node

from graphbuild.frontend.quantize import resolve_attr
from graphbuild.targets.qnn.rules.plan import WEIGHTED_OPS, GraphView, OpNode

__all__ = ["AtenView", "UNSUPPORTED", "aten_view", "op_name"]

#: aten ops (by packet name) whose ONNX form has no preset rule: left float and reported.
UNSUPPORTED = frozenset(
    {"lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "_thnn_fused_lstm_cell"}
)

#: aten op packet -> the ONNX op type the exporter lowers it to (tensor inputs in order)
_ONNX_TYPE: dict[str, str] = {
    **dict.fromkeys(("add", "add_"), "Add"),
    **dict.fromkeys(("sub", "rsub"), "Sub"),
    **dict.fromkeys(("mul",), "Mul"),
    **dict.fromkeys(("div",), "Div"),
    "pow": "Pow",
    "neg": "Neg",
    "abs": "Abs",
    "exp": "Exp",
    "log": "Log",
    "sqrt": "Sqrt",
    "reciprocal": "Reciprocal",
    "sin": "Sin",
    "cos": "Cos",
    "erf": "Erf",
    "tanh": "Tanh",
    "sigmoid": "Sigmoid",
    "relu": "Relu",
    "gelu": "Gelu",
    "hardswish": "HardSwish",
    "hardsigmoid": "HardSigmoid",
    "leaky_relu": "LeakyRelu",
    "elu": "Elu",
    "prelu": "PRelu",
    **dict.fromkeys(("softmax", "_softmax"), "Softmax"),
    **dict.fromkeys(("log_softmax", "_log_softmax"), "LogSoftmax"),
    **dict.fromkeys(("matmul", "bmm", "mm"), "MatMul"),
    "mean": "ReduceMean",
    "sum": "ReduceSum",
    "amax": "ReduceMax",
    "amin": "ReduceMin",
    **dict.fromkeys(("max_pool1d", "max_pool2d", "max_pool3d"), "MaxPool"),
    **dict.fromkeys(("avg_pool1d", "avg_pool2d", "avg_pool3d"), "AveragePool"),
    **dict.fromkeys(("where", "masked_fill"), "Where"),
    **dict.fromkeys(("clamp", "hardtanh"), "Clip"),
    **dict.fromkeys(("maximum", "clamp_min"), "Max"),
    **dict.fromkeys(("minimum", "clamp_max"), "Min"),
    **dict.fromkeys(("cat", "concat", "stack"), "Concat"),
    **dict.fromkeys(("view", "_unsafe_view", "reshape", "flatten", "unflatten"), "Reshape"),
    **dict.fromkeys(("transpose", "permute", "t"), "Transpose"),
    "unsqueeze": "Unsqueeze",
    "squeeze": "Squeeze",
    **dict.fromkeys(("expand", "expand_as"), "Expand"),
    **dict.fromkeys(("slice", "narrow"), "Slice"),
    **dict.fromkeys(("select", "index_select"), "Gather"),
    "index": "GatherND",
    "gather": "GatherElements",
    **dict.fromkeys(("split", "split_with_sizes", "chunk", "unbind"), "Split"),
    "repeat": "Tile",
    **dict.fromkeys(("pad", "constant_pad_nd"), "Pad"),
    "pixel_shuffle": "DepthToSpace",
    "pixel_unshuffle": "SpaceToDepth",
    **dict.fromkeys(
        ("clone", "alias", "dropout", "contiguous", "detach", "lift_fresh_copy"), "Identity"
    ),
    **dict.fromkeys(("_to_copy", "to", "convert_element_type", "type_as"), "Cast"),
    "topk": "TopK",
    **dict.fromkeys(
        ("upsample_nearest1d", "upsample_nearest2d", "upsample_bilinear2d", "upsample_linear1d"),
        "Resize",
    ),
}

#: ops with no float result the rules care about (assertions, shape queries)
_IGNORED = frozenset({"_assert_tensor_metadata", "sym_size", "_assert_scalar", "sym_numel"})


def op_name(node: Node) -> str:
    """The aten op packet name of a call_function node (``relu`` for aten.relu_.default is
    ``relu_``), or the target's name."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(node.target, "__name__", str(node.target))


@dataclass
class AtenView:
    """The view, and for each op node of the view the fx node it stands for."""

    view: GraphView
    nodes: dict[str, Node] = field(default_factory=dict)
    #: view op name -> fx node, for ops the preset does not support
    unsupported: dict[str, Node] = field(default_factory=dict)
    #: (weight tensor, fx consumer) -> the weight's output-channel axis in that consumer
    weight_axes: dict[tuple[str, str], int] = field(default_factory=dict)
    #: per-reader copy of a shared constant -> (the constant, the view op reading the copy)
    edges: dict[str, tuple[str, str]] = field(default_factory=dict)


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _tensor_nodes(args: Sequence[Any]) -> list[Node]:
    out: list[Node] = []
    for a in args:
        if isinstance(a, Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, Node))
    return out


def aten_view(gm: GraphModule) -> AtenView:
    """The view of ``gm`` (an unlifted exported module: inputs are placeholders, state is
    get_attr)."""
    builder = _Builder(gm)
    for node in gm.graph.nodes:
        builder.add(node)
    return builder.result()


class _Builder:
    def __init__(self, gm: GraphModule) -> None:
        self.gm = gm
        self.ops: list[OpNode] = []
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.floats: set[str] = set()
        self.constants: set[str] = set()
        self.scalars: dict[str, float] = {}
        self.out = AtenView(GraphView([], [], [], set(), set()))

    def result(self) -> AtenView:
        self._unshare_conflicting_constants()
        self.out.view = GraphView(
            self.ops, self.inputs, self.outputs, self.floats, self.constants, {}, self.scalars
        )
        return self.out

    def _unshare_conflicting_constants(self) -> None:
        """A constant read both as a weight (Conv, ConvTranspose, MatMul, Gemm) and otherwise
        (a tied embedding table) gets one tensor per reader after the first, as the exported
        model will (AIMET refuses shared ones): ``<name>@<reader>``."""
        readers: dict[str, list[int]] = {}
        for i, op in enumerate(self.ops):
            for t in dict.fromkeys(op.inputs):
                if t in self.constants:
                    readers.setdefault(t, []).append(i)
        for const, indices in readers.items():
            kinds = {self.ops[i].op_type for i in indices}
            if len(kinds) < 2 or not kinds & WEIGHTED_OPS:
                continue
            for i in indices[1:]:
                op = self.ops[i]
                copy = f"{const}@{op.name}"
                self.constants.add(copy)
                if const in self.floats:
                    self.floats.add(copy)
                self.out.edges[copy] = (const, op.name)
                for (w, consumer), axis in list(self.out.weight_axes.items()):
                    if w == const and consumer == self.out.nodes[op.name].name:
                        self.out.weight_axes[(copy, consumer)] = axis
                inputs = tuple(copy if t == const else t for t in op.inputs)
                self.ops[i] = replace(op, inputs=inputs)

    def add(self, node: Node) -> None:
        if node.op == "placeholder":
            if _is_float(node.meta.get("val")):
                self.inputs.append(node.name)
                self.floats.add(node.name)
        elif node.op == "get_attr":
            value = resolve_attr(self.gm, str(node.target))
            if isinstance(value, torch.Tensor):
                self.constants.add(node.name)
                if value.is_floating_point():
                    self.floats.add(node.name)
                if value.numel() == 1 and value.dim() == 0:
                    self.scalars[node.name] = float(value)
        elif node.op == "output":
            self.outputs = [n.name for n in _tensor_nodes(_flatten(node.args[0]))]
        elif node.op == "call_function" and node.target is not operator.getitem:
            self._op(node)

    def _outputs(self, node: Node) -> tuple[str, ...]:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            if val.is_floating_point():
                self.floats.add(node.name)
            return (node.name,)
        items = sorted(
            (u for u in node.users if u.target is operator.getitem),
            key=lambda u: u.args[1],
        )
        for u in items:
            if _is_float(u.meta.get("val")):
                self.floats.add(u.name)
        return tuple(u.name for u in items)

    def _op(self, node: Node) -> None:
        name = op_name(node)
        if name in _IGNORED:
            return
        outputs = self._outputs(node)
        if not outputs:
            return
        special = _SPECIAL.get(name)
        if special is not None:
            special(self, node, outputs)
            return
        inputs = tuple(n.name for n in _tensor_nodes([*node.args, *node.kwargs.values()]))
        if name in UNSUPPORTED:
            self.out.unsupported[node.name] = node
            self._emit(node, f"aten.{name}", inputs, outputs)
            return
        op_type = _ONNX_TYPE.get(name, f"aten.{name}")
        cast = op_type == "Cast" and self._cast_from_float(node)
        self._emit(node, op_type, inputs, outputs, cast_from_float=cast)

    def _emit(
        self,
        node: Node,
        op_type: str,
        inputs: Sequence[str | None],
        outputs: Sequence[str],
        **extra: Any,
    ) -> None:
        name = node.name if node.name not in self.out.nodes else f"{node.name}.{op_type}"
        op = OpNode(
            name=name,
            op_type=op_type,
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            source=f"aten.{op_name(node)}",
            origin=node.name,
            **extra,
        )
        self.out.nodes[op.name] = node
        self.ops.append(op)

    def _cast_from_float(self, node: Node) -> bool:
        src = node.args[0] if node.args else None
        return (
            isinstance(src, Node)
            and _is_float(src.meta.get("val"))
            and _is_float(node.meta.get("val"))
        )

    # -- ops with a layout of their own ---------------------------------------------------

    def _arg(self, node: Node, i: int, key: str) -> str | None:
        value = node.args[i] if len(node.args) > i else node.kwargs.get(key)
        return value.name if isinstance(value, Node) else None

    def conv(self, node: Node, outputs: tuple[str, ...]) -> None:
        name = op_name(node)
        x, w, b = (self._arg(node, i, k) for i, k in ((0, "input"), (1, "weight"), (2, "bias")))
        if name == "convolution":
            transposed = bool(node.args[6]) if len(node.args) > 6 else False
            groups = node.args[8] if len(node.args) > 8 else 1
        elif name.startswith("conv_transpose"):
            transposed, groups = True, node.args[6] if len(node.args) > 6 else 1
        else:
            transposed, groups = False, node.args[6] if len(node.args) > 6 else 1
        weight = node.args[1].meta.get("val") if isinstance(node.args[1], Node) else None
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
        depthwise = bool(shape and len(shape) == 5)
        if shape and groups != 1:
            depthwise = depthwise or (shape[0] == groups if transposed else shape[1] == 1)
        op_type = "ConvTranspose" if transposed else "Conv"
        self._emit(node, op_type, (x, w, b), outputs, depthwise=depthwise, groups=int(groups))
        if w is not None:
            self.out.weight_axes[(w, node.name)] = 1 if transposed else 0

    def linear(self, node: Node, outputs: tuple[str, ...]) -> None:
        x, w, b = (self._arg(node, i, k) for i, k in ((0, "input"), (1, "weight"), (2, "bias")))
        xv = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
        if w is not None:
            self.out.weight_axes[(w, node.name)] = 0
        if b is not None and isinstance(xv, torch.Tensor) and xv.dim() == 2:
            self._emit(node, "Gemm", (x, w, b), outputs)
            return
        if b is None:
            self._emit(node, "MatMul", (x, w), outputs)
            return
        product = f"{node.name}.matmul"
        self.floats.add(product)
        self._emit(node, "MatMul", (x, w), (product,))
        self._emit(node, "Add", (product, b), outputs)

    def addmm(self, node: Node, outputs: tuple[str, ...]) -> None:
        b, x, w = (self._arg(node, i, k) for i, k in ((0, "self"), (1, "mat1"), (2, "mat2")))
        self._emit(node, "Gemm", (x, w, b), outputs)
        if w is not None:
            self.out.weight_axes[(w, node.name)] = 1

    def matmul(self, node: Node, outputs: tuple[str, ...]) -> None:
        a, b = self._arg(node, 0, "self"), self._arg(node, 1, "other")
        self._emit(node, "MatMul", (a, b), outputs)
        bv = node.args[1].meta.get("val") if isinstance(node.args[1], Node) else None
        if b is not None and isinstance(bv, torch.Tensor):
            self.out.weight_axes[(b, node.name)] = bv.dim() - 1

    def embedding(self, node: Node, outputs: tuple[str, ...]) -> None:
        w, ids = self._arg(node, 0, "weight"), self._arg(node, 1, "indices")
        self._emit(node, "Gather", (w, ids), outputs)

    def layer_norm(self, node: Node, outputs: tuple[str, ...]) -> None:
        x, w, b = (self._arg(node, i, k) for i, k in ((0, "input"), (2, "weight"), (3, "bias")))
        self._emit(node, "LayerNormalization", (x, w, b), outputs)

    def rms_norm(self, node: Node, outputs: tuple[str, ...]) -> None:
        x, w = self._arg(node, 0, "input"), self._arg(node, 2, "weight")
        self._emit(node, "RMSNormalization", (x, w), outputs)

    def group_norm(self, node: Node, outputs: tuple[str, ...]) -> None:
        x, w, b = (self._arg(node, i, k) for i, k in ((0, "input"), (2, "weight"), (3, "bias")))
        self._emit(node, "GroupNormalization", (x, w, b), outputs)

    def batch_norm(self, node: Node, outputs: tuple[str, ...]) -> None:
        keys = ("input", "weight", "bias", "running_mean", "running_var")
        inputs = tuple(self._arg(node, i, k) for i, k in enumerate(keys))
        self._emit(node, "BatchNormalization", inputs, outputs[:1])

    def masked_fill(self, node: Node, outputs: tuple[str, ...]) -> None:
        x, mask, value = (
            self._arg(node, i, k) for i, k in ((0, "self"), (1, "mask"), (2, "value"))
        )
        self._emit(node, "Where", (mask, value, x), outputs)


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flatten(v)]
    return [value]


_SPECIAL: dict[str, Callable[[_Builder, Node, tuple[str, ...]], None]] = {
    **dict.fromkeys(
        (
            "conv1d",
            "conv2d",
            "conv3d",
            "convolution",
            "conv_transpose1d",
            "conv_transpose2d",
            "conv_transpose3d",
        ),
        _Builder.conv,
    ),
    "linear": _Builder.linear,
    "addmm": _Builder.addmm,
    **dict.fromkeys(("matmul", "bmm", "mm"), _Builder.matmul),
    "embedding": _Builder.embedding,
    "layer_norm": _Builder.layer_norm,
    "rms_norm": _Builder.rms_norm,
    "group_norm": _Builder.group_norm,
    **dict.fromkeys(
        ("batch_norm", "_native_batch_norm_legit_no_training", "native_batch_norm"),
        _Builder.batch_norm,
    ),
    "masked_fill": _Builder.masked_fill,
}
