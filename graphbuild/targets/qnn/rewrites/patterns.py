"""Graph patterns QNN's HTP backend refuses or computes wrong, rewritten away in aten before
the preset annotates (so the torch reference, the ONNX model and the encodings agree).

Each was found on onnxruntime-qnn's libQnnHtp (QNN 2.40, v73 to v81):

* **GELU with tanh** (``0.5 x (1 + tanh(z))``, GPT-2's ``gelu_new``; ``gelu(approximate=
  "tanh")``) becomes ``x * sigmoid(2 z)``, the same function. The HTP's 16-bit Tanh returns
  rows of another tensor position when it follows LayerNorm -> Mul on 16 rows (64,000 steps
  off ORT CPU in a five-op graph, every arch; ``tests/test_htp_patterns.py`` keeps the
  reproduction), and QNN's Gelu ignores ``approximate="tanh"``; Sigmoid computes right.
* **RMSNorm written out** (``x * rsqrt(mean(x^2) + eps) [* w]`` or ``x / sqrt(...)``) becomes
  ``aten.rms_norm``, which the exporter writes as one op (:mod:`graphbuild.onnx.rmsnorm`):
  spelled out, QNN runs the chain float.
* **Zero-size tensors** (the pass-through half of a full rotary embedding, ``q[..., 64:]`` of
  a 64-wide head) are dropped from the ``cat`` that reads them: QNN cannot add a node with an
  empty tensor (``graphAddNode`` error 6005).
* **A computed convolution or linear bias** (``F.conv2d(x, w, torch.zeros(c))``, a parameter
  ``expand``-ed to the channels) leaves the op: a zero bias is dropped, any other is added
  after it (a scalar broadcast, else the bias reshaped along the channels). QNN wants a
  static bias (error 3110, then ORT fails the session even with CPU fallback).
* **An average pool whose window covers its whole input** (``AvgPool2d(7, ceil_mode=True)``
  on a 4x4 map) is the mean over its spatial axes (QNN refuses the oversized window, error
  3110).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Graph, Node

if TYPE_CHECKING:
    from graphbuild.targets.qnn.rewrites.emitter import _Emitter

__all__ = ["NODE_REWRITES", "drop_dead_nodes", "fuse_patterns"]

aten = torch.ops.aten

#: 2 * sqrt(2 / pi): GELU's tanh argument doubled for the sigmoid form
_GELU_SIGMOID = 2.0 * math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715

_NO_OP_CASTS = (aten.to.dtype, aten._to_copy.default, aten.type_as.default)
_ASSERTS = ("_assert_tensor_metadata",)


def fuse_patterns(graph: Graph, emit: _Emitter) -> None:
    """The multi-node rewrites (GELU with tanh, RMSNorm), in place."""
    _fuse_gelu_tanh(graph, emit)
    _fuse_rms_norm(graph, emit)


def drop_dead_nodes(graph: Graph) -> None:
    """Erase the pure ops the rewrites left without readers (an empty slice, the ``expand``
    of a dropped bias): the exporter would still write them."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and not node.is_impure():
            graph.erase_node(node)


# ---------------------------------------------------------------------------- helpers


def _is(node: Any, *targets: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _users(node: Node) -> list[Node]:
    """``node``'s readers, less shape assertions (they read no value)."""
    return [u for u in node.users if not _is_assert(u)]


def _is_assert(node: Node) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    return packet is not None and packet.__name__ in _ASSERTS


def _only_user(node: Node) -> Node | None:
    users = _users(node)
    return users[0] if len(users) == 1 else None


def _scalar_other(node: Node, operand: Node) -> float | None:
    """The Python number ``node`` (a binary op) combines ``operand`` with."""
    args = list(node.args[:2])
    if len(args) != 2 or operand not in args:
        return None
    other = args[1] if args[0] is operand else args[0]
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return float(other)
    return None


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _replace(graph: Graph, old: Node, new: Node, dead: list[Node]) -> None:
    """``old``'s readers read ``new``; ``old`` and the nodes of ``dead`` left without readers
    are erased (shape assertions on them too)."""
    new.meta.update({k: v for k, v in old.meta.items() if k not in new.meta and k != "val"})
    old.replace_all_uses_with(new)
    for node in [old, *dead]:
        for user in [u for u in node.users if _is_assert(u)]:
            graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)


def _strip_no_op_casts(node: Node) -> tuple[Node, list[Node]]:
    """Follow ``node``'s single reader through casts to its own dtype."""
    casts: list[Node] = []
    current = node
    while True:
        user = _only_user(current)
        if user is None or not _is(user, *_NO_OP_CASTS) or user.args[0] is not current:
            return current, casts
        before, after = _val(current), _val(user)
        if before is None or after is None or before.dtype != after.dtype:
            return current, casts
        casts.append(user)
        current = user


# ---------------------------------------------------------------------------- GELU


