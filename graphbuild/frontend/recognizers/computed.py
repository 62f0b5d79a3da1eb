"""Values the graph computes (AIMET's scales, FastForward's zero points): a value subgraph as a ref.

A scale or zero point computed from state by pure ATen arithmetic is a ``computed`` ref: the
subgraph's nodes are recorded so ``qvalues`` can evaluate it, and erased with the quantizer
when nothing else reads them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

from graphbuild.frontend.recognizers.helpers import (
    _STATE_KINDS,
    aten_name,
    input_spec,
    op_parts,
)
from graphbuild.quant.quantmap import ValueRef

# In-place ATen ops a value subgraph may use, read as their functional form (``round_`` is
# ``round``) when nothing else reads the tensor they overwrite.
_VALUE_OP_NAMES = frozenset(
    {
        "abs",
        "add",
        "alias",
        "amax",
        "clamp",
        "clamp_max",
        "clamp_min",
        "clone",
        "detach",
        "div",
        "expand",
        "full",
        "lift_fresh_copy",
        "maximum",
        "minimum",
        "mul",
        "neg",
        "reciprocal",
        "reshape",
        "round",
        "sub",
        "to",
        "view",
        "zeros_like",
        "_to_copy",
    }
)
_ASSERT = "_assert_tensor_metadata"


def _is_assert(node: Node) -> bool:
    return node.op == "call_function" and aten_name(node.target) == _ASSERT


def _functional(node: Node) -> str | None:
    """``name.overload`` of a value op node in functional form, or None."""
    parts = op_parts(node.target) if node.op == "call_function" else None
    if parts is None or parts[0] != "aten":
        return None
    name, overload = parts[1], parts[2] or "default"
    if name.endswith("_") and not name.startswith("_"):
        base = name[:-1]
        target = node.args[0] if node.args else None
        others = (
            [u for u in target.users if u is not node and not _is_assert(u) and not _is_dead(u)]
            if isinstance(target, Node)
            else []
        )
        if others:  # the in-place op changes a tensor something else reads
            return None
        name = base
    return f"{name}.{overload}" if name in _VALUE_OP_NAMES else None


_DEAD_READERS = frozenset({"ge", "le", "gt", "lt", "__and__", "logical_and"})


def _is_dead(node: Node, depth: int = 3) -> bool:
    """A comparison whose result nothing reads (AIMET's unused range mask, ``(q >= qmin) &
    (q <= qmax)``): it cannot see what an in-place op after it overwrites."""
    if node.op != "call_function" or aten_name(node.target) not in _DEAD_READERS:
        return False
    users = [u for u in node.users if not _is_assert(u)]
    return not users or (depth > 0 and all(_is_dead(u, depth - 1) for u in users))


class _Unsupported(Exception):
    """A value subgraph leaves what ``computed_ref`` can express."""


def computed_ref(
    program: ExportedProgram, node: Node, then: Iterable[tuple[str, list[Any]]] = ()
) -> tuple[ValueRef, frozenset[Node]] | None:
    """A ``computed`` :class:`ValueRef` for what ``node`` computes from parameters, buffers
    and constants with pure ATen ops (then the ops ``then`` names, each applied to the
    previous result), and the op nodes of that computation; None when it reads anything else
    (a user input, an op outside ``frontend.qvalues.VALUE_OPS``)."""
    steps: list[list[Any]] = []
    index: dict[Node, int] = {}
    seen: set[Node] = set()

    def encode(arg: Any) -> Any:
        if isinstance(arg, Node):
            if arg.op == "placeholder":
                spec = input_spec(program, arg)
                if (
                    spec is None
                    or spec.target is None
                    or spec.kind
                    not in (
                        *_STATE_KINDS,
                        InputKind.CONSTANT_TENSOR,
                    )
                ):
                    raise _Unsupported
                kind = "constant" if spec.kind == InputKind.CONSTANT_TENSOR else "state"
                return {"ref": [kind, spec.target]}
            return {"step": visit(arg)}
        if isinstance(arg, torch.dtype):
            return {"dtype": str(arg).removeprefix("torch.")}
        if isinstance(arg, (list, tuple)):
            return [encode(a) for a in arg]
        if arg is None or isinstance(arg, (bool, int, float)):
            return arg
        raise _Unsupported

    def visit(n: Node) -> int:
        if n in index:
            return index[n]
        op = _functional(n)
        if op is None or n in seen:
            raise _Unsupported
        seen.add(n)
        args = [encode(a) for a in n.args]
        kwargs = {k: encode(v) for k, v in n.kwargs.items() if k == "dtype"}
        steps.append([op, args, kwargs])
        index[n] = len(steps) - 1
        return index[n]

    try:
        if node.op == "placeholder":
            steps.append(["alias.default", [encode(node)], {}])
        else:
            visit(node)
    except _Unsupported:
        return None
    for op, args in then:
        steps.append([op, [{"step": len(steps) - 1}, *args], {}])
    expr = json.dumps({"steps": steps}, separators=(",", ":"))
    return ValueRef("computed", node.name, expr), frozenset(index)


def _exclusive(nodes: Iterable[Node], group: set[Node]) -> set[Node]:
    """Of ``nodes``, those (with the metadata asserts on them) that only ``group`` and each
    other read: what may be erased with the quantizer. Placeholders read only so are kept out
    (normalize drops them) but their asserts join."""
    candidates = set(nodes)
    while True:
        inside = group | candidates
        drop = {
            n for n in candidates if any(u not in inside and not _is_assert(u) for u in n.users)
        }
        if not drop:
            break
        candidates -= drop
    out = set(candidates)
    for n in list(candidates) + _leaves(candidates):
        users = [u for u in n.users if u not in group and u not in candidates]
        if users and all(_is_assert(u) for u in users):
            out.update(users)
    return out


def _leaves(nodes: Iterable[Node]) -> list[Node]:
    return [a for n in nodes for a in n.all_input_nodes if a.op == "placeholder"]


def _tensor_shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return tuple(int(d) for d in val.shape)
    except TypeError:  # symbolic
        return None
