"""Every use of a private torch API, in one place, each behind a version gate.

graphbuild supports torch 2.10 through 2.15 (``pyproject.toml`` pins that range and CI's compat
matrix tests it). torch's program serializer (``torch._export.serde``) and ExportedProgram's
internals (its ``_state_dict``, its constructor's ``verifiers``) are not public and change
between releases; anything that touches them lives here, so a new torch release means reading
one file. Each gate has a test in ``tests/test_compat.py`` that runs both of its branches on
whichever torch is installed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import re
import threading
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "TORCH_VERSION",
    "deserialize_program",
    "full_float32",
    "new_program",
    "onnx_registry_reused",
    "program_with_state",
    "register_quantized_decomposed_ops",
    "serialize_program_graph",
]


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


#: (major, minor) of the installed torch.
TORCH_VERSION: tuple[int, int] = _release(torch.__version__)


#: The newest release whose ExportedProgram is known to keep its state dict in the
#: ``_state_dict`` attribute behind the ``state_dict`` property (every one from 2.10 does).
_STATE_DICT_ATTRIBUTE_THROUGH = (2, 15)


def program_with_state(
    program: torch.export.ExportedProgram, state: Mapping[str, torch.Tensor]
) -> torch.export.ExportedProgram:
    """A copy of ``program`` whose parameters and buffers are ``state`` (by FQN), sharing its
    graph, signature and constants.

    ExportedProgram has no public setter for its state. Up to torch 2.15 the copy is shallow
    and its ``_state_dict`` replaced (costs nothing); on a later release the program is rebuilt
    through its constructor, which also verifies it."""
    if TORCH_VERSION <= _STATE_DICT_ATTRIBUTE_THROUGH:
        out = copy.copy(program)
        out._state_dict = dict(state)  # noqa: SLF001 - no public setter
        return out
    return new_program(
        root=program.graph_module,
        graph=program.graph,
        graph_signature=program.graph_signature,
        state_dict=dict(state),
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=program.verifiers,
    )


@functools.cache
def _constructor_takes_verifiers() -> bool:
    """``ExportedProgram(..., verifiers=[...])``: every supported release takes the
    program's verifiers (the dialect's checks); a release without the argument verifies with
    its default."""
    return "verifiers" in inspect.signature(torch.export.ExportedProgram).parameters


def new_program(
    *,
    root: torch.nn.Module,
    graph: torch.fx.Graph,
    graph_signature: Any,
    state_dict: Mapping[str, Any],
    range_constraints: Any,
    module_call_graph: Any,
    example_inputs: Any,
    constants: Mapping[str, Any],
    verifiers: Any,
) -> torch.export.ExportedProgram:
    """A new ExportedProgram over ``graph``; the constructor runs torch's verifier (signature,
    state dict, module call graph)."""
    kwargs: dict[str, Any] = {"verifiers": verifiers} if _constructor_takes_verifiers() else {}
    return torch.export.ExportedProgram(
        root=root,
        graph=graph,
        graph_signature=graph_signature,
        state_dict=dict(state_dict),
        range_constraints=range_constraints,
        module_call_graph=module_call_graph,
        example_inputs=example_inputs,
        constants=dict(constants),
        **kwargs,
    )


def _has_precision_api() -> bool:
    """torch 2.9 added ``fp32_precision`` settings per back end and operation; the older
    ``allow_tf32`` flags still work but must not be mixed with them."""
    return hasattr(torch.backends.cuda.matmul, "fp32_precision")


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """float32 matmuls, convolutions and RNNs at full precision within the block (CUDA's default
    lets cuDNN convolutions use TF32, 10-bit mantissas), the previous settings after."""
    if _has_precision_api():
        backends = torch.backends
        settings = [backends.cuda.matmul, backends.cudnn.conv, backends.cudnn.rnn]
        saved = [s.fp32_precision for s in settings]
        try:
            for s in settings:
                s.fp32_precision = "ieee"
            yield
        finally:
            for s, value in zip(settings, saved, strict=True):
                s.fp32_precision = value
        return
    saved_flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_flags


@functools.cache
def _serialize_takes_part_flags() -> bool:
    """torch 2.13 added ``serialize(..., serialize_state_dict=...)``; before it, ``serialize``
    always pickled the state dict, constants and example inputs beside the graph."""
    from torch._export.serde.serialize import serialize

    return "serialize_state_dict" in inspect.signature(serialize).parameters


#: Held while a program is serialized or deserialized: torch's serde is not thread-safe (the
#: deserializer keeps the one running in a module global, ``_CURRENT_DESERIALIZER``, and
#: asserts when a second thread starts one) and the calls here swap functions of its module
#: for their duration, which two threads at once would leave swapped. The concurrent
#: scheduler's stages encode and load programs in threads: they take turns here.
_SERDE = threading.RLock()


def serialize_program_graph(program: torch.export.ExportedProgram) -> bytes:
    """The JSON bytes of ``program``'s graph, signature and metadata, without its tensors.

    graphbuild stores the tensors itself (raw blobs, never pickle), so the serializer must not
    spend time pickling them: on torch < 2.13 the tensor pickler is bypassed for the call.
    """
    from torch._export.serde import serialize as serde

    with _SERDE, _without_canonical_form_check():
        if _serialize_takes_part_flags():
            artifact = serde.serialize(
                program,
                serialize_state_dict=False,
                serialize_constants=False,
                serialize_example_inputs=False,
            )
            return _as_loaded(artifact.exported_program)
        real = serde.serialize_torch_artifact
        serde.serialize_torch_artifact = lambda *args, **kwargs: b""
        try:
            return _as_loaded(serde.serialize(program).exported_program)
        finally:
            serde.serialize_torch_artifact = real


_OFFSET = re.compile(rb'"storage_offset": \{"as_int": -?\d+\}')
_ZERO_OFFSET = b'"storage_offset": {"as_int": 0}'


def _as_loaded(graph: bytes) -> bytes:
    """The serialized graph as a load gives it back. torch's deserializer rebuilds each
    tensor's metadata with ``empty_strided`` and drops its storage offset (a slice's ``val``
    says 8 in the traced program, 0 once loaded), so a program computed in this process and
    the same program loaded from the cache would serialize differently: the offset is written
    as the loader reads it, 0, and a program digests the same computed or loaded."""
    if not _loader_drops_storage_offset():
        return graph
    graph = _OFFSET.sub(_ZERO_OFFSET, graph)
    if b'"storage_offset": {"as_expr"' not in graph:
        return graph
    doc = json.loads(graph)  # a symbolic offset (dynamic shapes): rewrite it in the document

    def zero(node: Any) -> None:
        if isinstance(node, dict):
            if "storage_offset" in node:
                node["storage_offset"] = {"as_int": 0}
            for value in node.values():
                zero(value)
        elif isinstance(node, list):
            for value in node:
                zero(value)

    zero(doc)
    return json.dumps(doc).encode()


@functools.cache
def _loader_drops_storage_offset() -> bool:
    """True when the installed torch's ``deserialize_tensor_meta`` does not read the storage
    offset (read from its source; every supported release so far)."""
    from torch._export.serde import serialize as serde

    try:
        source = inspect.getsource(serde.GraphModuleDeserializer.deserialize_tensor_meta)
    except (OSError, TypeError, AttributeError):
        return False
    return "storage_offset" not in source


@functools.cache
def _canonical_form_check_is_discarded() -> bool:
    """torch's program serializer calls ``canonicalize(serialized_ep, ...)`` as a statement,
    a self-test whose result it throws away, after a deep copy of the whole serialized graph
    (a third of the time to serialize a program). True when the installed release does
    exactly that, read from its source: only then is the call skipped."""
    import ast
    import textwrap

    from torch._export.serde import serialize as serde

    try:
        source = textwrap.dedent(inspect.getsource(serde.ExportedProgramSerializer.serialize))
    except (OSError, TypeError, AttributeError):
        return False
    nodes = list(ast.walk(ast.parse(source)))
    calls = [
        node
        for node in nodes
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "canonicalize"
    ]
    discarded = [n for n in nodes if isinstance(n, ast.Expr) and any(n.value is c for c in calls)]
    return len(calls) == 1 and len(discarded) == 1


@contextlib.contextmanager
def _without_canonical_form_check() -> Iterator[None]:
    from torch._export.serde import serialize as serde

    real = getattr(serde, "canonicalize", None)
    if real is None or not _canonical_form_check_is_discarded():
        yield
        return
    serde.canonicalize = lambda ep, constants=None: ep
    try:
        yield
    finally:
        serde.canonicalize = real


def deserialize_program(
    graph: bytes,
    state: Mapping[str, torch.Tensor],
    constants: Mapping[str, torch.Tensor],
) -> torch.export.ExportedProgram:
    """Rebuild a program from :func:`serialize_program_graph` bytes and its tensors.

    Every supported release accepts in-memory dicts in place of pickled bytes, so nothing is
    unpickled.
    """
    from torch._export.serde.serialize import SerializedArtifact, deserialize

    register_quantized_decomposed_ops()
    with _SERDE, _planned_dataclasses(), _cached_type_hints():
        return deserialize(SerializedArtifact(bytes(graph), dict(state), dict(constants), b""))


def register_quantized_decomposed_ops() -> None:
    """A program from PT2E holds ``quantized_decomposed`` ops; torch registers them only when
    their module is imported, which a fresh process loading the cache has not done."""
    try:
        import torch.ao.quantization.fx._decomposed  # noqa: F401
    except ImportError:  # torch releases that moved PT2E out of torch.ao keep them in torchao
        import torchao.quantization.pt2e.utils  # noqa: F401


_ONNX_REGISTRIES: dict[tuple, Any] = {}


@contextlib.contextmanager
def onnx_registry_reused() -> Iterator[None]:
    """Within the block, ``torch.onnx.export`` builds its registry of torchlib functions once
    per opset version in this process instead of on every call.

    The exporter rebuilds the registry for each export (parsing the source of about 500
    onnxscript functions: a third of exporting a small model) from what the installed torch
    and onnxscript ship. Each call gets a copy of the one built first (its own dict and
    lists; the entries are shared, and the exporter only reads them), into which it
    registers its custom translations as before. Where ``ONNXRegistry.from_torchlib`` is not
    the classmethod filling a ``functions`` dict that this was written against, nothing
    changes."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        yield
        return
    cls = getattr(_registration, "ONNXRegistry", None)
    real = vars(cls).get("from_torchlib") if isinstance(cls, type) else None
    if not isinstance(real, classmethod):
        yield
        return

    def from_torchlib(klass: type, *args: Any, **kwargs: Any) -> Any:
        key = (klass, args, tuple(sorted(kwargs.items())))
        pristine = _ONNX_REGISTRIES.get(key)
        if pristine is None:
            pristine = real.__func__(klass, *args, **kwargs)
            if not isinstance(getattr(pristine, "functions", None), dict):
                return pristine
            _ONNX_REGISTRIES[key] = pristine
        copy = klass.__new__(klass)
        copy.__dict__.update(vars(pristine))
        copy.functions = {k: list(v) for k, v in pristine.functions.items()}
        return copy

    cls.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        cls.from_torchlib = real


