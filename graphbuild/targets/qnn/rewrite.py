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
  (:mod:`graphbuild.targets.qnn.htp_patterns`: GELU with tanh, RMSNorm, zero-size tensors,
  computed biases, pools over the whole input);
* a Python number an op computes with (``x * 0.5``, ``x + 1e-6``) becomes a 0-d tensor
  constant, the initializer QNN quantizes; a float tensor filled with one number (``zeros``,
  ``full``) becomes that constant expanded, as the exporter writes it.

A boolean attention mask is applied as ``where(mask, scores, MASK_FILL)``: ``-inf`` has no
quantized representation and ``finfo.min`` would leave the scores no resolution on any grid,
while ``exp(-100)`` is already zero next to any unmasked score in float32.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, GraphModule, Node

from graphbuild.targets.qnn.htp_patterns import NODE_REWRITES, drop_dead_nodes, fuse_patterns

__all__ = ["MASK_FILL", "rewrite_for_htp"]

aten = torch.ops.aten

MASK_FILL = -100.0
"""Score of a masked position in a decomposed attention with a boolean mask."""

_SCALAR_PREFIX = "_qnn_scalar"

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
    drop_dead_nodes(graph)
    _lift_scalars(graph, emit)
    graph.lint()
    gm.recompile()
    return gm


# ---------------------------------------------------------------------------- building nodes


class _Emitter:
    """Creates nodes with their ``val`` meta computed on the inputs' fake values, so the
    rewritten graph is as annotated as the exporter's own."""

    def __init__(self, gm: GraphModule, fake_mode: Any) -> None:
        self.gm, self.graph, self.fake_mode = gm, gm.graph, fake_mode
        self.template: dict[str, Any] = {}
        self.count = sum(1 for n in gm.graph.nodes if str(n.target).startswith(_SCALAR_PREFIX))

    def like(self, node: Node) -> _Emitter:
        """Within the ``with`` block, new nodes carry ``node``'s module stack and trace."""
        self.template = {
            k: node.meta[k]
            for k in ("nn_module_stack", "stack_trace", "source_fn_stack")
            if k in node.meta
        }
        return self

    def __enter__(self) -> _Emitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.template = {}

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        node = self.graph.call_function(target, args, kwargs)
        node.meta.update(self.template)
        values = [_val(a) for a in args]
        kwvalues = {k: _val(v) for k, v in kwargs.items()}
        with self.fake_mode:
            node.meta["val"] = target(*values, **kwvalues)
        return node

    def constant(self, value: float, dtype: torch.dtype) -> Node:
        """A 0-d tensor constant (a get_attr of a new module attribute)."""
        name = f"{_SCALAR_PREFIX}_{self.count}"
        self.count += 1
        tensor = torch.tensor(value, dtype=dtype)
        setattr(self.gm, name, tensor)
        node = self.graph.create_node("get_attr", name)  # a plain tensor attribute
        node.meta.update(self.template)
        node.meta["val"] = self.fake_mode.from_tensor(tensor, static_shapes=True)
        return node


def _val(arg: Any) -> Any:
    if isinstance(arg, Node):
        return arg.meta["val"]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_val(a) for a in arg)
    return arg


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _float_val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) and val.is_floating_point() else None


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


# ---------------------------------------------------------------------------- decompositions


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
    **NODE_REWRITES,
}


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
