"""Recognisers: what a quantizer looks like in an exported program.

A recogniser matches a quantizer pattern (a fake-quant node, a quantize node with its dequantize
users, a custom op) at an anchor node and says what it is: a :class:`Match` with the grid, the
axis and where its values live. :func:`register_recognizer` adds one for a custom quantizer op;
the helpers here (``op_name``, ``get_arg``, ``value_ref``, ...) are public for that purpose.
``normalize`` replaces what they match with markers; ``qvalues`` reads the values.
"""

from __future__ import annotations

import json
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

from graphbuild.errors import ExportError, UnknownQuantizerError
from graphbuild.quant.quantmap import ValueRef

__all__ = [
    "AimetQuantizeDequantizeRecognizer",
    "CachemaskRecognizer",
    "FakeQuantRecognizer",
    "FastForwardRecognizer",
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
    "computed_ref",
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


# --------------------------------------------------------------------------------------------
# Values the graph computes (AIMET's scales, FastForward's zero points)
# --------------------------------------------------------------------------------------------

# In-place ATen ops a value subgraph may use, read as their functional form (``round_`` is
# ``round``) when nothing else reads the tensor they overwrite.
_VALUE_OP_NAMES = frozenset(
    {
        "abs",
        "add",
        "alias",
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
            [u for u in target.users if u is not node and not _is_assert(u)]
            if isinstance(target, Node)
            else []
        )
        if others:  # the in-place op changes a tensor something else reads
            return None
        name = base
    return f"{name}.{overload}" if name in _VALUE_OP_NAMES else None


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


# --------------------------------------------------------------------------------------------
# FastForward
# --------------------------------------------------------------------------------------------


class FastForwardRecognizer:
    """FastForward's static quantizers in export mode (``ff.export_mode(True)``).

    ``fastforward::quantize_by_tile(x, scale, tile_size, num_bits, output_dtype, offset)``
    whose users are all ``fastforward::dequantize_by_tile(q, scale, tile_size, offset,
    output_dtype)`` with the same scale, tiles and offset (FastForward's
    ``quantization/_quantizer_impl.py``): ``q = clamp(round(x / scale - round(offset)),
    -2^(b-1), 2^(b-1) - 1)``, ``x' = (q + round(offset)) * scale``, one scale and offset per
    tile. So the grid is signed ``b``-bit, the zero point ``-round(offset)`` (not clamped:
    FastForward does not clamp it), and the tiles say the granularity: one tile is per
    tensor, tiles one element thick along one axis per channel, tiles ``B`` long along one
    axis and one element thick along every other is blocked (ONNX's ``block_size``).
    """

    namespace = "fastforward"

    def __repr__(self) -> str:
        return "FastForwardRecognizer(fastforward.quantize_by_tile/dequantize_by_tile)"

    def match(self, node: Node, program: ExportedProgram) -> Match | None:
        parts = op_parts(node.target) if node.op == "call_function" else None
        if parts is None or parts[:2] != (self.namespace, "quantize_by_tile"):
            return None
        x, tile, bits = node.args[0], get_arg(node, 2), get_arg(node, 3)
        dequants = list(node.users)
        if (
            not isinstance(x, Node)
            or not dequants
            or not all(self._pairs(node, d) for d in dequants)
        ):
            return None
        shape = _tensor_shape(x)
        if shape is None or not isinstance(tile, (list, tuple)) or len(tile) != len(shape):
            return None
        if not isinstance(bits, (int, float)) or bits != int(bits) or not 2 <= bits <= 32:
            return None
        layout = _tile_layout(shape, [int(t) for t in tile])
        if layout is None:
            raise UnknownQuantizerError(
                f"FastForward quantizer at node '{node.name}': tiles {list(tile)} on a tensor "
                f"of shape {list(shape)} are neither per tensor, per channel nor ONNX blocks"
            )
        axis, block_size, grid = layout
        then = [("reshape.default", [list(grid)])] if block_size is not None else []
        scale = self._value(program, node, 1, then)
        offset = get_arg(node, 5)
        zero_point = None
        if offset is not None:
            zero_point = self._value(
                program, node, 5, [*then, ("round.default", []), ("neg.default", [])]
            )
        if scale is None or (offset is not None and zero_point is None):
            return None
        b = int(bits)
        return Match(
            input=x,
            replaces=(node, *dequants),
            op=op_name(node.target),
            qmin=-(2 ** (b - 1)),
            qmax=2 ** (b - 1) - 1,
            scale=scale,
            zero_point=zero_point,
            axis=axis,
            block_size=block_size,
            bits=b,
            signed=True,
        )

    def _pairs(self, q: Node, dq: Node) -> bool:
        parts = op_parts(dq.target) if dq.op == "call_function" else None
        if (
            parts is None
            or parts[:2] != (self.namespace, "dequantize_by_tile")
            or dq.args[0] is not q
        ):
            return False
        return all(_same_arg(get_arg(q, i), get_arg(dq, j)) for i, j in ((1, 1), (2, 2), (5, 3)))

    @staticmethod
    def _value(
        program: ExportedProgram, node: Node, index: int, then: list[tuple[str, list[Any]]]
    ) -> ValueRef | None:
        arg = get_arg(node, index)
        if not then:
            return value_ref(program, node, index)
        found = computed_ref(program, _origin(arg), then) if isinstance(arg, Node) else None
        return found[0] if found is not None else None


def _tile_layout(
    shape: tuple[int, ...], tile: list[int]
) -> tuple[int | None, int | None, tuple[int, ...]] | None:
    """(axis, block size, tile grid) of FastForward tiles on ``shape``, or None when no
    encoding can say it."""
    if any(t <= 0 or d % t for d, t in zip(shape, tile, strict=True)):
        return None
    grid = tuple(d // t for d, t in zip(shape, tile, strict=True))
    split = [i for i, g in enumerate(grid) if g > 1]
    if not split:
        return None, None, grid
    if len(split) == 1 and tile[split[0]] == 1:
        return split[0], None, grid
    blocked = [i for i in split if tile[i] > 1]
    if len(blocked) == 1 and all(tile[i] == 1 for i in range(len(shape)) if i != blocked[0]):
        return blocked[0], tile[blocked[0]], grid
    return None


# --------------------------------------------------------------------------------------------
# AIMET (aimet-torch QuantizationSimModel)
# --------------------------------------------------------------------------------------------


def _one(node: Node, names: tuple[str, ...]) -> Node | None:
    """The single user of ``node`` (asserts aside) if it is one of the ATen ops ``names``
    (in-place variants included) reading ``node`` first."""
    users = [u for u in node.users if not _is_assert(u)]
    if len(users) != 1:
        return None
    (user,) = users
    name = aten_name(user.target) if user.op == "call_function" else None
    if name is None or name.rstrip("_") not in names or not user.args or user.args[0] is not node:
        return None
    return user


def _is_noop(node: Node, like: Node) -> bool:
    """``node`` is ``to``/``_to_copy`` to ``like``'s dtype or a ``view``/``reshape`` to its
    shape, with nothing else to it: the identity on ``like``."""
    name = aten_name(node.target) if node.op == "call_function" else None
    shape, val = _tensor_shape(like), like.meta.get("val")
    if name in ("to", "_to_copy"):
        dtype = node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
        extra = {k for k in node.kwargs if k not in ("dtype", "device", "layout")}
        return isinstance(val, torch.Tensor) and dtype == val.dtype and not extra
    if name in ("view", "reshape") and len(node.args) == 2 and shape is not None:
        return list(node.args[1]) == list(shape)
    return name in ("alias", "detach", "clone") and len(node.args) == 1


def _same_value(a: Any, b: Any) -> bool:
    """:func:`_same_arg`, also looking through no-op ``to`` casts."""

    def strip(n: Any) -> Any:
        n = _origin(n)
        while isinstance(n, Node) and n.args and isinstance(n.args[0], Node):
            if aten_name(n.target) not in ("to", "_to_copy") or not _is_noop(n, n.args[0]):
                break
            n = _origin(n.args[0])
        return n

    return _same_arg(strip(a), strip(b))


class AimetQuantizeDequantizeRecognizer:
    """aimet-torch's ``QuantizeDequantize`` (QuantizationSimModel v2) as ``torch.export``
    leaves it: no custom op, ATen arithmetic (``aimet_torch/quantization/affine/backends/
    torch_builtins.py``)::

        div(x, S) -> round -> sub(., O) -> clamp(., qmin, qmax) -> add(., O) -> mul(., S)

    with the dead range check ``ge``/``le``/``__and__`` on the ``sub`` and, around it, no-op
    ``to`` casts, same-shape views and ``_assert_tensor_metadata``. ``S`` and ``O`` are
    computed from the quantizer's ``min``/``max`` parameters (``get_scale``/``get_offset``,
    the minimum-scale clamp included); graphbuild reads them by running that computation on
    the model's state (a ``computed`` value), so the encodings are AIMET's exact scale and
    ``zero_point = -offset``. Per-tensor and per-channel (``S`` of one non-unit dim) are
    recognised; a blocked AIMET quantizer is an :class:`UnknownQuantizerError`.
    """

    def __repr__(self) -> str:
        return "AimetQuantizeDequantizeRecognizer(aten div/round/sub/clamp/add/mul)"

    def match(self, node: Node, program: ExportedProgram) -> Match | None:
        if node.op != "call_function" or aten_name(node.target) not in ("div", "div_"):
            return None
        if len(node.args) != 2 or not all(isinstance(a, Node) for a in node.args):
            return None
        xin, scale = node.args
        rnd = _one(node, ("round",))
        sub = _one(rnd, ("sub",)) if rnd is not None and len(rnd.args) == 1 else None
        if sub is None or len(sub.args) != 2 or not isinstance(sub.args[1], Node):
            return None
        offset = sub.args[1]
        checks = self._range_checks(sub)
        clamps = [u for u in sub.users if u not in checks and not _is_assert(u)]
        if (
            checks is None
            or len(clamps) != 1
            or aten_name(clamps[0].target) not in ("clamp", "clamp_")
        ):
            return None
        (clamp,) = clamps
        qmin, qmax = get_arg(clamp, 1), get_arg(clamp, 2)
        add = _one(clamp, ("add",))
        mul = _one(add, ("mul",)) if add is not None else None
        if not (
            isinstance(qmin, int) and isinstance(qmax, int) and qmin < qmax and mul is not None
        ):
            return None
        if not (_same_value(add.args[1], offset) and _same_value(mul.args[1], scale)):
            return None
        s = computed_ref(program, scale)
        o = computed_ref(program, offset, [("neg.default", [])])
        if s is None or o is None:
            return None
        chain = [node, rnd, sub, *checks, clamp, add, mul]
        x, before = self._through_noops_up(xin, node)
        out, after = self._through_noops_down(mul)
        axis = self._axis(node, x, scale)
        group = set(chain) | set(before) | set(after)
        group |= {u for n in list(group) for u in n.users if _is_assert(u)}
        group |= _exclusive(s[1] | o[1], group)
        return Match(
            input=x,
            replaces=tuple(n for n in program.graph.nodes if n in group),
            op="aimet.quantize_dequantize",
            qmin=qmin,
            qmax=qmax,
            scale=s[0],
            zero_point=o[0],
            axis=axis,
        )

    @staticmethod
    def _range_checks(sub: Node) -> list[Node] | None:
        """AIMET's unused ``(q >= qmin) & (q <= qmax)``, or None if something reads it."""
        checks = [u for u in sub.users if aten_name(u.target) in ("ge", "le")]
        ands = {a for c in checks for a in c.users}
        if any(aten_name(a.target) != "__and__" or a.users for a in ands):
            return None
        if any(set(c.users) - ands for c in checks):
            return None
        return [*checks, *ands]

    @staticmethod
    def _through_noops_up(xin: Node, div: Node) -> tuple[Node, list[Node]]:
        taken: list[Node] = []
        while (
            xin.op == "call_function"
            and xin.args
            and isinstance(xin.args[0], Node)
            and _is_noop(xin, xin.args[0])
            and all(u is (taken[-1] if taken else div) or _is_assert(u) for u in xin.users)
        ):
            taken.append(xin)
            xin = xin.args[0]
        return xin, taken

    @staticmethod
    def _through_noops_down(out: Node) -> tuple[Node, list[Node]]:
        taken: list[Node] = []
        while True:
            users = [u for u in out.users if not _is_assert(u)]
            if len(users) != 1 or not _is_noop(users[0], out) or users[0].args[0] is not out:
                return out, taken
            out = users[0]
            taken.append(out)

    @staticmethod
    def _axis(anchor: Node, x: Node, scale: Node) -> int | None:
        shape, s_shape = _tensor_shape(x), _tensor_shape(scale)
        if s_shape is None or shape is None or len(s_shape) > len(shape):
            raise UnknownQuantizerError(
                f"AIMET quantizer at node '{anchor.name}': cannot tell its granularity"
            )
        wide = [i for i, d in enumerate(s_shape) if d != 1]
        if not wide:
            return None
        axis = wide[0] + len(shape) - len(s_shape)
        if len(wide) == 1 and s_shape[wide[0]] == shape[axis]:
            return axis
        raise UnknownQuantizerError(
            f"AIMET quantizer at node '{anchor.name}': scales of shape {list(s_shape)} on a "
            f"tensor of shape {list(shape)} are neither per tensor nor per channel (blocked "
            "AIMET quantizers are not supported)"
        )


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
        FastForwardRecognizer(),
        AimetQuantizeDequantizeRecognizer(),
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