@contextlib.contextmanager
def _cached_type_hints() -> Iterator[None]:
    """torch's program deserializer calls ``typing.get_type_hints`` on its schema dataclasses
    once per graph object; the answer never changes, and caching it halves the time to load a
    program. Where the serializer does not look hints up through its ``typing`` global, this is
    a no-op."""
    from torch._export.serde import serialize as serde

    real = getattr(serde, "typing", None)
    if not isinstance(real, types.ModuleType) or isinstance(real, _TypingWithCachedHints):
        yield
        return
    serde.typing = _TypingWithCachedHints(real)
    try:
        yield
    finally:
        serde.typing = real


class _TypingWithCachedHints(types.ModuleType):
    """The typing module with a memoized ``get_type_hints``."""

    def __init__(self, typing_module: types.ModuleType):
        super().__init__("typing")
        self.__dict__.update(vars(typing_module))
        # the module's own function, just copied in, would shadow the method below
        del self.__dict__["get_type_hints"]
        self._hints: dict[tuple, Any] = {}
        self._real = typing_module.get_type_hints

    def get_type_hints(self, obj, globalns=None, localns=None, include_extras=False):
        key = (obj, id(globalns), id(localns), include_extras)
        if key not in self._hints:
            self._hints[key] = self._real(obj, globalns, localns, include_extras)
        return self._hints[key]


