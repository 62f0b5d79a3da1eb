"""``to_onnx``: a structure-only ONNX skeleton of an exported program.

The skeleton holds the graph, the lifted tensor constants (code, not state) and, for every
parameter and buffer, a *data-less* external reference (location :data:`STATE_LOCATION`,
initializer name = the state tensor's fully qualified name) that :func:`graphbuild.onnx.bind.bind`
fills later. Weights never enter the skeleton, so retuning weights or quantizer values never
re-runs the exporter (docs/design.md, invariant 5).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx
import onnx_ir as ir
import torch
from onnx_ir import tensor_adapters
from torch.utils import _pytree as pytree

from graphbuild.compat import onnx_registry_reused
from graphbuild.errors import ExportError, SkeletonValueError
from graphbuild.onnx.naming import fresh_name
from graphbuild.onnx.passes import drop_zero_biases, fold_constant_casts, split_sequences
from graphbuild.onnx.rmsnorm import name_rms_norms, translation_table
from graphbuild.quant import markers

STATE_LOCATION = "graphbuild:state"
"""External-data location of a skeleton initializer that stands for a parameter or buffer."""

_STACK_TRACE_KEY = "pkg.torch.onnx.stack_trace"
_STATE_KINDS = ("PARAMETER", "BUFFER")
_CONSTANT_KINDS = ("CONSTANT_TENSOR",)


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a program tensor, read from the graph (never from its values)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def export_skeleton(
    program: torch.export.ExportedProgram,
    *,
    opset: int = 21,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> onnx.ModelProto:
    """Convert ``program`` to a deterministic ONNX skeleton without any state data.

    Exported with ``optimize=False``: the exporter's optimizer merges equal-valued initializers
    and folds BatchNorm into Conv, both of which depend on values. Sequence splits become
    ``Split`` and casts of constants are folded (:mod:`graphbuild.onnx.passes`); ``rms_norm``
    is one op at every opset (:mod:`graphbuild.onnx.rmsnorm`).
    """
    model = _torch_export(program, opset)
    name_rms_norms(model.graph)
    split_sequences(model.graph)
    fold_constant_casts(model.graph)
    drop_zero_biases(model.graph)
    state, constants = program_tensors(program)
    check_initializers(model.graph, state, constants)
    _reference_state(model.graph, state)
    _rename_io(model.graph, model.graph.inputs, input_names, "input")
    if output_names is None:
        output_names = default_output_names(program, model.graph)
    _rename_io(model.graph, model.graph.outputs, output_names, "output")
    _strip_stack_traces(model.graph)
    return ir.serde.serialize_model(model)


def _torch_export(program: torch.export.ExportedProgram, opset: int) -> ir.Model:
    with onnx_registry_reused():  # the torchlib registry is built once per opset
        onnx_program = torch.onnx.export(
            program,
            dynamo=True,
            optimize=False,
            verbose=False,
            opset_version=opset,
            custom_translation_table={
                **markers.onnx_translation_table(),
                **translation_table(opset),
            },
        )
    return onnx_program.model


def program_tensors(
    program: torch.export.ExportedProgram,
) -> tuple[dict[str, TensorMeta], set[str]]:
    """The program's state tensors (parameters and buffers, by FQN) and constant names.

    Shapes and dtypes come from the placeholders' fake values, so dummy or zero-stride state
    is never touched.
    """
    vals = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    state: dict[str, TensorMeta] = {}
    constants: set[str] = set()
    for spec in program.graph_signature.input_specs:
        if spec.kind.name in _STATE_KINDS and spec.target is not None:
            val = vals.get(spec.arg.name)
            if isinstance(val, torch.Tensor):
                state[spec.target] = TensorMeta(tuple(val.shape), val.dtype)
        elif spec.kind.name in _CONSTANT_KINDS and spec.target is not None:
            constants.add(spec.target)
    return state, constants


def check_initializers(
    graph: ir.Graph, state: Mapping[str, TensorMeta], constants: set[str]
) -> None:
    """Raise :class:`SkeletonValueError` unless each initializer is a constant or maps
    one-to-one to a state tensor of the same shape and dtype."""
    seen: set[str] = set()
    for name, value in graph.initializers.items():
        if name in constants and name not in state:
            continue
        meta = state.get(name)
        if meta is None:
            raise SkeletonValueError(
                f"ONNX initializer '{name}' maps to no parameter, buffer or constant of the "
                "program: the skeleton would depend on values (an exporter optimization?)."
            )
        if name in seen:
            raise SkeletonValueError(f"state tensor '{name}' backs more than one initializer")
        seen.add(name)
        _check_meta(name, value, meta)


def _check_meta(name: str, value: ir.Value, meta: TensorMeta) -> None:
    shape = tuple(value.shape.numpy()) if value.shape is not None else None
    try:
        dtype = tensor_adapters.from_torch_dtype(meta.dtype)
    except TypeError as exc:
        raise SkeletonValueError(
            f"state tensor '{name}' has unsupported dtype {meta.dtype}"
        ) from exc
    if shape != meta.shape or value.dtype != dtype:
        raise SkeletonValueError(
            f"ONNX initializer '{name}' ({value.dtype}, {shape}) does not match its state "
            f"tensor ({dtype}, {meta.shape}): the skeleton would depend on values."
        )


def _reference_state(graph: ir.Graph, state: Mapping[str, TensorMeta]) -> None:
    """Replace the data of every state initializer by a data-less external reference."""
    for name, value in graph.initializers.items():
        if name not in state:
            continue
        dtype = value.dtype
        shape = ir.Shape(state[name].shape)
        nbytes = math.ceil(dtype.bitwidth * math.prod(shape.numpy()) / 8)
        value.const_value = ir.ExternalTensor(
            location=STATE_LOCATION, offset=0, length=nbytes, dtype=dtype, shape=shape, name=name
        )


def _rename_io(
    graph: ir.Graph, values: Sequence[ir.Value], names: Sequence[str] | None, kind: str
) -> None:
    if names is None:
        return
    names = list(names)
    if len(names) != len(values):
        raise ExportError(
            f"{len(names)} {kind} names given but the graph has {len(values)} {kind}s: "
            f"expected {len(values)} names"
        )
    if len(set(names)) != len(names):
        raise ExportError(f"duplicate {kind} names: {names}")
    taken = _all_names(graph) - {v.name for v in values}
    clash = sorted(set(names) & taken)
    if clash:
        raise ExportError(f"{kind} names {clash} are already used by other graph tensors")
    for value in values:  # free the old names first so a permutation of names works
        value.name = None
    for value, name in zip(values, names, strict=True):
        value.name = name


def default_output_names(
    program: torch.export.ExportedProgram, graph: ir.Graph
) -> list[str] | None:
    """The model's own names for its outputs: ``output`` for a lone tensor, the keys of a
    returned dict or output dataclass (``logits``), ``output_0``... for a tuple. None (the
    exporter's names stay) when the outputs do not line up with the graph's."""
    spec = program.call_spec.out_spec
    if spec is None or spec.num_leaves != len(graph.outputs):
        return None
    leaves = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    paths = [path for path, _ in pytree.tree_flatten_with_path(leaves)[0]]
    names = [_path_name(path) for path in paths]
    taken = _all_names(graph) - {v.name for v in graph.outputs}
    unique: list[str] = []
    for name in names:
        unique.append(fresh_name(name, taken))
    return unique


def _path_name(path: tuple) -> str:
    parts = []
    for key in path:
        if isinstance(key, pytree.MappingKey):
            parts.append(str(key.key))
        elif isinstance(key, pytree.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, pytree.SequenceKey):
            parts.append(str(key.idx))
        else:
            parts.append(str(key))
    if not parts:
        return "output"
    if isinstance(path[0], pytree.SequenceKey):
        parts.insert(0, "output")
    return "_".join(parts) if isinstance(path[0], pytree.SequenceKey) else ".".join(parts)


def _all_names(graph: ir.Graph) -> set[str]:
    names = {v.name for v in graph.inputs} | set(graph.initializers)
    for node in graph:
        names.update(v.name for v in node.outputs)
    names.discard(None)
    return names


def _strip_stack_traces(graph: ir.Graph) -> None:
    for node in ir.traversal.RecursiveGraphIterator(graph):
        node.metadata_props.pop(_STACK_TRACE_KEY, None)
