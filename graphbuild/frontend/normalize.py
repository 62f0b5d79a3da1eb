"""normalize: replace every quantizer in an exported program with one marker op.

Each recognised quantizer (a fake-quant node, or a quantize node with its dequantize users)
becomes ``graphbuild::q(x, qid)``. The result is a *marker graph* that carries no quantizer
values: literal scales vanish with their nodes, and scale/zero-point state that only fed
quantizers is removed from the graph, the signature, the state dict and the constants. What a
quantizer *is* (bits, grid, axis, where its values live) goes to the :class:`QuantMap`; what its
values *are* is read later by :mod:`graphbuild.frontend.qvalues` (docs/design.md, invariant 5).

What counts as a quantizer is up to the recognisers (:mod:`graphbuild.frontend.recognizers`,
pluggable with :func:`register_recognizer`). An op that looks like a quantizer and that no
recogniser matches is an :class:`~graphbuild.errors.UnknownQuantizerError`: silently leaving
it in the graph would export a wrong model. This module is the graph surgery; the recogniser
and value names it re-exports keep their old import path.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

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

from graphbuild.compat import new_program
from graphbuild.errors import ExportError, UnknownQuantizerError
from graphbuild.frontend.qvalues import collect_qvalues, fixed_values, qvalues_from
from graphbuild.frontend.recognizers import (
    VALUE_HELPERS,
    CachemaskRecognizer,
    FakeQuantRecognizer,
    Match,
    QDQPairRecognizer,
    Recognizer,
    aten_name,
    get_arg,
    grid_bits,
    input_spec,
    int_arg,
    op_name,
    op_parts,
    param_of,
    recognizers,
    register_recognizer,
    unregister_recognizer,
    value_ref,
)
from graphbuild.quant.markers import MARKER_TARGET, is_marker
from graphbuild.quant.quantmap import QuantMap, QuantSpec

__all__ = [
    "CachemaskRecognizer",
    "FakeQuantRecognizer",
    "Match",
    "QDQPairRecognizer",
    "Recognizer",
    "collect_qvalues",
    "find_quantizers",
    "fixed_values",
    "get_arg",
    "grid_bits",
    "input_spec",
    "int_arg",
    "looks_like_quantizer",
    "normalize_program",
    "op_name",
    "qvalues_from",
    "recognizers",
    "register_recognizer",
    "relabel_markers",
    "unregister_recognizer",
    "value_ref",
]

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER)
_REMOVABLE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


# --------------------------------------------------------------------------------------------
# Finding quantizers
# --------------------------------------------------------------------------------------------

_ATEN_QUANT_PREFIXES = ("quantize_per", "dequantize", "_make_per", "choose_qparams")


def looks_like_quantizer(target: Any) -> bool:
    """Whether an op target looks like a quantization op (by namespace and name)."""
    parts = op_parts(target)
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
    for recognizer in recognizers():
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
            and aten_name(node.target) in VALUE_HELPERS
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
    return new_program(
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
        param=param_of(program, m.input),
        op=m.op,
        node=anchor.name,
        scale=m.scale,
        zero_point=m.zero_point,
        symmetric=m.symmetric,
        block_scale_bits=m.block_scale_bits,
        channel_axis=m.channel_axis,
    )


def find_quantizers(program: ExportedProgram) -> list[Match]:
    """Every quantizer of ``program`` as its recogniser matched it; the list index is the qid
    :func:`normalize_program` gives it."""
    return [m for _, m in _find_matches(program)]


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


def relabel_markers(program: ExportedProgram, qids: Mapping[int, int | None]) -> ExportedProgram:
    """A copy of a program whose markers carry placement site numbers, with each marker
    ``q(x, site)`` replaced by a fresh ``q(x, qids[site])`` (named as :func:`normalize_program`
    names its markers), or removed where ``qids[site]`` is None (a quantizer calibration
    left float). ``program`` is left untouched; tensors are shared."""
    graph, val_map = _copy_graph(program.graph)
    renames: dict[str, str] = {}
    for node in list(graph.nodes):
        if not is_marker(node):
            continue
        x, site = node.args
        if not isinstance(site, int) or site not in qids:
            raise ExportError(f"marker '{node.name}' has site {site!r}, which the placement lacks")
        qid = qids[site]
        if qid is None:
            node.replace_all_uses_with(x)
            renames[node.name] = x.name
        else:
            with graph.inserting_before(node):
                marker = graph.call_function(MARKER_TARGET, (x, qid))
            marker.meta.update({k: node.meta[k] for k in _MARKER_META if k in node.meta})
            node.replace_all_uses_with(marker)
            renames[node.name] = marker.name
        graph.erase_node(node)
    renames = {old.name: renames.get(new.name, new.name) for old, new in val_map.items()}
    renames = {old: new for old, new in renames.items() if old != new}
    graph.lint()
    return _rebuild(program, graph, set(), renames, val_map)
