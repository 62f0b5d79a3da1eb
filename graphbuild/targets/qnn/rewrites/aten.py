"""Value-independent rewrites of an aten graph before the QNN preset annotates it.

The HTP rules (:mod:`graphbuild.targets.qnn.rules.plan`) decide per ONNX tensor. For the preset to
put a quantizer on every tensor QNN quantizes, each tensor of the exported ONNX model must exist
in the aten graph too. These rewrites make that so:

* in-place ops (``relu_``, ``add_``, ``hardswish_``) become their out-of-place forms, later
  readers of the mutated tensor reading the result (what functionalization does);
* ops the ONNX exporter lowers to several ONNX ops are spelled out in aten ops that each lower
  to one: ``silu`` (Sigmoid, Mul), ``rsqrt`` (Sqrt, Reciprocal), ``pow`` by 2 or 3
  (Mul), ``adaptive_avg_pool2d`` to 1x1 (ReduceMean) and ``scaled_dot_product_attention``
  (MatMul, Mul, Where or Add, Softmax, MatMul); a ``softmax`` asked for its input's own dtype
  loses the no-op Cast;
* patterns QNN's HTP refuses or computes wrong are rewritten into forms it runs
  (:mod:`graphbuild.targets.qnn.rewrites.patterns`: GELU with tanh, RMSNorm, zero-size tensors,
  computed biases, pools over the whole input);
* integer arithmetic on static shapes cast to float (a rotary embedding's positions) becomes
  the constant it computes (:mod:`.constants`), which QNN runs quantized;
* a Python number an op computes with (``x * 0.5``, ``x + 1e-6``) becomes a 0-d tensor
  constant, the initializer QNN quantizes; a float tensor filled with one number (``zeros``,
  ``full``) becomes that constant expanded, as the exporter writes it.

This module runs them (:func:`rewrite_for_htp`) and holds the in-place and scalar ones; the
decompositions are in :mod:`.decompositions`, the HTP's patterns in :mod:`.patterns`, and
how a rewrite builds nodes in :mod:`.emitter`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, GraphModule, Node

from graphbuild.targets.qnn.rewrites.constants import fold_integer_constants
from graphbuild.targets.qnn.rewrites.decompositions import _DECOMPOSITIONS
from graphbuild.targets.qnn.rewrites.emitter import _Emitter, _float_val
from graphbuild.targets.qnn.rewrites.patterns import drop_dead_nodes, fuse_patterns

__all__ = ["rewrite_for_htp"]

aten = torch.ops.aten

#: ops that only re-view their input: an in-place op on their output would mutate the base
_VIEWS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "transpose",
        "permute",
        "t",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "expand",
        "as_strided",
        "alias",
        "narrow",
        "flatten",
        "unflatten",
        "split",
        "chunk",
        "unbind",
        "diagonal",
        "detach",
    }
)


def rewrite_for_htp(gm: GraphModule) -> GraphModule:
    """Apply the rewrites to ``gm`` in place and return it."""
    graph = gm.graph
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes])
    emit = _Emitter(gm, fake_mode)
    _inline_wrappers(gm)
    _out_of_place(graph)
    fuse_patterns(graph, emit)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        rewrite = _DECOMPOSITIONS.get(node.target)
        if rewrite is None:
            continue
        with graph.inserting_before(node), emit.like(node):
            result = rewrite(emit, node)
        if result is not None:
            result.meta.update(
                {k: v for k, v in node.meta.items() if k not in result.meta and k != "val"}
            )
            node.replace_all_uses_with(result)
            graph.erase_node(node)
    fold_integer_constants(graph, emit)
    drop_dead_nodes(graph)
    _lift_scalars(graph, emit)
    graph.lint()
    gm.recompile()
    return gm


# ---------------------------------------------------------------------------- wrappers

#: higher-order op name -> index of its submodule argument
_WRAPPER_ARGS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}
_WRAPPERS = {
    op: index
    for name, index in _WRAPPER_ARGS.items()
    if (op := getattr(torch.ops.higher_order, name, None)) is not None
}


def _inline_wrappers(gm: GraphModule) -> None:
    """Inline ``with torch.no_grad()`` / ``torch.autocast(enabled=False)`` regions (a rotary
    embedding's): the exporter inlines them too, and the quantizer must see their ops. Grad
    mode does not change values; autocast regions are inlined only when disabled."""
    graph = gm.graph
    for node in list(graph.nodes):
        index = _WRAPPERS.get(node.target) if node.op == "call_function" else None
        if index is None:
            continue
        if getattr(node.target, "__name__", "") == "wrap_with_autocast" and node.args[2]:
            continue  # an enabled autocast region changes dtypes: left to the exporter
        sub_node = node.args[index]
        sub = getattr(gm, sub_node.target)
        args = node.args[index + 1 :]
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        val_map = dict(zip(placeholders, args, strict=True))
        with graph.inserting_before(node):
            result = graph.graph_copy(sub.graph, val_map)
        results = result if isinstance(result, (list, tuple)) else (result,)
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(results[user.args[1]])
                graph.erase_node(user)
        if node.users:
            node.replace_all_uses_with(results[0])
        graph.erase_node(node)
        if not sub_node.users:
            graph.erase_node(sub_node)
            delattr(gm, sub_node.target)


# ---------------------------------------------------------------------------- in-place ops


def _out_of_place(graph: Graph) -> None:
    """``relu_(x)`` -> ``relu(x)``, readers of ``x`` after it reading the result instead. Left
    alone (and reported by the coverage check) when ``x`` is a view, an input or a weight."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = node.target.overloadpacket.__name__
        if not name.endswith("_") or name.startswith("_"):
            continue
        packet = getattr(aten, name[:-1], None)
        overload = getattr(packet, node.target._overloadname, None) if packet else None
        x = node.args[0] if node.args else None
        if overload is None or not isinstance(x, Node) or not _owns_storage(x):
            continue
        node.target = overload
        for user in list(x.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(x, node)


def _owns_storage(x: Node) -> bool:
    """Whether ``x`` is a fresh result of an op (not a view, input or module state)."""
    if x.op != "call_function":
        return False
    target = getattr(x.target, "overloadpacket", None)
    return target is None or target.__name__ not in _VIEWS


# ---------------------------------------------------------------------------- scalars


#: op -> (the overload taking tensors where the scalar was, positions of number operands)
_SCALAR_OPERANDS: dict[Any, tuple[Any, Sequence[int]]] = {
    aten.add.Tensor: (aten.add.Tensor, (0, 1)),
    aten.sub.Tensor: (aten.sub.Tensor, (0, 1)),
    aten.mul.Tensor: (aten.mul.Tensor, (0, 1)),
    aten.div.Tensor: (aten.div.Tensor, (0, 1)),
    aten.add.Scalar: (aten.add.Tensor, (1,)),
    aten.sub.Scalar: (aten.sub.Tensor, (1,)),
    aten.mul.Scalar: (aten.mul.Tensor, (1,)),
    aten.div.Scalar: (aten.div.Tensor, (1,)),
    aten.pow.Tensor_Scalar: (aten.pow.Tensor_Tensor, (1,)),
    aten.pow.Scalar: (aten.pow.Tensor_Tensor, (0,)),
    aten.maximum.default: (aten.maximum.default, (0, 1)),
    aten.minimum.default: (aten.minimum.default, (0, 1)),
    aten.where.ScalarOther: (aten.where.self, (2,)),
    aten.where.ScalarSelf: (aten.where.self, (1,)),
    aten.where.Scalar: (aten.where.self, (1, 2)),
    aten.masked_fill.Scalar: (aten.masked_fill.Tensor, (2,)),
    aten.clamp.default: (aten.clamp.Tensor, (1, 2)),
    aten.clamp_min.default: (aten.clamp_min.Tensor, (1,)),
    aten.clamp_max.default: (aten.clamp_max.Tensor, (1,)),
    aten.hardtanh.default: (aten.clamp.Tensor, (1, 2)),
}


def _lift_scalars(graph: Graph, emit: _Emitter) -> None:
    """Python numbers in float ops become 0-d constants of the op's dtype (``rsub`` is
    ``sub`` with the number first)."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten.rsub.Scalar:
            _lift_rsub(graph, emit, node)
            continue
        entry = _SCALAR_OPERANDS.get(node.target)
        out = _float_val(node)
        if entry is None or out is None or _has_alpha(node):
            continue
        target, positions = entry
        args = list(node.args)
        if node.target == aten.hardtanh.default:
            args += [-1.0, 1.0][len(args) - 1 :]
        lifted = False
        with graph.inserting_before(node), emit.like(node):
            for i in positions:
                if (
                    i < len(args)
                    and isinstance(args[i], (int, float))
                    and not isinstance(args[i], bool)
                ):
                    args[i] = emit.constant(float(args[i]), out.dtype)
                    lifted = True
        if lifted or target is not node.target:
            if not all(isinstance(a, Node) for a in _operands(target, args)):
                continue
            node.target, node.args = target, tuple(args)


def _operands(target: Any, args: list) -> list:
    """The tensor operands of ``target`` that must be nodes after lifting."""
    if target in (aten.where.self,):
        return args[1:3]
    if target in (aten.clamp.Tensor,):
        return [a for a in args[1:3] if a is not None]
    if target in (aten.masked_fill.Tensor,):
        return [args[2]]
    if target in (aten.pow.Tensor_Tensor,):
        return args[:2]
    return args[:2]


def _has_alpha(node: Node) -> bool:
    alpha = node.kwargs.get("alpha", 1)
    return alpha != 1


def _lift_rsub(graph: Graph, emit: _Emitter, node: Node) -> None:
    x, other = node.args[0], node.args[1]
    out = _float_val(node)
    if out is None or _has_alpha(node) or not isinstance(other, (int, float)):
        return
    with graph.inserting_before(node), emit.like(node):
        constant = emit.constant(float(other), out.dtype)
    node.target, node.args = aten.sub.Tensor, (constant, x)