#: sha256 of the source of ``torch._export.serde.serialize._dict_to_dataclass`` in releases
#: whose semantics :class:`_DataclassPlans` repeats (torch 2.14).
_DICT_TO_DATACLASS_SOURCES = frozenset(
    {"caf63dd8c94356b17f6913ad42863b1eb95a3f5c7ed0e4b5a976230012cfbf5a"}
)


@functools.cache
def _dict_to_dataclass_is_known() -> bool:
    """True when the installed torch's ``_dict_to_dataclass`` is, to the byte, one whose
    semantics :class:`_DataclassPlans` repeats."""
    import hashlib

    from torch._export.serde import serialize as serde

    try:
        source = inspect.getsource(serde._dict_to_dataclass)
    except (OSError, TypeError, AttributeError):
        return False
    return hashlib.sha256(source.encode()).hexdigest() in _DICT_TO_DATACLASS_SOURCES


@contextlib.contextmanager
def _planned_dataclasses() -> Iterator[None]:
    """Within the block, torch's program deserializer turns the JSON of a program into its
    schema dataclasses through :class:`_DataclassPlans`: the same conversion, with what each
    schema type needs (hints, fields, origin) looked up once per type rather than once per
    object (half the time to load a program was those look-ups). Where torch's
    ``_dict_to_dataclass`` is not a source this was written against, nothing changes."""
    from torch._export.serde import serialize as serde

    real = serde._dict_to_dataclass
    if not _dict_to_dataclass_is_known():
        yield
        return
    serde._dict_to_dataclass = _DataclassPlans(serde).convert
    try:
        yield
    finally:
        serde._dict_to_dataclass = real


