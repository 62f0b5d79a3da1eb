"""normalize: replace every quantizer in an exported program with one marker op.

Each recognised quantizer (a fake-quant node, or a quantize node with its dequantize users)
becomes ``graphbuild::q(x, qid)``. The result is a *marker graph* that carries no quantizer
values: literal scales vanish with their nodes, and scale/zero-point state that only fed
quantizers is removed from the graph, the signature, the state dict and the constants. What a
quantizer *is* (bits, grid, axis, where its values live) goes to the :class:`QuantMap`; what its
values *are* is read later by :func:`collect_qvalues` (DESIGN.md, invariant 5).

Recognisers are pluggable: :func:`register_recognizer` adds one for a custom quantizer op. An
op that looks like a quantizer and that no recogniser matches is an
:class:`~graphbuild.errors.UnknownQuantizerError`: silently leaving it in the graph would
export a wrong model.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputSpec,
    TensorArgument,
)
from torch.fx import Graph, Node

from graphbuild.errors import ExportError, UnknownQuantizerError
from graphbuild.frontend.markers import MARKER_TARGET, is_marker
from graphbuild.frontend.quantmap import QParams, QuantMap, QuantSpec, QuantValues, ValueRef

__all__ = [
    "CachemaskRecognizer",
    "FakeQuantRecognizer",
    "Match",
    "QDQPairRecognizer",
    "Recognizer",
    "collect_qvalues",
    "get_arg",
    "grid_bits",
    "input_spec",
    "int_arg",
    "looks_like_quantizer",
    "normalize_program",
    "op_name",
    "recognizers",
    "register_recognizer",
    "unregister_recognizer",
    "value_ref",
]

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER)
_REMOVABLE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


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


def _op_parts(target: Any) -> tuple[str, str, str] | None:
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
_VALUE_HELPERS = _PASS_THROUGH | {"full", "scalar_tensor", "zeros", "zeros_like"}


def _aten_name(target: Any) -> str | None:
    parts = _op_parts(target)
    return parts[1] if parts is not None and parts[0] == "aten" else None


def _origin(arg: Any) -> Any:
    """``arg`` with pass-through ops (``lift_fresh_copy``, ``detach``...) looked through."""
    while (
        isinstance(arg, Node)
        and arg.op == "call_function"
        and _aten_name(arg.target) in _PASS_THROUGH
        and arg.args
    ):
        arg = arg.args[0]
    return arg


def _is_zeros(arg: Any) -> bool:
    origin = _origin(arg)
    if isinstance(origin, Node) and origin.op == "call_function":
        return _aten_name(origin.target) in ("zeros", "zeros_like")
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
    maker = _aten_name(origin.target) if origin.op == "call_function" else None
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
    value = _stored_tensor(program, ref, None)
    return int(value.item()) if value.numel() == 1 else None


def _param_of(program: ExportedProgram, node: Node) -> str | None:
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
        parts = _op_parts(node.target) if node.op == "call_function" else None
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
        parts = _op_parts(node.target) if node.op == "call_function" else None
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
        parts = _op_parts(dq.target) if dq.op == "call_function" else None
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


# --------------------------------------------------------------------------------------------
# Finding quantizers
# --------------------------------------------------------------------------------------------

_ATEN_QUANT_PREFIXES = ("quantize_per", "dequantize", "_make_per", "choose_qparams")


def looks_like_quantizer(target: Any) -> bool:
    """Whether an op target looks like a quantization op (by namespace and name)."""
    parts = _op_parts(target)
    if parts is None:
        return False
    namespace, name, _ = parts
    name = name.split("::")[-1]
    if namespace == "graphbuild":
        return False
    if namespace in ("quantized_decomposed", "quantized"):
        return True
    if namespace == "aten":
        return "fake_quant" in name or name.startswith(_ATEN_QUANT_PREFIXES)
    return any(word in name for word in ("quantize", "fake_quant", "qparams"))


def _unknown(node: Node, where: str = "") -> UnknownQuantizerError:
    name = op_name(node.target)
    hint = ""
    if "dequantize" in name:
        hint = (
            " A lone dequantize usually means folded (integer) weights: convert with"
            " convert_pt2e(..., fold_quantize=False)."
        )
    return UnknownQuantizerError(
        f"no normalize recogniser matches quantization op '{name}' at node '{node.name}'"
        f"{where}. The built-in ones need scale, zero point and grid to be literals,"
        " parameters, buffers or constants, and every user of a quantize to be a dequantize"
        " with the same arguments." + hint + " To support another form, register a recogniser:"
        " graphbuild.frontend.normalize.register_recognizer(r), r.match(node, program) returning"
        " a Match."
    )


def _check_match(recognizer: Recognizer, node: Node, m: Match, taken: set[Node]) -> None:
    problem = ""
    if node not in m.replaces:
        problem = "replaces does not contain the matched node"
    elif m.input in m.replaces:
        problem = "the input is one of the replaced nodes"
    elif any(n.op != "call_function" or n in taken for n in m.replaces):
        problem = "a replaced node is not an op call or belongs to another quantizer"
    if problem:
        raise ExportError(
            f"recogniser {recognizer!r} returned a bad match at '{node.name}': {problem}"
        )


def _first_match(node: Node, program: ExportedProgram, taken: set[Node]) -> Match | None:
    for recognizer in _registry:
        m = recognizer.match(node, program)
        if m is not None:
            _check_match(recognizer, node, m, taken)
            return m
    return None


def _find_matches(program: ExportedProgram) -> list[tuple[Node, Match]]:
    """Recognised quantizers (matched node, match) in graph order; raises on an unrecognised
    quantization op."""
    matches: list[tuple[Node, Match]] = []
    taken: set[Node] = set()
    suspects: list[Node] = []
    for node in program.graph.nodes:
        if node in taken or node.op != "call_function":
            continue
        if is_marker(node):
            raise ExportError(f"program is already normalized (marker node '{node.name}')")
        m = _first_match(node, program, taken)
        if m is None:
            if looks_like_quantizer(node.target):
                suspects.append(node)
            continue
        taken.update(m.replaces)
        matches.append((node, m))
    for node in suspects:  # a later match (anchored further down) may have taken it
        if node not in taken:
            raise _unknown(node)
    _check_subgraphs(program)
    return matches


def _check_subgraphs(program: ExportedProgram) -> None:
    for name, module in program.graph_module.named_modules():
        if name and isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function" and looks_like_quantizer(node.target):
                    raise _unknown(node, f" inside subgraph '{name}' (only the top-level graph)")


# --------------------------------------------------------------------------------------------
# Rewriting
# --------------------------------------------------------------------------------------------


def _copy_graph(graph: Graph) -> tuple[Graph, dict[Node, Node]]:
    """A node-for-node copy (names kept; meta dicts copied, their values shared) and the map
    from each node of ``graph`` to its copy.

    ``Graph.graph_copy`` renames nodes whose name shadows a builtin (a placeholder ``input``
    becomes ``input_1``); the original names are put back, as ``torch.export`` itself names
    nodes, so the signature, the module call graph and the graph text keep matching.
    """
    new = Graph()
    val_map: dict[Node, Node] = {}
    result = new.graph_copy(graph, val_map, return_output_node=True)
    assert result is not None
    out_value, out_node = result  # type: ignore[misc]
    output = new.output(out_value, type_expr=out_node.type)
    output.meta = copy.copy(out_node.meta)
    val_map[out_node] = output
    _restore_names(new, val_map)
    return new, val_map


def _restore_names(graph: Graph, val_map: Mapping[Node, Node]) -> None:
    """Give every copy in ``val_map`` its original's name. The originals' names are unique,
    so the copies' are too once all are restored; the namespace records them so nodes
    created later (markers) cannot take one."""
    namespace = graph._graph_namespace
    for old, new in val_map.items():
        if new.name != old.name:
            new.name = old.name
            if new.op == "placeholder" and new.target != old.target:
                new.target = old.target
        namespace._rename_object(new, old.name)
    names = [n.name for n in graph.nodes]
    if len(set(names)) != len(names):  # cannot happen for a valid graph; never emit one
        raise ExportError("graph copy produced duplicate node names")


_MARKER_META = ("val", "tensor_meta", "nn_module_stack", "stack_trace", "source_fn_stack")


def _insert_marker(graph: Graph, qid: int, x: Node, nodes: list[Node], outputs: list[Node]) -> Node:
    """Insert ``q(x, qid)`` before the first output, rewire the users the replaced ``nodes``
    have outside themselves to it and erase them. Returns the marker."""
    group = set(nodes)
    anchor = outputs[0] if outputs else nodes[-1]
    with graph.inserting_before(anchor):
        marker = graph.call_function(MARKER_TARGET, (x, qid))
    marker.meta.update({k: anchor.meta[k] for k in _MARKER_META if k in anchor.meta})
    for n in outputs:
        n.replace_all_uses_with(marker, delete_user_cb=lambda user: user not in group)
    for n in reversed(nodes):
        graph.erase_node(n)
    return marker


def _apply_matches(graph: Graph, matches: list[Match], val_map: dict[Node, Node]) -> dict[str, str]:
    """Replace each match (found on the original graph) in the copy ``graph``; returns the
    name of each rewired quantizer output -> the name of its marker."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    erased: set[Node] = set()
    superseded: dict[Node, Node] = {}  # output of an earlier quantizer -> its marker
    for qid, m in enumerate(matches):
        nodes = sorted((val_map[n] for n in m.replaces), key=order.__getitem__)
        group = set(nodes)
        outputs = [n for n in nodes if any(u not in group for u in n.users)]
        x = val_map[m.input]
        if x in erased:
            if x not in superseded:
                raise ExportError(f"quantizer {qid} reads a node inside another quantizer")
            x = superseded[x]
        elif order[x] > order[outputs[0] if outputs else nodes[-1]]:
            raise ExportError(f"quantizer {qid}: input '{x.name}' comes after its output")
        marker = _insert_marker(graph, qid, x, nodes, outputs)
        erased.update(nodes)
        superseded.update(dict.fromkeys(outputs, marker))
    return {n.name: marker.name for n, marker in superseded.items()}


