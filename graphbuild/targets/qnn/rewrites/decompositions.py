"""Decompositions: aten ops the ONNX exporter lowers to several ONNX ops, spelled out in aten
ops that each lower to one, so that each tensor QNN quantizes exists in the aten graph:
``silu`` (Sigmoid, Mul), ``rsqrt`` (Sqrt, Reciprocal), ``pow`` by 2 or 3 (Mul),
``adaptive_avg_pool2d`` to 1x1 (ReduceMean) and ``scaled_dot_product_attention`` (MatMul, Mul,
Where or Add, Softmax, MatMul); a ``softmax`` asked for its input's own dtype loses the no-op
Cast; a float tensor filled with one number (``zeros``, ``full``) becomes that number
expanded, as the exporter writes it; ``table[idx]`` on the first dimension is an
``index_select`` (Gather, which QNN's HTP runs quantized, where the exporter's GatherND runs
float). The HTP's patterns (:mod:`.patterns`) join the table.

A boolean attention mask is applied as ``where(mask, scores, MASK_FILL)``: ``-inf`` has no
quantized representation and ``finfo.min`` would leave the scores no resolution on any grid,
while ``exp(-100)`` is already zero next to any unmasked score in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node

from graphbuild.targets.qnn.rewrites.emitter import _arg, _Emitter, _float_val
from graphbuild.targets.qnn.rewrites.patterns import NODE_REWRITES

__all__ = ["MASK_FILL"]

aten = torch.ops.aten

MASK_FILL = -100.0
"""Score of a masked position in a decomposed attention with a boolean mask."""


def _silu(emit: _Emitter, node: Node) -> Node:
    x = node.args[0]
    return emit(aten.mul.Tensor, x, emit(aten.sigmoid.default, x))


def _rsqrt(emit: _Emitter, node: Node) -> Node:
    return emit(aten.reciprocal.default, emit(aten.sqrt.default, node.args[0]))


def _pow(emit: _Emitter, node: Node) -> Node | None:
    x, exponent = node.args[0], node.args[1]
    if exponent == 2:
        return emit(aten.mul.Tensor, x, x)
    if exponent == 3:
        return emit(aten.mul.Tensor, emit(aten.mul.Tensor, x, x), x)
    if exponent == 0.5:
        return emit(aten.sqrt.default, x)
    return None  # Pow with a quantized exponent, as QNN would run it


def _adaptive_avg_pool(emit: _Emitter, node: Node) -> Node | None:
    size = node.args[1]
    sizes = [size] if isinstance(size, int) else list(size)
    if any(s != 1 for s in sizes):
        return None
    dims = list(range(-len(sizes), 0))
    return emit(aten.mean.dim, node.args[0], dims, True)


def _sdpa(emit: _Emitter, node: Node) -> Node | None:
    """scaled_dot_product_attention as eager attention: softmax(q kᵀ · scale [mask]) v."""
    q, k, v = node.args[:3]
    mask = _arg(node, 3, "attn_mask")
    dropout = _arg(node, 4, "dropout_p", 0.0)
    causal = _arg(node, 5, "is_causal", False)
    scale = node.kwargs.get("scale", _arg(node, 6, "scale"))
    gqa = node.kwargs.get("enable_gqa", False)
    qv, kv = _float_val(q), _float_val(k)
    if qv is None or kv is None or dropout:
        return None
    if gqa:
        k, v = _repeat_kv(emit, k, qv), _repeat_kv(emit, v, qv)
    if scale is None:
        scale = 1.0 / math.sqrt(qv.shape[-1])
    scores = emit(aten.matmul.default, q, emit(aten.transpose.int, k, -2, -1))
    scores = emit(aten.mul.Tensor, scores, float(scale))
    length, source = qv.shape[-2], kv.shape[-2]
    if causal:
        ones = emit(aten.ones.default, [length, source], dtype=torch.bool)
        scores = _masked(emit, emit(aten.tril.default, ones), scores)
    if isinstance(mask, Node):
        if mask.meta["val"].dtype == torch.bool:
            scores = _masked(emit, mask, scores)
        else:
            scores = emit(aten.add.Tensor, scores, mask)
    probs = emit(aten._softmax.default, scores, -1, False)
    return emit(aten.matmul.default, probs, v)


def _masked(emit: _Emitter, mask: Node, scores: Node) -> Node:
    fill = emit.constant(MASK_FILL, scores.meta["val"].dtype)
    return emit(aten.where.self, mask, scores, fill)


def _repeat_kv(emit: _Emitter, x: Node, qv: torch.Tensor) -> Node:
    """Key/value heads repeated for grouped-query attention (unsqueeze, expand, reshape)."""
    xv = x.meta["val"]
    *batch, heads, seq, dim = xv.shape
    groups = qv.shape[-3] // heads
    if groups == 1:
        return x
    wide = emit(aten.unsqueeze.default, x, -3)
    wide = emit(aten.expand.default, wide, [*batch, heads, groups, seq, dim])
    return emit(aten.reshape.default, wide, [*batch, heads * groups, seq, dim])


def _filled(emit: _Emitter, node: Node) -> Node | None:
    """A float tensor filled with one number (``zeros``, ``full``, ``ones_like``...) as the
    exporter writes it: the number, expanded to the shape. The number is the constant QNN
    quantizes."""
    out = _float_val(node)
    if out is None or any(not isinstance(d, int) for d in out.shape):
        return None
    name = node.target.overloadpacket.__name__
    if name.startswith(("zeros", "new_zeros")):
        value = 0.0
    elif name.startswith(("ones", "new_ones")):
        value = 1.0
    else:  # full(size, value), full_like(x, value), new_full(x, size, value)
        value = node.args[2] if name == "new_full" else node.args[1]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
    constant = emit.constant(float(value), out.dtype)
    return emit(aten.expand.default, constant, list(out.shape))


def _softmax(emit: _Emitter, node: Node) -> Node | None:
    """``softmax(x, dim, dtype=x.dtype)``: the exporter adds a Cast after the Softmax for the
    dtype, and QNN would quantize the Softmax and not the Cast; the dtype changes nothing."""
    x, dim = node.args[0], node.args[1]
    dtype = node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
    xv = _float_val(x)
    if dtype is None or xv is None or dtype != xv.dtype:
        return None
    return emit(node.target, x, dim)


def _index(emit: _Emitter, node: Node) -> Node | None:
    """``table[idx]`` with one integer index on the first dimension (Swin's relative position
    bias): the exporter writes GatherND, which QNN's HTP runs float; ``index_select`` is a
    Gather, which it runs on the table's grid. A rank-k index is flattened and the result
    viewed back."""
    x, indices = node.args[0], node.args[1]
    if _float_val(x) is None or len(indices) != 1 or not isinstance(indices[0], Node):
        return None
    idx = indices[0].meta.get("val")
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
        return None
    shape = [*idx.shape, *_float_val(x).shape[1:]]
    if idx.dim() == 0 or not all(isinstance(d, int) for d in shape):
        return None
    flat = indices[0] if idx.dim() == 1 else emit(aten.view.default, indices[0], [-1])
    taken = emit(aten.index_select.default, x, 0, flat)
    return taken if idx.dim() == 1 else emit(aten.view.default, taken, shape)


_FILLED = (
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
)

_DECOMPOSITIONS: dict[Any, Callable[[_Emitter, Node], Node | None]] = {
    **dict.fromkeys(_FILLED, _filled),
    aten.silu.default: _silu,
    aten.rsqrt.default: _rsqrt,
    aten.pow.Tensor_Scalar: _pow,
    aten.adaptive_avg_pool2d.default: _adaptive_avg_pool,
    aten.adaptive_avg_pool1d.default: _adaptive_avg_pool,
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.softmax.int: _softmax,
    aten.log_softmax.int: _softmax,
    aten.index.Tensor: _index,
    **NODE_REWRITES,
}