class _DataclassPlans:
    """torch 2.14's ``_dict_to_dataclass(cls, data)``, one plan per schema type: the branch
    it takes and what it needs are fixed by ``cls``; only the list, dict, float and plain
    cases depend on ``data``, checked in torch's order."""

    def __init__(self, serde: types.ModuleType):
        self._serde = serde
        self._globals = vars(serde.schema)
        self._plans: dict[Any, Any] = {}

    def convert(self, cls: Any, data: Any) -> Any:
        plan = self._plans.get(cls)
        if plan is None:
            resolved = self._serde._resolve_schema_cls(cls)
            if isinstance(resolved, str):
                raise AssertionError(f"Unresolved class type: '{resolved}'.")
            plan = self._plans.get(resolved)
            if plan is None:
                plan = self._plans[resolved] = self._plan(resolved)
            self._plans[cls] = plan
        return plan(data)

    def _plan(self, cls: Any) -> Any:
        import dataclasses
        import typing

        serde = self._serde
        convert = self.convert
        origin = typing.get_origin(cls)
        if origin is typing.Annotated:
            inner = cls.__origin__
            return lambda data: convert(inner, data)
        args = typing.get_args(cls)
        if origin in (typing.Union, types.UnionType) and type(None) in args:
            if len(args) != 2:
                raise AssertionError(f"expected 2 type args, got {len(args)}")
            first = args[0]
            return lambda data: None if data is None else convert(first, data)
        if isinstance(cls, type) and issubclass(cls, serde._Union):
            hints = typing.get_type_hints(cls, globalns=self._globals)

            def union(data: Any) -> Any:
                if not isinstance(data, dict):
                    raise AssertionError(f"expected dict, got {type(data).__name__}")
                if len(data) != 1:
                    raise AssertionError(f"expected dict with 1 key, got {len(data)}")
                ((tag, value),) = data.items()
                if not isinstance(tag, str):
                    raise AssertionError(f"expected str key, got {type(tag).__name__}")
                return cls.create(**{tag: convert(hints[tag], value)})

            return union
        if dataclasses.is_dataclass(cls):
            hints = typing.get_type_hints(cls, globalns=self._globals)
            names = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
            return lambda data: cls(
                **{name: convert(hint, data[name]) for name, hint in names if name in data}
            )

        def other(data: Any) -> Any:
            if isinstance(data, list):
                if not data:
                    return data
                item = typing.get_args(cls)[0]
                return [convert(item, d) for d in data]
            if isinstance(data, dict):
                value = typing.get_args(cls)[1]
                return {k: convert(value, v) for k, v in data.items()}
            if cls is float:
                return float(data)
            return data

        return other
