"""ExportedProgram artifacts: structure-only programs and their codec.

A captured program's graph depends on structure only; its weights are the model's. So the
program stored in the cache holds the graph (torch's own JSON serialization, no pickle) and
the lifted constants, while parameters and buffers are zero-stride placeholders of the right
shape and dtype, filled from the model by name when a stage needs values. A program that
carries values (PT2E output) stores its state as raw tensors.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from graphbuild.compat import deserialize_program, program_with_state, serialize_program_graph
from graphbuild.engine.codecs import (
    Codec,
    Encoded,
    Part,
    TensorDictCodec,
    register_codec,
    tensor_token,
    tensor_tokens,
)
from graphbuild.errors import CodecError
from graphbuild.hashing import digest_bytes, digest_json
from graphbuild.quant import markers  # noqa: F401  - registers graphbuild::q for deserialization

__all__ = [
    "ProgramArtifact",
    "placeholder",
    "placeholder_like",
    "lifted_runner",
    "state_specs",
    "strip_state",
    "with_state",
]


@dataclass(frozen=True)
class ProgramArtifact:
    """An ExportedProgram as a stage output; ``has_state`` says whether its parameters and
    buffers are real values or placeholders. ``notes`` is what the stage that made it tells
    later stages (JSON: which tensors calibration left float, and why)."""

    program: ExportedProgram
    has_state: bool = False
    notes: Mapping[str, Any] = field(default_factory=dict)


def placeholder(shape: Sequence[int], dtype: torch.dtype, parameter: bool) -> torch.Tensor:
    """A zero-stride tensor of this shape and dtype: costs one element of memory."""
    base = torch.zeros((), dtype=dtype).expand(tuple(shape))
    return torch.nn.Parameter(base, requires_grad=False) if parameter else base


def placeholder_like(t: torch.Tensor, parameter: bool) -> torch.Tensor:
    return placeholder(t.shape, t.dtype, parameter)


def state_specs(program: ExportedProgram) -> list[tuple[str, bool]]:
    """(state name, is parameter) for every parameter and buffer input of the program."""
    out = []
    for spec in program.graph_signature.input_specs:
        if (
            spec.kind in (InputKind.PARAMETER, InputKind.BUFFER)
            and spec.target in program.state_dict
        ):
            out.append((spec.target, spec.kind == InputKind.PARAMETER))
    return out


def strip_state(program: ExportedProgram) -> ExportedProgram:
    """A copy of ``program`` (sharing its graph) whose state dict holds placeholders only."""
    return program_with_state(
        program,
        {
            name: placeholder_like(program.state_dict[name], is_param)
            for name, is_param in state_specs(program)
        },
    )


def with_state(program: ExportedProgram, state: Mapping[str, torch.Tensor]) -> ExportedProgram:
    """A copy of a structure-only ``program`` (sharing its graph) whose parameters and
    buffers are the tensors of ``state`` (by FQN), for back ends that need real values in the
    program."""
    values = {}
    for name, is_param in state_specs(program):
        if name not in state:
            raise CodecError(f"the model has no tensor '{name}' that the program needs")
        value = state[name].detach()
        expected = program.state_dict[name]
        if value.shape != expected.shape or value.dtype != expected.dtype:
            raise CodecError(
                f"state '{name}' is {value.dtype}{list(value.shape)}; the program expects "
                f"{expected.dtype}{list(expected.shape)}"
            )
        values[name] = torch.nn.Parameter(value, requires_grad=False) if is_param else value
    return program_with_state(program, values)


def lifted_runner(
    program: ExportedProgram,
    replace: Mapping[Any, Callable[..., Any]] | None = None,
    *,
    keep: bool = True,
) -> Callable[..., Any]:
    """A function of positional arguments that runs ``program`` (with real state) as
    ``program.module()`` would, each call target in ``replace`` swapped for its function,
    and returns its outputs flat (a list). ``keep``: keep the copy of the graph for the next
    call with the same replacements (functions that outlive the call, not closures over
    one run's values).

    The program's own graph runs, on a copy of the graph where there is something to
    replace, with its parameters, buffers and constants passed as the inputs the graph lifted
    them to: no unlifting (a deep copy of the program and a recompile, 20x a small model's
    forward pass). A program that mutates a buffer or an input, or threads effect tokens,
    runs unlifted: there the module applies the mutations between calls."""
    sig = program.graph_signature
    plain = (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT)
    state = []
    for s in sig.input_specs:
        if s.kind == InputKind.USER_INPUT:
            state.append(None)
        elif s.kind in (InputKind.PARAMETER, InputKind.BUFFER) and s.target in program.state_dict:
            state.append(program.state_dict[s.target])
        elif s.kind != InputKind.TOKEN and s.target in program.constants:
            state.append(program.constants[s.target])  # constants, non-persistent buffers
        else:
            return _unlifted(program, replace)
    if any(o.kind not in plain for o in sig.output_specs):
        return _unlifted(program, replace)
    module = _replaced(program.graph_module, replace, keep) if replace else program.graph_module
    in_spec = program.call_spec.in_spec
    expected = _user_input_shapes(program)

    def run(*args: Any) -> Any:
        flat, spec = torch.utils._pytree.tree_flatten((args, {}))
        if in_spec is not None and spec != in_spec:
            raise CodecError(f"the program takes arguments {in_spec}, not {spec}")
        _check_shapes(flat, expected)
        user = iter(flat)
        return list(module(*[next(user) if v is None else v for v in state]))

    return run


def _user_input_shapes(program: ExportedProgram) -> list[Any]:
    """Each user input as the program was traced: ``("tensor", shape)`` (an int where the
    dimension is static, None where it is symbolic), ``("value", v)`` for an int, float,
    bool or string the trace specialized on, None where nothing is known."""
    user = {
        s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT
    }
    traced: list[Any] = []
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in user:
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            traced.append(("tensor", tuple(d if isinstance(d, int) else None for d in val.shape)))
        elif isinstance(val, (bool, int, float, str)):
            traced.append(("value", val))
        else:
            traced.append(None)
    return traced


def _check_shapes(flat: list[Any], traced: list[Any]) -> None:
    """The guards ``program.module()`` runs: a static dimension must match its trace (the
    graph's reshapes are specialized to it), and so must a constant input, else a clear
    error instead of a run on other values than it was given."""
    for position, (value, expected) in enumerate(zip(flat, traced, strict=False)):
        if expected is None:
            continue
        kind, want = expected
        if kind == "value":
            if type(value) is not type(want) or value != want:
                raise CodecError(
                    f"input {position} is {value!r}; the program was traced for {want!r} "
                    "(a constant of the trace): give that value, or export again with this one"
                )
            continue
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() != len(want) or any(
            d is not None and d != v for d, v in zip(want, value.shape, strict=True)
        ):
            shown = [d if d is not None else "*" for d in want]
            dynamic = " (* a dynamic dimension)" if None in want else ""
            raise CodecError(
                f"input {position} has shape {list(value.shape)}; the program was traced "
                f"for {shown}{dynamic}: give inputs of the traced shape (the sample inputs'; "
                "only a target that takes dynamic dimensions can trace others)"
            )


def _replaced(
    module: torch.fx.GraphModule, replace: Mapping[Any, Callable[..., Any]], keep: bool
) -> torch.fx.GraphModule:
    """A copy of ``module`` calling ``replace``'s functions; with ``keep``, kept while
    ``module`` lives and its code is what it was, so a program decoded once per process
    (``_DECODED``) is copied and compiled once for the same replacements."""
    key = (id(module), tuple((id(k), id(v)) for k, v in replace.items()))
    kept = _REPLACED.get(key) if keep else None
    if kept is not None and kept[0]() is module and kept[1] == module.code:
        _REPLACED.move_to_end(key)
        return kept[2]
    graph = torch.fx.Graph()
    out = graph.graph_copy(module.graph, {})
    graph.output(out)
    _retarget(graph, replace)
    copy = torch.fx.GraphModule(module, graph)
    if keep:
        _REPLACED[key] = (weakref.ref(module), module.code, copy)
        while len(_REPLACED) > _KEEP_DECODED:
            _REPLACED.popitem(last=False)
    return copy


# (id of the module, ids of the replacements) -> (module, its code, the copy)
_REPLACED: OrderedDict[tuple, tuple[Any, str, torch.fx.GraphModule]] = OrderedDict()


def _unlifted(
    program: ExportedProgram, replace: Mapping[Any, Callable[..., Any]] | None
) -> Callable[..., Any]:
    module = program.module()
    if replace:
        _retarget(module.graph, replace)
        module.recompile()
    return lambda *args: torch.utils._pytree.tree_flatten(module(*args))[0]


def _retarget(graph: torch.fx.Graph, replace: Mapping[Any, Callable[..., Any]]) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and node.target in replace:
            node.target = replace[node.target]


_VOLATILE_META = ("stack_trace", "from_node", "seq_nr")


def _all_nodes(program: ExportedProgram) -> list[torch.fx.Node]:
    """Every node of the program, in the graphs of higher-order ops too (a ``torch.no_grad``
    block, a ``cond``): their metadata is serialized like the top graph's."""
    return [
        node
        for module in program.graph_module.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    ]


def strip_stack_traces(program: ExportedProgram) -> None:
    """Drop node metadata that is not the graph: source locations (a moved comment must not
    change the artifact) and provenance that holds Python object ids (differs per process)."""
    for node in _all_nodes(program):
        for key in _VOLATILE_META:
            node.meta.pop(key, None)


@contextlib.contextmanager
def _without_volatile_meta(program: ExportedProgram) -> Iterator[None]:
    """The program without volatile metadata for the time of the block, then as it was:
    encoding a value never changes it."""
    held = []
    for node in _all_nodes(program):
        for key in _VOLATILE_META:
            if key in node.meta:
                held.append((node, key, node.meta.pop(key)))
    try:
        yield
    finally:
        for node, key, value in held:
            node.meta[key] = value


def program_token(program: ExportedProgram) -> Any:
    """A token of what the stored program holds: every node with the metadata torch's
    serializer keeps (``custom``, ``nn_module_stack``, ``val``, ...), the signature, and the
    contents of its tensors. Equal before and after a stage runs unless the stage edited
    the program in place; compared within one process only."""
    nodes = [
        (
            node.name,
            node.op,
            str(node.target),
            repr(torch.fx.node.map_arg(node.args, lambda a: a.name)),
            repr(torch.fx.node.map_arg(node.kwargs, lambda a: a.name)),
            _meta_form({k: v for k, v in node.meta.items() if k not in _VOLATILE_META}),
        )
        for node in _all_nodes(program)
    ]
    named = [
        (name, t)
        for source in (program.state_dict, program.constants)
        for name, t in source.items()
        if isinstance(t, torch.Tensor)
    ]
    tensors = list(zip([n for n, _ in named], tensor_tokens([t for _, t in named]), strict=True))
    return [
        nodes,
        sorted(tensors, key=lambda nt: nt[0]),
        repr(program.graph_signature),
        repr(program.range_constraints),
        repr(program.module_call_graph),
        id(program.graph_module),
    ]


def _meta_form(value: Any, depth: int = 0) -> Any:
    """Node metadata as plain values to compare: tensors (fake ones) by dtype and shape."""
    if depth > 8:
        return repr(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), str(list(value.shape)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_meta_form(v, depth + 1) for v in value))
    if isinstance(value, dict):
        return ("dict", *((repr(k), _meta_form(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return repr(value)


#: Structure-only programs decoded in this process, by content: a tuning loop loads the same
#: placed program for every recalibration, and torch's deserializer takes seconds on a
#: decoder. One is handed out again only while it holds what it was decoded with (its
#: snapshot token), so a stage that edited one in place (an error) cannot leak the edit.
_DECODED: OrderedDict[str, tuple[ProgramArtifact, Any]] = OrderedDict()
_KEEP_DECODED = 4


class ProgramCodec(Codec):
    name = "exported_program"
    types = (ProgramArtifact,)

    def encode(self, value: ProgramArtifact) -> Encoded:
        program = value.program
        with _without_volatile_meta(program):
            graph = serialize_program_graph(program)
        constants = _tensor_constants(program.constants)
        specs = state_specs(program)
        meta = {
            "has_state": value.has_state,
            "state": [
                [
                    name,
                    is_param,
                    str(program.state_dict[name].dtype).removeprefix("torch."),
                    list(program.state_dict[name].shape),
                ]
                for name, is_param in specs
            ],
        }
        if value.notes:
            meta["notes"] = json.loads(json.dumps(value.notes, sort_keys=True))
        tensors = TensorDictCodec()
        children = [
            tensors.encode(constants) if constants else Encoded("json", None, [Part(b"{}")])
        ]
        if value.has_state:
            children.append(tensors.encode({n: program.state_dict[n] for n, _ in specs}))
        return Encoded(self.name, meta, [Part(graph)], children)

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        constants = children[0] if isinstance(children[0], dict) and children[0] else {}
        if meta["has_state"]:  # a program carrying weights: never kept
            return self._decode(meta, parts[0], constants, children)
        key = digest_json(
            [
                meta,
                digest_bytes(parts[0]),
                [[n, *map(str, tensor_token(t))] for n, t in sorted(constants.items())],
            ]
        )
        kept = _DECODED.get(key)
        if kept is not None and program_token(kept[0].program) == kept[1]:
            _DECODED.move_to_end(key)
            return kept[0]
        artifact = self._decode(meta, parts[0], constants, children)
        _DECODED[key] = (artifact, program_token(artifact.program))
        while len(_DECODED) > _KEEP_DECODED:
            _DECODED.popitem(last=False)
        return artifact

    def _decode(
        self, meta: Any, graph: bytes, constants: dict[str, torch.Tensor], children: Sequence[Any]
    ) -> ProgramArtifact:
        if meta["has_state"]:
            real = children[1]
            state = {
                name: torch.nn.Parameter(real[name], requires_grad=False)
                if is_param
                else real[name]
                for name, is_param, _, _ in meta["state"]
            }
        else:
            state = {
                name: placeholder(shape, getattr(torch, dt), p)
                for name, p, dt, shape in meta["state"]
            }
        program = deserialize_program(graph, state, constants)
        return ProgramArtifact(program, meta["has_state"], meta.get("notes", {}))

    def snapshot(self, value: ProgramArtifact) -> Any:
        return program_token(value.program)


def _tensor_constants(constants: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in constants.items():
        if not isinstance(value, torch.Tensor):
            raise CodecError(
                f"the program holds a non-tensor constant '{name}' ({type(value).__name__}); "
                "graphbuild can cache tensor constants only"
            )
        out[name] = value
    return out


register_codec(ProgramCodec())