def _drop_dead_helpers(graph: Graph, origin: Mapping[Node, Node]) -> None:
    """Erase value helper ops (copies of lifted constants, ``full``...) left without users.
    ``origin`` maps each copied node to the program's node it copies."""
    for node in reversed(list(graph.nodes)):
        if (
            node.op == "call_function"
            and not node.users
            and node in origin
            and origin[node].users
            and _aten_name(node.target) in _VALUE_HELPERS
        ):
            graph.erase_node(node)


def _drop_unused_state(
    graph: Graph, program: ExportedProgram, origin: Mapping[Node, Node]
) -> set[str]:
    """Erase parameter/buffer/constant placeholders that lost all their users; the names of
    the program's placeholders they copied (the names its signature uses)."""
    mutated = {s.target for s in program.graph_signature.output_specs if s.target is not None}
    removed: set[str] = set()
    for node in list(graph.find_nodes(op="placeholder")):
        old = origin.get(node)
        spec = input_spec(program, old) if old is not None else None
        if node.users or old is None or not old.users or spec is None:
            continue
        if spec.kind in _REMOVABLE_KINDS and spec.target not in mutated:
            graph.erase_node(node)
            removed.add(old.name)
    return removed


def _renamed_arg(arg: Any, name: str) -> Any:
    """A copy of a signature argument, named ``name`` when it has a name."""
    arg = copy.copy(arg)
    if isinstance(getattr(arg, "name", None), str):
        arg.name = name
    return arg


