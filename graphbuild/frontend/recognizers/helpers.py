"""Helpers for recognisers: op names, arguments, where a scale or zero point lives.

Public: custom recognisers use them too (:func:`op_parts`, :func:`get_arg`, :func:`value_ref`,
:func:`int_arg`, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec
from torch.fx import Node

from graphbuild.errors import ExportError
from graphbuild.frontend.recognizers.registry import Match
from graphbuild.quant.quantmap import ValueRef

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER)


def op_name(target: Any) -> str:
    """``namespace.op.overload`` of an op target (``str(target)`` for anything else)."""
    return str(target)


def op_parts(target: Any) -> tuple[str, str, str] | None:
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace, target._opname, target._overloadname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[0], target._qualified_op_name, ""
    return None


def get_arg(node: Node, index: int) -> Any:
    """Argument ``index`` of an op node, positional or keyword (schema default if absent)."""
    if index < len(node.args):
        return node.args[index]
    schema = getattr(node.target, "_schema", None)
    if schema is None or index >= len(schema.arguments):
        return None
    argument = schema.arguments[index]
    if argument.name in node.kwargs:
        return node.kwargs[argument.name]
    return argument.default_value if argument.has_default_value() else None


_spec_index: tuple[list, dict[str, InputSpec]] | None = None


def input_spec(program: ExportedProgram, node: Node) -> InputSpec | None:
    """The graph-signature input spec of placeholder ``node`` (None for other nodes)."""
    global _spec_index
    if node.op != "placeholder":
        return None
    specs = program.graph_signature.input_specs
    if _spec_index is None or _spec_index[0] is not specs or len(_spec_index[1]) != len(specs):
        index = {s.arg.name: s for s in specs if hasattr(s.arg, "name")}
        _spec_index = (specs, index)
    return _spec_index[1].get(node.name)


# Ops that pass a tensor through unchanged (how export lifts ``torch.tensor(...)`` constants).
_PASS_THROUGH = frozenset({"lift_fresh_copy", "detach", "detach_", "clone", "alias"})
# Pure ops that may hold or make a quantizer value; erased once normalization leaves them unused.
VALUE_HELPERS = _PASS_THROUGH | {"full", "scalar_tensor", "zeros", "zeros_like"}


def aten_name(target: Any) -> str | None:
    parts = op_parts(target)
    return parts[1] if parts is not None and parts[0] == "aten" else None


def _origin(arg: Any) -> Any:
    """``arg`` with pass-through ops (``lift_fresh_copy``, ``detach``...) looked through."""
    while (
        isinstance(arg, Node)
        and arg.op == "call_function"
        and aten_name(arg.target) in _PASS_THROUGH
        and arg.args
    ):
        arg = arg.args[0]
    return arg


def _is_zeros(arg: Any) -> bool:
    origin = _origin(arg)
    if isinstance(origin, Node) and origin.op == "call_function":
        return aten_name(origin.target) in ("zeros", "zeros_like")
    return False


def value_ref(program: ExportedProgram, node: Node, index: int) -> ValueRef | None:
    """Where argument ``index`` of ``node`` (a scale or zero point) comes from.

    A number is a ``literal`` (``"<node>:<index>"``); a parameter or buffer placeholder is
    ``state`` (by state-dict name); a lifted tensor constant is a ``constant``; pass-through
    ops are looked through, and ``full``/``scalar_tensor`` give a literal on their value
    argument. Anything else (a computed tensor, a user input) gives None.
    """
    arg = get_arg(node, index)
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return ValueRef("literal", f"{node.name}:{index}")
    origin = _origin(arg)
    if not isinstance(origin, Node):
        return None
    maker = aten_name(origin.target) if origin.op == "call_function" else None
    if maker in ("full", "scalar_tensor"):
        return value_ref(program, origin, 1 if maker == "full" else 0)
    spec = input_spec(program, origin)
    if spec is None or spec.target is None:
        return None
    if spec.kind in _STATE_KINDS:
        return ValueRef("state", spec.target)
    if spec.kind == InputKind.CONSTANT_TENSOR:
        return ValueRef("constant", spec.target)
    return None


def int_arg(program: ExportedProgram, node: Node, index: int) -> int | None:
    """An integer argument (``quant_min``, ``axis``...), literal or a one-element state or
    constant tensor (``quantize_per_tensor.tensor2``); None when it cannot be known."""
    arg = get_arg(node, index)
    if isinstance(arg, int) and not isinstance(arg, bool):
        return arg
    ref = value_ref(program, node, index)
    if ref is None or ref.kind == "literal":
        return None
    value = stored_tensor(program, ref, None)
    return int(value.item()) if value.numel() == 1 else None


def param_of(program: ExportedProgram, node: Node) -> str | None:
    spec = input_spec(program, node)
    return spec.target if spec is not None and spec.kind in _STATE_KINDS else None


def _same_arg(a: Any, b: Any) -> bool:
    if isinstance(a, Node) or isinstance(b, Node):
        return _origin(a) is _origin(b)
    return type(a) is type(b) and a == b


def _channel_axis(node: Node, axis: int | None) -> int | None:
    val = node.meta.get("val")
    if axis is None or axis >= 0 or not isinstance(val, torch.Tensor):
        return axis
    return axis % val.dim()


@dataclass(frozen=True)
class _Layout:
    """Argument positions of a quantizer op (None: the op has no such argument)."""

    scale: int = 1
    zero_point: int = 2
    qmin: int = 3
    qmax: int = 4
    axis: int | None = None
    dtype: int | None = None
    enabled: int | None = None

    def positions(self) -> tuple[int, ...]:
        fields = (self.scale, self.zero_point, self.qmin, self.qmax, self.axis, self.dtype)
        return tuple(i for i in fields if i is not None)


def _match_from(
    program: ExportedProgram, anchor: Node, layout: _Layout, replaces: tuple[Node, ...]
) -> Match | None:
    """A Match whose grid, axis and value sources are read from ``anchor``'s arguments."""
    qmin = int_arg(program, anchor, layout.qmin)
    qmax = int_arg(program, anchor, layout.qmax)
    scale = value_ref(program, anchor, layout.scale)
    zero_point = value_ref(program, anchor, layout.zero_point)
    if qmin is None or qmax is None or qmax <= qmin or scale is None:
        return None
    zp_arg = get_arg(anchor, layout.zero_point)
    if zero_point is None and zp_arg is not None and not _is_zeros(zp_arg):
        return None
    axis = None
    if layout.axis is not None:
        axis = int_arg(program, anchor, layout.axis)
        if axis is None:
            return None
    x = anchor.args[0]
    if not isinstance(x, Node):
        return None
    return Match(
        input=x,
        replaces=replaces,
        op=op_name(anchor.target),
        qmin=qmin,
        qmax=qmax,
        scale=scale,
        zero_point=zero_point,
        axis=_channel_axis(x, axis),
    )


def stored_tensor(
    program: ExportedProgram, ref: ValueRef, state: Mapping[str, torch.Tensor] | None
) -> torch.Tensor:
    """A ``state`` or ``constant`` ref's tensor. ``state`` (when given) replaces the program's
    state dict; non-persistent buffers, which live in ``program.constants``, fall back there."""
    if ref.kind == "state":
        source = program.state_dict if state is None else state
        if ref.name in source:
            return source[ref.name]
    if ref.name in program.constants:
        value = program.constants[ref.name]
        if isinstance(value, torch.Tensor):
            return value
    where = "the state" if ref.kind == "state" and state is not None else "the program"
    raise ExportError(f"quantizer value '{ref.name}' ({ref.kind}) is not in {where}")
