"""Recognisers: what a quantizer looks like in an exported program.

A recogniser matches a quantizer pattern (a fake-quant node, a quantize node with its dequantize
users, a custom op) at an anchor node and says what it is: a :class:`Match` with the grid, the
axis and where its values live. :func:`register_recognizer` adds one for a custom quantizer op;
the helpers here (``op_name``, ``get_arg``, ``value_ref``, ...) are public for that purpose.
``normalize`` replaces what they match with markers; ``qvalues`` reads the values.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    InputKind,
    InputSpec,
)
from torch.fx import Node

from graphbuild.errors import ExportError
from graphbuild.frontend.quantmap import ValueRef

__all__ = [
    "CachemaskRecognizer",
    "FakeQuantRecognizer",
    "Match",
    "QDQPairRecognizer",
    "Recognizer",
    "VALUE_HELPERS",
    "aten_name",
    "get_arg",
    "grid_bits",
    "input_spec",
    "int_arg",
    "op_name",
    "op_parts",
    "param_of",
    "recognizers",
    "register_recognizer",
    "stored_tensor",
    "unregister_recognizer",
    "value_ref",
]


_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER)

# --------------------------------------------------------------------------------------------
# Match and the recogniser registry
# --------------------------------------------------------------------------------------------


def grid_bits(qmin: int, qmax: int) -> int:
    """Bits a grid ``[qmin, qmax]`` needs: ``ceil(log2(qmax - qmin + 1))``."""
    if qmax <= qmin:
        raise ValueError(f"empty quantization grid [{qmin}, {qmax}]")
    return (qmax - qmin).bit_length()


@dataclass(frozen=True)
class Match:
    """What a recogniser found at a node.

    ``input`` is the tensor being quantized; ``replaces`` every node the marker stands for (the
    fake-quant node, or the quantize node and all its dequantize users). Nodes of ``replaces``
    with users outside it are the quantizer's outputs: their users are rewired to the marker.
    The matched node must be one of ``replaces``. ``scale`` and ``zero_point`` say where the
    values live (see :func:`value_ref`); a ``zero_point`` of None means zero. ``bits`` and
    ``signed`` default to what the grid implies (``grid_bits``, ``qmin < 0``).
    """

    input: Node
    replaces: tuple[Node, ...]
    op: str
    qmin: int
    qmax: int
    scale: ValueRef
    zero_point: ValueRef | None = None
    axis: int | None = None
    block_size: int | None = None
    bits: int | None = None
    signed: bool | None = None
    symmetric: bool | None = None

    def __post_init__(self) -> None:
        if self.bits is None:
            object.__setattr__(self, "bits", grid_bits(self.qmin, self.qmax))
        if self.signed is None:
            object.__setattr__(self, "signed", self.qmin < 0)


@runtime_checkable
class Recognizer(Protocol):
    """Recognises one quantizer form. ``match`` must not modify the program."""

    def match(self, node: Node, program: ExportedProgram) -> Match | None: ...


_registry: list[Recognizer] = []


def register_recognizer(recognizer: Recognizer, *, first: bool = False) -> Recognizer:
    """Add ``recognizer`` (tried after the others, or before them with ``first=True``)."""
    if not isinstance(recognizer, Recognizer):
        raise TypeError(f"{recognizer!r} has no match(node, program) method")
    if first:
        _registry.insert(0, recognizer)
    else:
        _registry.append(recognizer)
    return recognizer


def unregister_recognizer(recognizer: Recognizer) -> None:
    """Remove a recogniser added with :func:`register_recognizer`."""
    _registry.remove(recognizer)


def recognizers() -> tuple[Recognizer, ...]:
    """The recognisers, in the order they are tried."""
    return tuple(_registry)


# --------------------------------------------------------------------------------------------
# Helpers for recognisers (public: custom recognisers use them too)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Built-in recognisers
# --------------------------------------------------------------------------------------------


class FakeQuantRecognizer:
    """A single fake-quant node ``op(x, scale, zero_point, ...) -> Tensor``."""

    def __init__(self, namespace: str, name: str, overloads: Iterable[str], layout: _Layout):
        self.namespace, self.name = namespace, name
        self.overloads = frozenset(overloads)
        self.layout = layout

    def __repr__(self) -> str:
        return f"FakeQuantRecognizer({self.namespace}.{self.name})"

    def _accepts(self, node: Node) -> bool:
        parts = op_parts(node.target) if node.op == "call_function" else None
        return (
            parts is not None
            and parts == (self.namespace, self.name, parts[2])
            and (parts[2] in self.overloads)
        )

    def match(self, node: Node, program: ExportedProgram) -> Match | None:
        if not self._accepts(node):
            return None
        return _match_from(program, node, self.layout, (node,))


class CachemaskRecognizer(FakeQuantRecognizer):
    """The decomposed fake-quant form ``op(x, ...) -> (out, mask)`` read through getitem.

    ``run_decompositions`` produces it. Output 0 is the quantizer's output; the mask must be
    unused. The tensor-qparams variant takes a ``fake_quant_enabled`` tensor, accepted only
    when it is a constant ``full(..., 1)`` (a switch held in a buffer would make what the graph
    computes depend on that buffer's value).
    """

    def __repr__(self) -> str:
        return f"CachemaskRecognizer({self.namespace}.{self.name})"

    def match(self, node: Node, program: ExportedProgram) -> Match | None:
        if not self._accepts(node):
            return None
        getitems = list(node.users)
        for user in getitems:
            if user.target is not operator.getitem or user.args[1] not in (0, 1):
                return None
            if user.args[1] == 1 and user.users:
                return None
        enabled = self.layout.enabled
        if enabled is not None and not _is_constant_one(node.args[enabled]):
            return None
        return _match_from(program, node, self.layout, (node, *getitems))


def _is_constant_one(arg: Any) -> bool:
    """Whether ``arg`` is ``aten.full(shape, 1)`` (erased later if nothing else uses it)."""
    return isinstance(arg, Node) and arg.target is torch.ops.aten.full.default and arg.args[1] == 1


class QDQPairRecognizer:
    """``quantize(x, ...)`` whose users are all ``dequantize(q, <same args>)`` nodes.

    The quantize and every dequantize become one marker (convert_pt2e may duplicate
    dequantize nodes per consumer). Overloads pair by name (``tensor`` with ``tensor``).
    """

    def __init__(self, namespace: str, quantize: str, dequantize: str, layout: _Layout):
        self.namespace, self.quantize, self.dequantize = namespace, quantize, dequantize
        self.layout = layout

    def __repr__(self) -> str:
        return f"QDQPairRecognizer({self.namespace}.{self.quantize}/{self.dequantize})"

    def match(self, node: Node, program: ExportedProgram) -> Match | None:
        parts = op_parts(node.target) if node.op == "call_function" else None
        if parts is None or parts[:2] != (self.namespace, self.quantize):
            return None
        dtype = get_arg(node, self.layout.dtype) if self.layout.dtype is not None else None
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            return None
        dequants = list(node.users)
        if not dequants or not all(self._pairs(node, dq, parts[2]) for dq in dequants):
            return None
        return _match_from(program, node, self.layout, (node, *dequants))

    def _pairs(self, q: Node, dq: Node, overload: str) -> bool:
        parts = op_parts(dq.target) if dq.op == "call_function" else None
        if parts != (self.namespace, self.dequantize, overload) or dq.args[0] is not q:
            return False
        if dq.kwargs.get("out_dtype") is not None:
            return False
        positions = self.layout.positions()
        return all(_same_arg(get_arg(q, i), get_arg(dq, i)) for i in positions)


def _builtin_recognizers() -> list[Recognizer]:
    per_tensor = _Layout()
    per_channel = _Layout(scale=1, zero_point=2, axis=3, qmin=4, qmax=5)
    qdq_tensor = _Layout(dtype=5)
    qdq_channel = _Layout(axis=3, qmin=4, qmax=5, dtype=6)
    return [
        FakeQuantRecognizer(
            "aten", "fake_quantize_per_tensor_affine", ("default", "tensor_qparams"), per_tensor
        ),
        FakeQuantRecognizer("aten", "fake_quantize_per_channel_affine", ("default",), per_channel),
        FakeQuantRecognizer(
            "aten", "_fake_quantize_learnable_per_tensor_affine", ("default",), per_tensor
        ),
        FakeQuantRecognizer(
            "aten", "_fake_quantize_learnable_per_channel_affine", ("default",), per_channel
        ),
        CachemaskRecognizer(
            "aten", "fake_quantize_per_tensor_affine_cachemask", ("default",), per_tensor
        ),
        CachemaskRecognizer(
            "aten",
            "_fake_quantize_per_tensor_affine_cachemask_tensor_qparams",
            ("default",),
            _Layout(enabled=3, qmin=4, qmax=5),
        ),
        CachemaskRecognizer(
            "aten", "fake_quantize_per_channel_affine_cachemask", ("default",), per_channel
        ),
        QDQPairRecognizer(
            "quantized_decomposed", "quantize_per_tensor", "dequantize_per_tensor", qdq_tensor
        ),
        QDQPairRecognizer(
            "quantized_decomposed", "quantize_per_channel", "dequantize_per_channel", qdq_channel
        ),
    ]


_registry.extend(_builtin_recognizers())


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