def _new_signature(
    program: ExportedProgram, graph: Graph, removed: set[str], val_map: Mapping[Node, Node]
) -> ExportGraphSignature:
    """The signature without removed inputs, every input and output named after the node of
    ``graph`` it now refers to (``val_map``: the program's nodes -> their copies)."""
    sig = program.graph_signature
    placeholders = {n.name: val_map[n] for n in program.graph.find_nodes(op="placeholder")}
    inputs: list[InputSpec] = []
    for spec in sig.input_specs:
        name = getattr(spec.arg, "name", None)
        if name in removed:
            continue
        node = placeholders.get(name) if isinstance(name, str) else None
        arg = _renamed_arg(spec.arg, node.name) if node is not None else copy.copy(spec.arg)
        inputs.append(replace(spec, arg=arg))
    outs = graph.output_node().args[0]
    outputs: list[OutputSpec] = []
    for spec, value in zip(sig.output_specs, outs, strict=True):
        arg = copy.copy(spec.arg)
        if isinstance(arg, TensorArgument) and isinstance(value, Node):
            arg = TensorArgument(name=value.name)
        outputs.append(replace(spec, arg=arg))
    return ExportGraphSignature(input_specs=inputs, output_specs=outputs)


def _module_call_graph(program: ExportedProgram, renames: Mapping[str, str]) -> list:
    entries = copy.deepcopy(program.module_call_graph)
    for entry in entries:
        if entry.signature is None:
            continue
        for arg in (*entry.signature.inputs, *entry.signature.outputs):
            if getattr(arg, "name", None) in renames:
                arg.name = renames[arg.name]
    return entries