def _fuse_gelu_tanh(graph: Graph, emit: _Emitter) -> None:
    """``(0.5 * x) * (1 + tanh(z))`` (either operand order) -> ``x * sigmoid(2 z)``."""
    for tanh in [n for n in graph.nodes if _is(n, aten.tanh.default)]:
        plus_one = _only_user(tanh)
        if not _is(plus_one, aten.add.Tensor) or _scalar_other(plus_one, tanh) != 1.0:
            continue
        product = _only_user(plus_one)
        if not _is(product, aten.mul.Tensor) or plus_one not in product.args[:2]:
            continue
        half = product.args[1] if product.args[0] is plus_one else product.args[0]
        if not _is(half, aten.mul.Tensor) or _only_user(half) is not product:
            continue
        x = next((a for a in half.args[:2] if isinstance(a, Node)), None)
        if x is None or _scalar_other(half, x) != 0.5:
            continue
        z = tanh.args[0]
        with graph.inserting_before(product), emit.like(product):
            doubled = _doubled(emit, z, tanh)
            result = emit(aten.mul.Tensor, x, emit(aten.sigmoid.default, doubled))
        _replace(graph, product, result, [plus_one, tanh, half, z])


def _doubled(emit: _Emitter, z: Node, reader: Node) -> Node:
    """``2 z``: a scalar product ``u * c`` read by ``reader`` alone becomes ``u * 2c``."""
    if _is(z, aten.mul.Tensor) and _only_user(z) is reader:
        u = next((a for a in z.args[:2] if isinstance(a, Node)), None)
        c = _scalar_other(z, u) if u is not None else None
        if u is not None and c is not None:
            return emit(aten.mul.Tensor, u, 2.0 * c)
    return emit(aten.mul.Tensor, z, 2.0)


def _gelu(emit: _Emitter, node: Node) -> Node | None:
    """``gelu(x, approximate="tanh")`` -> ``x * sigmoid(2c (x + 0.044715 x^3))``."""
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    if approximate != "tanh":
        return None
    x = node.args[0]
    cube = emit(aten.mul.Tensor, emit(aten.mul.Tensor, x, x), x)
    inner = emit(aten.add.Tensor, x, emit(aten.mul.Tensor, cube, _GELU_CUBIC))
    gate = emit(aten.sigmoid.default, emit(aten.mul.Tensor, inner, _GELU_SIGMOID))
    return emit(aten.mul.Tensor, x, gate)


# ---------------------------------------------------------------------------- RMSNorm


def _fuse_rms_norm(graph: Graph, emit: _Emitter) -> None:
    for node in list(graph.nodes):
        if getattr(node, "_erased", False) or not _is(node, aten.rsqrt.default, aten.sqrt.default):
            continue
        found = _rms_norm_at(node)
        if found is None:
            continue
        x, eps, normalized, dead = found
        tail, casts = _strip_no_op_casts(normalized)
        weight, last = _affine_weight(tail, x)
        if weight is None:
            last, casts = normalized, []
        dim = _val(x).shape[-1]
        with graph.inserting_before(last), emit.like(last):
            result = emit(aten.rms_norm.default, x, [dim], weight, eps)
        _replace(graph, last, result, [*reversed(casts), *([normalized] if weight else []), *dead])


def _rms_norm_at(root: Node) -> tuple[Node, float, Node, list[Node]] | None:
    """From ``rsqrt(mean(x^2, -1) + eps)`` (or its ``sqrt``): (x, eps, the normalized
    tensor, the chain's inner nodes)."""
    plus = root.args[0]
    if not _is(plus, aten.add.Tensor) or _only_user(plus) is not root:
        return None
    mean = next((a for a in plus.args[:2] if isinstance(a, Node)), None)
    eps = _scalar_other(plus, mean) if mean is not None else None
    if eps is None or not _is(mean, aten.mean.dim) or _only_user(mean) is not plus:
        return None
    if list(mean.args[1]) not in ([-1], [_rank(mean) - 1]) or not _keepdim(mean):
        return None
    square = mean.args[0]
    x = _squared(square)
    if x is None or _only_user(square) is not mean or _val(x) is None:
        return None
    normalized = _only_user(root)
    if root.target is aten.rsqrt.default:
        ok = _is(normalized, aten.mul.Tensor) and set(normalized.args[:2]) == {x, root}
    else:
        ok = _is(normalized, aten.div.Tensor) and tuple(normalized.args[:2]) == (x, root)
    if not ok:
        return None
    return x, eps, normalized, [root, plus, mean, square]


def _rank(node: Node) -> int:
    val = _val(node)
    return val.dim() if val is not None else -1


def _keepdim(mean: Node) -> bool:
    return bool(mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False))


def _squared(node: Any) -> Node | None:
    if _is(node, aten.mul.Tensor) and node.args[0] is node.args[1]:
        return node.args[0]
    if _is(node, aten.pow.Tensor_Scalar) and node.args[1] == 2:
        return node.args[0]
    return None


