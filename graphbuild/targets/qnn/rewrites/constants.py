"""Integer arithmetic on static shapes folded into the float constant it makes.

A static-shape export computes some tensors from literals alone: a rotary embedding's
positions are ``arange(seq_len)`` (plus an offset, unsqueezed) cast to float, then multiplied
by ``inv_freq``. QNN's HTP runs that product float, since its input is a Cast's output, which
AIMET's configuration (and so the HTP rules) leaves float: no ``--strict-coverage`` export of a
rotary LLM could pass. The values are known when the graph is traced (they depend on shapes,
never on weights or inputs), so the cast's output is replaced by the constant it computes: a
constant an op reads, which the rules quantize on the activation grid like ``inv_freq``.

Only an integer-to-float cast whose every ancestor is an op on literals is folded (no
placeholder, no stored tensor, no symbolic size: a dynamic-shape export keeps its arithmetic);
boolean masks stay as they are. The fold is structure (invariant 5): it reads shapes only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph, Node

from graphbuild.targets.qnn.rewrites.emitter import _Emitter

__all__ = ["fold_integer_constants"]

aten = torch.ops.aten

#: the casts an export writes ``x.float()`` / ``x.to(dtype)`` as
_CASTS = frozenset(
    {aten._to_copy.default, aten.to.dtype, torch.ops.prims.convert_element_type.default}
)

#: largest tensor folded (elements): a position table, never a model-sized buffer
_MAX_ELEMENTS = 1 << 20


def fold_integer_constants(graph: Graph, emit: _Emitter) -> int:
    """Replace each integer-to-float cast computed from literals alone by its value (a tensor
    constant); the number folded."""
    literal: dict[Node, bool] = {}
    folded = 0
    for node in list(graph.nodes):
        literal[node] = _is_literal(node, literal)
        if node.op != "call_function" or node.target not in _CASTS or not literal[node]:
            continue
        source = node.args[0] if node.args else None
        if not _is_integer(source) or not _is_float(node):
            continue
        value = _evaluate(node, {})
        if value is None or value.numel() > _MAX_ELEMENTS:
            continue
        with graph.inserting_before(node), emit.like(node):
            constant = emit.tensor(value)
        node.replace_all_uses_with(constant)
        folded += 1
    return folded


def _is_literal(node: Node, known: dict[Node, bool]) -> bool:
    """Whether ``node`` is an op whose arguments are literals or literal ops (no placeholder,
    no get_attr, no symbolic value)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target._schema.is_mutable:
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or any(not isinstance(d, int) for d in val.shape):
        return False
    ok = True

    def visit(arg: Any) -> Any:
        nonlocal ok
        if isinstance(arg, Node):
            ok = ok and known.get(arg, False)
        elif isinstance(arg, torch.SymInt | torch.SymFloat | torch.SymBool):
            ok = False
        return arg

    torch.fx.node.map_aggregate((node.args, node.kwargs), visit)
    return ok


def _evaluate(node: Node, memo: dict[Node, torch.Tensor]) -> torch.Tensor | None:
    """``node``'s value, computed on real tensors on the CPU from its literal ancestors."""
    if node in memo:
        return memo[node]

    def real(arg: Any) -> Any:
        return _evaluate(arg, memo) if isinstance(arg, Node) else arg

    args = torch.fx.node.map_aggregate(node.args, real)
    kwargs = dict(torch.fx.node.map_aggregate(node.kwargs, real))
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        value = node.target(*args, **kwargs)
    memo[node] = value
    return value if isinstance(value, torch.Tensor) else None


def _is_integer(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return (
        isinstance(val, torch.Tensor)
        and not val.is_floating_point()
        and not val.is_complex()
        and val.dtype != torch.bool
    )


def _is_float(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()