def _rebuild(
    program: ExportedProgram,
    graph: Graph,
    removed: set[str],
    renames: Mapping[str, str],
    val_map: Mapping[Node, Node],
) -> ExportedProgram:
    """A valid ExportedProgram over ``graph``, sharing the original's tensors. The
    constructor runs torch's verifier (signature, state dict, module call graph)."""
    signature = _new_signature(program, graph, removed, val_map)
    kept = {s.target for s in signature.input_specs if s.target is not None}
    gone = {
        s.target
        for s in program.graph_signature.input_specs
        if getattr(s.arg, "name", None) in removed and s.target not in kept
    }
    return ExportedProgram(
        root=program.graph_module,
        graph=graph,
        graph_signature=signature,
        state_dict={k: v for k, v in program.state_dict.items() if k not in gone},
        range_constraints=copy.deepcopy(program.range_constraints),
        module_call_graph=_module_call_graph(program, renames),
        example_inputs=program.example_inputs,
        constants={k: v for k, v in program.constants.items() if k not in gone},
        verifiers=program.verifiers,
    )


def _spec(qid: int, anchor: Node, m: Match, program: ExportedProgram) -> QuantSpec:
    return QuantSpec(
        qid=qid,
        bits=m.bits,  # type: ignore[arg-type]
        signed=m.signed,  # type: ignore[arg-type]
        qmin=m.qmin,
        qmax=m.qmax,
        axis=m.axis,
        block_size=m.block_size,
        param=_param_of(program, m.input),
        op=m.op,
        node=anchor.name,
        scale=m.scale,
        zero_point=m.zero_point,
        symmetric=m.symmetric,
    )


def normalize_program(program: ExportedProgram) -> tuple[ExportedProgram, QuantMap]:
    """Replace every quantizer of ``program`` with a ``graphbuild::q`` marker.

    Returns a new program (``program`` is left untouched; tensors are shared, not copied) and
    the quant map, qids numbered 0..n-1 in graph order. Parameters, buffers and constants that
    only fed quantizers are dropped from the graph, signature, state dict and constants.
    """
    matches = _find_matches(program)
    specs = (_spec(qid, anchor, m, program) for qid, (anchor, m) in enumerate(matches))
    qmap = QuantMap(tuple(specs))
    graph, val_map = _copy_graph(program.graph)
    markers = _apply_matches(graph, [m for _, m in matches], val_map)
    # the program's node names -> the names they have in the result
    renames = {old.name: markers.get(new.name, new.name) for old, new in val_map.items()}
    renames = {old: new for old, new in renames.items() if old != new}
    origin = {new: old for old, new in val_map.items()}
    _drop_dead_helpers(graph, origin)
    removed = _drop_unused_state(graph, program, origin)
    graph.lint()
    return _rebuild(program, graph, removed, renames, val_map), qmap


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------