def _affine_weight(tail: Node, x: Node) -> tuple[Node | None, Node]:
    """The RMSNorm's weight: a 1-D float constant multiplying ``tail`` as its only reader."""
    mul = _only_user(tail)
    if not _is(mul, aten.mul.Tensor) or tail not in mul.args[:2]:
        return None, tail
    weight = mul.args[1] if mul.args[0] is tail else mul.args[0]
    w, xv = _val(weight), _val(x)
    if not isinstance(weight, Node) or weight.op not in ("get_attr", "placeholder"):
        return None, tail
    if w is None or xv is None or w.dim() != 1 or w.shape[0] != xv.shape[-1]:
        return None, tail
    if w.dtype != xv.dtype:
        return None, tail
    return weight, mul


# ---------------------------------------------------------------------------- node-local


def _cat(emit: _Emitter, node: Node) -> Node | None:
    """``cat`` without its zero-size operands (the only one left stands for the result)."""
    tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    kept = [t for t in tensors if not (_val(t) is not None and _val(t).numel() == 0)]
    if len(kept) == len(tensors) or not kept:
        return None
    if len(kept) == 1:
        return kept[0]
    return emit(aten.cat.default, kept, dim)


def _conv(emit: _Emitter, node: Node) -> Node | None:
    """A convolution with a computed bias: the op without it, then the bias added."""
    bias_index = 2
    bias = node.args[bias_index] if len(node.args) > bias_index else node.kwargs.get("bias")
    if not isinstance(bias, Node) or bias.op in ("get_attr", "placeholder"):
        return None
    out = _val(node)
    if out is None or out.dim() < 2:
        return None
    args = list(node.args)
    if len(args) > bias_index:
        args[bias_index] = None
    kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
    plain = emit(node.target, *args, **kwargs)
    scalar = _expanded_scalar(bias)
    if scalar is not None:
        if _is_zero_constant(emit, scalar):
            return plain
        return emit(aten.add.Tensor, plain, scalar)
    channel_axis = 1 if node.target is not aten.linear.default else out.dim() - 1
    shape = [-1] + [1] * (out.dim() - 1 - channel_axis)
    shaped = emit(aten.reshape.default, bias, shape) if len(shape) > 1 else bias
    return emit(aten.add.Tensor, plain, shaped)


def _expanded_scalar(bias: Node) -> Node | None:
    """The one-element tensor ``bias`` expands (``expand(s, [c])``), if that is what it is."""
    if not _is(bias, aten.expand.default):
        return None
    source = bias.args[0]
    val = _val(source)
    return source if isinstance(source, Node) and val is not None and val.numel() == 1 else None


def _is_zero_constant(emit: _Emitter, node: Node) -> bool:
    if node.op != "get_attr":
        return False
    value = getattr(emit.gm, str(node.target), None)
    return isinstance(value, torch.Tensor) and not value.is_meta and bool((value == 0).all())


def _avg_pool(emit: _Emitter, node: Node) -> Node | None:
    """``avg_pool`` with one output position whose window covers the whole input (and
    averages only real elements) -> the mean over the spatial axes."""
    x, out = node.args[0], _val(node)
    xv = _val(x)
    if xv is None or out is None:
        return None
    spatial = out.dim() - 2
    if any(d != 1 for d in out.shape[-spatial:]):
        return None

    def arg(i: int, default: Any) -> Any:
        return node.args[i] if len(node.args) > i else default

    kernel = _per_axis(arg(1, None), spatial)
    padding = _per_axis(arg(3, 0), spatial)
    count_include_pad, divisor = arg(5, True), arg(6, None)
    if kernel is None or padding is None or divisor is not None:
        return None
    if any(p and count_include_pad for p in padding):
        return None
    sizes = xv.shape[-spatial:]
    if any(k - p < s for k, p, s in zip(kernel, padding, sizes, strict=True)):
        return None
    return emit(aten.mean.dim, x, list(range(-spatial, 0)), True)


def _per_axis(value: Any, n: int) -> list[int] | None:
    if isinstance(value, int):
        return [value] * n
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        values = list(value)
        return values * n if len(values) == 1 else values if len(values) == n else None
    return None


#: aten op -> rewrite of that one node (merged into the rewrite module's table)
NODE_REWRITES: dict[Any, Callable[[_Emitter, Node], Node | None]] = {
    aten.gelu.default: _gelu,
    aten.cat.default: _cat,
    aten.conv1d.default: _conv,
    aten.conv2d.default: _conv,
    aten.conv3d.default: _conv,
    aten.linear.default: _conv,
    aten.convolution.default: _conv,
    aten.conv_transpose1d.default: _conv,
    aten.conv_transpose2d.input: _conv,
    aten.conv_transpose3d.input: _conv,
    aten.avg_pool1d.default: _avg_pool,
    aten.avg_pool2d.default: _avg_pool,
    aten.avg_pool3d.default: _avg_pool,
}