def _stored_tensor(
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


def _literal(ref: ValueRef, nodes: Mapping[str, Node]) -> torch.Tensor:
    node_name, _, index = ref.name.rpartition(":")
    node = nodes.get(node_name)
    value = get_arg(node, int(index)) if node is not None else None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ExportError(f"literal quantizer value '{ref.name}' not found in the program")
    dtype = torch.int64 if isinstance(value, int) else torch.float64
    if _aten_name(node.target) == "full":  # a literal made into a tensor: keep its shape
        return torch.full(tuple(get_arg(node, 0)), value, dtype=dtype)
    return torch.tensor([value], dtype=dtype)


def _resolve(
    ref: ValueRef,
    program: ExportedProgram,
    nodes: Mapping[str, Node],
    state: Mapping[str, torch.Tensor] | None,
) -> torch.Tensor:
    if ref.kind == "literal":
        return _literal(ref, nodes)
    if ref.kind in ("state", "constant"):
        return _stored_tensor(program, ref, state).detach()
    raise ExportError(f"unknown value kind '{ref.kind}' for '{ref.name}'")


def _qparams(spec: QuantSpec, resolve: Callable[[ValueRef], torch.Tensor]) -> QParams:
    if spec.scale is None:
        raise ExportError(f"quantizer {spec.qid} has no scale source")
    scale = resolve(spec.scale).to(torch.float32)
    if spec.zero_point is None:
        zero_point = torch.zeros(scale.shape, dtype=torch.int64)
    else:
        zero_point = resolve(spec.zero_point)
        if zero_point.is_floating_point():  # learnable fake-quant: rounded, clamped as ATen does
            zero_point = zero_point.round().clamp(spec.qmin, spec.qmax)
        zero_point = zero_point.to(torch.int64)
    if spec.block_size is None:
        scale, zero_point = scale.reshape(-1), zero_point.reshape(-1)
    return QParams(scale.clone(), zero_point.clone())


def _ref_key(ref: ValueRef) -> str:
    return f"{ref.kind}:{ref.name}"


def fixed_values(program: ExportedProgram, qmap: QuantMap) -> dict[str, torch.Tensor]:
    """The quantizer values written into the graph itself (literals, lifted constants), by
    ``kind:name``: part of the code, so a stage can carry them without the program."""
    nodes = {n.name: n for n in program.graph.nodes}
    refs = [r for s in qmap for r in (s.scale, s.zero_point) if r is not None]
    return {
        _ref_key(r): _resolve(r, program, nodes, None).clone() for r in refs if r.kind != "state"
    }


def qvalues_from(
    qmap: QuantMap, fixed: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]
) -> QuantValues:
    """Scales and zero points from the model's state (parameters and buffers, by name) and
    the values :func:`fixed_values` took from the graph."""

    def resolve(ref: ValueRef) -> torch.Tensor:
        if ref.kind != "state":
            return fixed[_ref_key(ref)]
        if ref.name not in state:
            raise ExportError(
                f"the model has no parameter or buffer '{ref.name}' holding a quantizer value"
            )
        return state[ref.name].detach()

    return QuantValues({s.qid: _qparams(s, resolve) for s in qmap})


def collect_qvalues(
    program: ExportedProgram,
    qmap: QuantMap,
    state: Mapping[str, torch.Tensor] | None = None,
) -> QuantValues:
    """Scales (float32) and zero points (int64) of every quantizer in ``qmap``.

    ``program`` is the program *before* normalization (literals live in its nodes). ``state``,
    when given, supplies parameters and buffers instead of ``program.state_dict``.
    """
    nodes = {n.name: n for n in program.graph.nodes}
    return QuantValues(
        {s.qid: _qparams(s, lambda ref: _resolve(ref, program, nodes, state)) for s in qmap}
    )
