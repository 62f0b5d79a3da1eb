"""Fingerprints: the facets of a pipeline input, options and code, as digests.

``fingerprint(value)`` turns a value into a canonical JSON-able form, one registration per
type (``functools.singledispatch``). Facets of the pipeline input (``structure``, ``state``,
``samples.spec``, ``samples.values``) are computed lazily, at most once per run, by
:class:`InputFacets`. Anything that cannot be fingerprinted raises :class:`FingerprintError`
naming the value's path; callers turn that into "always rerun, because ...", never a stale hit.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import linecache
import os
import re
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import torch

from graphbuild.engine import digest_memo
from graphbuild.engine.checking import checking, reused_mismatch
from graphbuild.engine.closure import (
    code_closure,
    file_digest,
    find_file,
    function_files,
    is_library,
    is_own,
    library_version,
)
from graphbuild.engine.parallel import parallel_map
from graphbuild.engine.pipeline import FACETS
from graphbuild.errors import FingerprintError
from graphbuild.hashing import Hasher, digest_bytes, digest_json

__all__ = [
    "Reading",
    "InputFacets",
    "fingerprint",
    "tensor_digest",
    "state_digests",
    "structure_fingerprint",
    "code_fingerprint",
    "callable_version",
    "FACETS",
]

_MAX_DEPTH = 12


# --------------------------------------------------------------------------- values


class _Tree(threading.local):
    """The model whose structure is being fingerprinted on this thread: (tensor id ->
    state name, module id -> submodule name, True), empty outside a structure fingerprint."""

    def __init__(self) -> None:
        self.current: tuple[Mapping[int, str], Mapping[int, str], bool] = ({}, {}, False)


_TREE = _Tree()


class _Walk:
    """State of one recursive fingerprint: cycle guard and the path for error messages."""

    def __init__(
        self,
        state_names: Mapping[int, str] | None = None,
        module_names: Mapping[int, str] | None = None,
        model: bool = False,
    ) -> None:
        self.active: set[int] = set()
        self.path: list[str] = []
        # Within a structure fingerprint (and every fingerprint it starts: a closure's cells,
        # a partial's arguments), the model's own tensors and submodules, by id:
        # - a parameter or buffer an attribute holds (nn.LSTM's _flat_weights) is structure
        #   by name, its values are the state facet's;
        # - a submodule an attribute reaches (a traced GraphModule's owner, a bound method's
        #   object, a lambda's cell) is named by its place in the tree, whose structure and
        #   weights are fingerprinted where the tree holds it.
        # - where its tensors live is not structure (see torch.device).
        tree = _TREE.current
        self.state_names: Mapping[int, str] = state_names or tree[0]
        self.module_names: Mapping[int, str] = module_names or tree[1]
        self.model = model or tree[2]

    def child(self, label: str, value: Any) -> Any:
        if len(self.path) > _MAX_DEPTH:
            # what lies deeper would be ignored: uncacheable, never a stale hit
            raise FingerprintError(
                f"cannot fingerprint {'.'.join(self.path)}.{label}: nested more than "
                f"{_MAX_DEPTH} levels deep"
            )
        if id(value) in self.active:
            return {"cycle": type(value).__qualname__}
        self.path.append(label)
        keep = not isinstance(value, (str, int, float, bool, type(None)))
        if keep:
            self.active.add(id(value))
        try:
            return _fp(value, self)
        finally:
            if keep:
                self.active.discard(id(value))
            self.path.pop()


def fingerprint(value: Any) -> Any:
    """Canonical JSON-able form of ``value``: equal forms mean equal values for graphbuild.

    Register a type with ``@fingerprint_type.register(MyType)`` taking ``(value, walk)``.
    """
    return _Walk().child("value", value)


@functools.singledispatch
def fingerprint_type(value: Any, walk: _Walk) -> Any:
    cls = type(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "dataclass": _qualname(cls),
            "fields": {
                f.name: walk.child(f.name, getattr(value, f.name))
                for f in dataclasses.fields(value)
            },
        }
    if isinstance(value, type):
        return {"class": _qualname(value), "code": code_fingerprint([value])}
    if callable(value) and hasattr(value, "__code__"):
        return {"function": callable_version(value)}
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):
        skip = volatile_attributes(cls)
        return {
            "object": _qualname(cls),
            "code": code_fingerprint([cls]),
            "attrs": {k: walk.child(k, v) for k, v in sorted(state.items()) if k not in skip},
        }
    slots = _slot_values(value)
    if slots is not None:
        return {"object": _qualname(cls), "attrs": {k: walk.child(k, v) for k, v in slots}}
    raise FingerprintError(
        f"cannot fingerprint {'.'.join(walk.path)} of type {_qualname(cls)}; register it with "
        f"@graphbuild.engine.fingerprint.fingerprint_type.register({cls.__name__})"
    )


def _fp(value: Any, walk: _Walk) -> Any:
    fn = fingerprint_type.dispatch(type(value))
    if fn in _BUILTIN_FINGERPRINTS:
        return fn(value, walk)
    # a fingerprint function registered by a user: its code is part of what it computes
    return {"registered": _registered_version(fn), "value": fn(value, walk)}


def _registered_version(fn: Callable) -> str:
    return digest_json(code_identity(fn))


#: Attributes whose values differ from one process to the next for the same object, by the
#: qualified name of the class that has them (and its subclasses). transformers'
#: GenerationConfig keeps ``hash(self)``, which string hash randomization changes per process.
VOLATILE_ATTRIBUTES: dict[str, set[str]] = {
    "transformers.generation.configuration_utils.GenerationConfig": {"_original_object_hash"},
}


def ignore_attribute(cls: type | str, name: str) -> None:
    """Leave attribute ``name`` of ``cls`` (and subclasses) out of every fingerprint: for
    values that change per process (a ``hash()``, an ``id()``) and do not change the model."""
    qualname = cls if isinstance(cls, str) else _qualname(cls)
    VOLATILE_ATTRIBUTES.setdefault(qualname, set()).add(name)


def volatile_attributes(cls: type) -> set[str]:
    out: set[str] = set()
    for base in cls.__mro__:
        out |= VOLATILE_ATTRIBUTES.get(_qualname(base), set())
    return out


def _slot_values(value: Any) -> list[tuple[str, Any]] | None:
    names = [s for c in type(value).__mro__ for s in getattr(c, "__slots__", ())]
    if not names:
        return None
    return [(n, getattr(value, n)) for n in sorted(set(names)) if hasattr(value, n)]


@fingerprint_type.register(type(None))
@fingerprint_type.register(bool)
@fingerprint_type.register(str)
def _(value: Any, walk: _Walk) -> Any:
    return value


@fingerprint_type.register(int)
def _(value: int, walk: _Walk) -> Any:
    return value if abs(value) < 2**53 else {"int": str(value)}


@fingerprint_type.register(float)
def _(value: float, walk: _Walk) -> Any:
    return {"float": value.hex()}


@fingerprint_type.register(bytes)
@fingerprint_type.register(bytearray)
def _(value: bytes, walk: _Walk) -> Any:
    return {"bytes": digest_bytes(bytes(value))}


@fingerprint_type.register(list)
@fingerprint_type.register(tuple)
def _(value: Any, walk: _Walk) -> Any:
    items = [walk.child(f"[{i}]", v) for i, v in enumerate(value)]
    return items if type(value) in (list, tuple) else {_qualname(type(value)): items}


@fingerprint_type.register(dict)
def _(value: dict, walk: _Walk) -> Any:
    items = [[fingerprint(k), walk.child(str(k), v)] for k, v in value.items()]
    items.sort(key=lambda kv: digest_json(kv[0]))
    return {"dict": items}


@fingerprint_type.register(set)
@fingerprint_type.register(frozenset)
def _(value: Any, walk: _Walk) -> Any:
    return {"set": sorted((walk.child("{}", v) for v in value), key=digest_json)}


@fingerprint_type.register(enum.Enum)
def _(value: enum.Enum, walk: _Walk) -> Any:
    return {"enum": _qualname(type(value)), "name": value.name}


@fingerprint_type.register(PurePath)
def _(value: PurePath, walk: _Walk) -> Any:
    return {"path": str(value)}


@fingerprint_type.register(torch.device)
def _(value: torch.device, walk: _Walk) -> Any:
    # In a model's structure a device is where the model happens to live: the front end traces
    # on CPU stand-ins with device attributes read as the CPU (frontend/devices.on_cpu), so the
    # same model on any device has one structure key (invariant 10). Elsewhere it is a value.
    return {"torch": "device"} if walk.model else {"torch": str(value)}


@fingerprint_type.register(torch.dtype)
@fingerprint_type.register(torch.qscheme)
@fingerprint_type.register(torch.memory_format)
@fingerprint_type.register(torch.layout)
def _(value: Any, walk: _Walk) -> Any:
    return {"torch": str(value)}


@fingerprint_type.register(torch.Size)
def _(value: torch.Size, walk: _Walk) -> Any:
    return {"size": list(value)}


@fingerprint_type.register(torch.Tensor)
def _(value: torch.Tensor, walk: _Walk) -> Any:
    name = walk.state_names.get(id(value))
    if name is not None:
        return {"state": name, "dtype": str(value.dtype), "shape": list(value.shape)}
    return {"tensor": tensor_digest(value), "dtype": str(value.dtype), "shape": list(value.shape)}


@fingerprint_type.register(weakref.ref)
def _(value: weakref.ref, walk: _Walk) -> Any:
    # a weak reference is a cache of something held elsewhere (nn.LSTM's _flat_weight_refs
    # point to its parameters): what it points to is fingerprinted where it is held
    target = value()
    if target is None:
        return {"weakref": None}
    if isinstance(target, torch.Tensor):
        return {"weakref": "tensor", "dtype": str(target.dtype), "shape": list(target.shape)}
    return {"weakref": walk.child("()", target)}


@fingerprint_type.register(types.ModuleType)
def _(value: types.ModuleType, walk: _Walk) -> Any:
    # a module's code is its source files (an installed library: its version)
    return {"module": value.__name__, "files": _files_of(value.__name__)}


@fingerprint_type.register(types.FunctionType)
def _(value: Any, walk: _Walk) -> Any:
    return {"function": callable_version(value)}


@fingerprint_type.register(functools.partial)
def _(value: functools.partial, walk: _Walk) -> Any:
    return {
        "partial": walk.child("func", value.func),
        "args": walk.child("args", list(value.args)),
        "keywords": walk.child("keywords", dict(value.keywords)),
    }


@fingerprint_type.register(types.MethodType)
def _(value: types.MethodType, walk: _Walk) -> Any:
    # a bound method calls its function with its object: both are what it computes
    return {
        "function": callable_version(value.__func__),
        "self": walk.child("__self__", value.__self__),
    }


@fingerprint_type.register(types.BuiltinFunctionType)
def _(value: Any, walk: _Walk) -> Any:
    owner = getattr(value, "__self__", None)
    if owner is None or isinstance(owner, types.ModuleType):  # a plain builtin function
        return {"function": callable_version(value)}
    return {"builtin method": value.__name__, "self": walk.child("__self__", owner)}


@fingerprint_type.register(staticmethod)
@fingerprint_type.register(classmethod)
def _(value: Any, walk: _Walk) -> Any:
    return {type(value).__name__: walk.child("__func__", value.__func__)}


# Ids of the modules and callables being fingerprinted: a module reachable from its own
# attributes (a back-reference to a parent) or a function in its own closure is fingerprinted
# by the call already under way, not again (which would recurse without end). Per thread, so
# one thread's work in progress never stands in for another's.
class _ActiveIds(threading.local):
    def __init__(self) -> None:
        self.ids: set[int] = set()


_ACTIVE = _ActiveIds()


@fingerprint_type.register(torch.nn.Module)
def _(value: torch.nn.Module, walk: _Walk) -> Any:
    name = walk.module_names.get(id(value))
    if name is not None:  # one of the model's own submodules: by its place in the tree
        return {"submodule": name}
    # A module held as an option (not the pipeline input): its structure and its values.
    if id(value) in _ACTIVE.ids:
        return {"module-cycle": _qualname(type(value))}
    return {"module": structure_fingerprint(value).digest, "state": state_digests(value).digest}


@fingerprint_type.register(torch.fx.Graph)
def _(value: torch.fx.Graph, walk: _Walk) -> Any:
    # node by node, arguments by node name: walking the nodes' own attributes would follow
    # their linked list (and the owning module, which is the model's by name)
    nodes = []
    for i, node in enumerate(value.nodes):
        target = node.target if isinstance(node.target, str) else walk.child(f"[{i}]", node.target)
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _NodeRef(n.name))
        nodes.append([node.name, node.op, target, walk.child(f"[{i}].args", args)])
    return {"fx_graph": nodes, "owner": walk.child("owning_module", value.owning_module)}


@fingerprint_type.register(torch._ops.OpOverload)
@fingerprint_type.register(torch._ops.OpOverloadPacket)
def _(value: Any, walk: _Walk) -> Any:
    return {"op": str(value)}


@dataclass(frozen=True)
class _NodeRef:
    name: str


@fingerprint_type.register(torch.utils.hooks.RemovableHandle)
def _(value: Any, walk: _Walk) -> Any:
    # its id comes from a global counter; the hook it removes is in the module's hook dict
    return {"hook handle": None}


try:
    import numpy as np

    @fingerprint_type.register(np.ndarray)
    def _(value: np.ndarray, walk: _Walk) -> Any:
        arr = np.ascontiguousarray(value)
        return {
            "ndarray": digest_bytes(arr.reshape(-1).view(np.uint8)),
            "dtype": str(arr.dtype),
            "shape": list(arr.shape),
        }

    @fingerprint_type.register(np.generic)
    def _(value: Any, walk: _Walk) -> Any:
        return {"numpy": str(value.dtype), "value": value.item().__repr__()}

except ImportError:  # pragma: no cover - numpy ships with torch
    pass


_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


def stable_text(text: str, what: str) -> str:
    """``text`` (a ``repr`` or ``str`` graphbuild made of a value) if it is the same in
    every process; one holding a memory address (``<Foo object at 0x7f...>``) is refused:
    it differs per process (a needless rerun) and says nothing about the value's contents
    (a stale hit, were the address ignored)."""
    found = _ADDRESS.search(text)
    if found is not None:
        shown = text if len(text) <= 120 else text[:117] + "..."
        raise FingerprintError(
            f"cannot fingerprint {what}: its text form holds a memory address "
            f"({found.group()}), which differs in every process: {shown}. Give the object a "
            "repr of its contents, or register a fingerprint for its type"
        )
    return text


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# --------------------------------------------------------------------------- tensors


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat buffer, without a copy when it is contiguous on the CPU."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_quantized or t.layout != torch.strided:
        raise FingerprintError(f"cannot read the bytes of a {t.layout} / quantized tensor")
    flat = t.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # one element seen through a zero stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


def tensor_digest(tensor: torch.Tensor) -> str:
    """xxh3-128 of the tensor's memory (not of its dtype and shape).

    The same digest wherever the tensor lives: a tensor on an accelerator is streamed through
    a reused (pinned, on CUDA) host buffer in chunks, never copied to the host whole.
    """
    if tensor.device.type == "meta":
        raise FingerprintError("a meta tensor has no values to fingerprint")
    if tensor.device.type != "cpu" and tensor.numel() * tensor.element_size() > DEVICE_CHUNK:
        return _streamed_digest(tensor)
    return digest_bytes(tensor_bytes(tensor))


def content_tokens(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    """A token of each tensor's contents: equal before and after a stage runs unless the
    values it holds changed, however they were written (``add_``, through ``.data`` or a
    numpy view, which torch's version counter does not see). A digest of the memory the
    tensor reads (xxh3, several GB/s; big tensors on a thread per core) and its layout.

    A zero-stride tensor (a placeholder) is read through its storage, which is one element;
    a tensor with no memory to read (meta, sparse) is known by identity and version only."""
    tokens: list[tuple | None] = [None] * len(tensors)
    direct: list[int] = []
    for i, t in enumerate(tensors):
        layout = (str(t.dtype), tuple(t.shape), tuple(t.stride()), t.storage_offset())
        if t.layout != torch.strided or t.device.type == "meta" or t.is_quantized:
            tokens[i] = ("opaque", id(t), t._version, t.data_ptr(), *layout)
        elif t.is_contiguous():
            direct.append(i)
        else:
            storage = t.untyped_storage()
            view_bytes = t.numel() * t.element_size()
            if storage.nbytes() <= view_bytes:  # expanded or overlapping: read the storage
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                tokens[i] = ("storage", tensor_digest(whole), *layout)
            else:
                direct.append(i)
    digests = tensor_digests([tensors[i] for i in direct])
    for i, d in zip(direct, digests, strict=True):
        t = tensors[i]
        tokens[i] = ("values", d, str(t.dtype), tuple(t.shape))
    return tokens  # type: ignore[return-value]


def input_token(value: Any, *, full: bool = False) -> Any:
    """A token of the pipeline input, to tell whether a stage changed it in place. For a
    model: every parameter and buffer by identity, address and version counter (cheap,
    whatever the model's size); with ``full``, also a digest of every tensor, which sees
    writes through ``.data`` or numpy views too (check mode). Any other input: its
    codec's token."""
    if not isinstance(value, torch.nn.Module):
        from graphbuild.engine.codecs import snapshot

        return snapshot(value)
    named = [*value.named_parameters(remove_duplicate=False)]
    named += [*value.named_buffers(remove_duplicate=False)]
    token: list[Any] = [
        (n, id(t), t._version, t.data_ptr() if t.device.type != "meta" else 0)
        for n, t in named
        if t is not None
    ]
    if full:
        token.append(state_digests(value).digest)
    return token


#: Bytes per device-to-host copy when hashing a tensor off the CPU.
DEVICE_CHUNK = 32 << 20


class _StagingBuffers(threading.local):
    def __init__(self) -> None:
        self.by_device: dict[str, torch.Tensor] = {}


_STAGING = _StagingBuffers()


def _staging_buffer(device: torch.device) -> torch.Tensor:
    """A host buffer of DEVICE_CHUNK bytes for copies from ``device``, made once per thread."""
    buffer = _STAGING.by_device.get(device.type)
    if buffer is None:
        pin = device.type == "cuda"
        buffer = torch.empty(DEVICE_CHUNK, dtype=torch.uint8, pin_memory=pin)
        _STAGING.by_device[device.type] = buffer
    return buffer


def _streamed_digest(tensor: torch.Tensor) -> str:
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()  # on the device
    if t.is_quantized or t.layout != torch.strided:
        raise FingerprintError(f"cannot read the bytes of a {t.layout} / quantized tensor")
    flat = t.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # one element seen through a zero stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    staging = _staging_buffer(t.device)
    hasher = Hasher()
    for start in range(0, flat.numel(), DEVICE_CHUNK):
        chunk = flat[start : start + DEVICE_CHUNK]
        host = staging[: chunk.numel()]
        host.copy_(chunk)
        hasher.update(memoryview(host.numpy()))
    return hasher.hexdigest()


@dataclass(frozen=True)
class StateDigests:
    """One digest per parameter and buffer name, and one over all of them."""

    digest: str
    tensors: dict[str, str]


def state_digests(module: torch.nn.Module) -> StateDigests:
    """Digest every parameter and buffer; tied tensors (same memory) are hashed once, and
    distinct tensors in parallel (``tensor_digests``)."""
    named = [*module.named_parameters(remove_duplicate=False)]
    named += [*module.named_buffers(remove_duplicate=False)]
    idents: dict[str, tuple] = {}
    unique: dict[tuple, torch.Tensor] = {}
    for name, t in named:
        if t is None or t.device.type == "meta" or t.numel() == 0:
            continue
        ident = (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        idents[name] = ident
        unique.setdefault(ident, t)
    digests = dict(zip(unique, tensor_digests(list(unique.values()), reuse=True), strict=True))
    out: dict[str, str] = {}
    for name, t in named:
        if t is None:
            continue
        d = digests[idents[name]] if name in idents else f"empty:{t.device.type}"
        out[name] = f"{t.dtype}{list(t.shape)}:{d}"
    return StateDigests(digest_json(sorted(out.items())), out)


#: Below this many bytes in all, tensors are hashed one after the other.
PARALLEL_BYTES = 64 << 20


def tensor_digests(tensors: Sequence[torch.Tensor], *, reuse: bool = False) -> list[str]:
    """``tensor_digest`` of each tensor, spread over a thread per core when there is enough to
    hash: xxhash releases the GIL, so a model's weights hash at the speed of all cores. Tensors
    off the CPU go one at a time (they share a staging buffer per thread).

    With ``reuse`` (the model's state, read for keys), a tensor whose digest this process
    computed before, and which is untouched since by what torch's version counter sees, is
    not hashed again where :mod:`digest_memo`'s rule allows it. Check mode reuses nothing
    (:func:`verify_reused_digests` has checked what would be reused before the run). Without
    ``reuse`` (content tokens, which exist to see writes the version counter misses), every
    tensor is hashed.
    """
    known = [digest_memo.lookup(t) if reuse and not checking() else None for t in tensors]
    todo = [t for t, d in zip(tensors, known, strict=True) if d is None]
    computed = iter(_hash_all(todo))
    out = []
    for t, reused in zip(tensors, known, strict=True):
        if reused is not None:
            out.append(reused)
            continue
        digest = next(computed)
        digest_memo.remember(t, digest)
        out.append(digest)
    return out


def verify_reused_digests() -> None:
    """Check mode, before a run: hash every tensor whose digest this process would reuse
    (:mod:`digest_memo`) and fail loudly, naming the rule, where one is wrong."""
    reusable = digest_memo.reusable()
    computed = _hash_all([t for t, _ in reusable])
    for (t, reused), digest in zip(reusable, computed, strict=True):
        if reused != digest:
            raise reused_mismatch(
                f"tensor {t.dtype}{list(t.shape)}",
                reused,
                digest,
                "it was written without torch's version counter seeing it (through .data, a "
                "numpy view or another buffer) after an earlier run hashed it; such writes "
                "need graphbuild.engine.digest_memo.reuse_across_runs(False)",
            )
        digest_memo.remember(t, digest)


def _hash_all(tensors: Sequence[torch.Tensor]) -> list[str]:
    total = sum(t.numel() * t.element_size() for t in tensors)
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    parallel = total >= PARALLEL_BYTES and on_cpu
    return parallel_map(tensor_digest, tensors, parallel=parallel)


# --------------------------------------------------------------------------- structure


@dataclass(frozen=True)
class StructureFingerprint:
    """Digest of the module tree, attributes and code; ``modules`` keeps one digest per
    submodule so ``explain`` can say which one changed."""

    digest: str
    modules: dict[str, str]
    code: dict[str, str]


_SKIP_ATTRS = {
    "_parameters",
    "_buffers",
    "_modules",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_compiled_call_impl",
}


def _hooks(module: torch.nn.Module, walk: _Walk) -> tuple[dict[str, Any], set[str]]:
    """A module's hooks (``_forward_hooks`` ...) as ordered lists of callables, each with the
    flags its companion dicts (``_forward_hooks_with_kwargs`` ...) give it: the dicts are keyed
    by handle ids from a global counter, which depend on everything registered before.
    Returns the forms of the non-empty hook dicts and the names of all hook attributes."""
    state = vars(module)
    hook_dicts = [k for k, v in state.items() if k.endswith("hooks") and isinstance(v, dict)]
    flags = {
        k: v
        for k, v in state.items()
        if isinstance(v, dict) and any(k.startswith(h + "_") for h in hook_dicts)
    }
    forms: dict[str, Any] = {}
    for name in hook_dicts:
        if name in _SKIP_ATTRS or not state[name]:
            continue
        marks = {f[len(name) + 1 :]: d for f, d in flags.items() if f.startswith(name + "_")}
        forms[name] = [
            [walk.child(f"{name}[{i}]", hook), sorted(m for m, d in marks.items() if handle in d)]
            for i, (handle, hook) in enumerate(state[name].items())
        ]
    return forms, {*hook_dicts, *flags}


def structure_fingerprint(module: torch.nn.Module) -> StructureFingerprint:
    """Class, non-tensor attributes, parameter/buffer names, shapes and dtypes of every
    submodule, plus the code of their classes. Raises FingerprintError naming the attribute
    that cannot be fingerprinted."""
    _ACTIVE.ids.add(id(module))
    try:
        return _structure_fingerprint(module)
    finally:
        _ACTIVE.ids.discard(id(module))


def _structure_fingerprint(module: torch.nn.Module) -> StructureFingerprint:
    state_names: dict[int, str] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False)] + [
        *module.named_buffers(remove_duplicate=False)
    ]:
        state_names.setdefault(id(t), name)
    module_names: dict[int, str] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        module_names.setdefault(id(sub), name or "<root>")
    outer = _TREE.current
    _TREE.current = (state_names, module_names, True)
    try:
        return _tree_fingerprint(module, state_names, module_names)
    finally:
        _TREE.current = outer


def _tree_fingerprint(
    module: torch.nn.Module, state_names: dict[int, str], module_names: dict[int, str]
) -> StructureFingerprint:
    classes: list[type] = []
    modules: dict[str, str] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        classes.append(type(sub))
        walk = _Walk(state_names, module_names, model=True)
        walk.path.append(name or "<root>")
        skip = volatile_attributes(type(sub))
        hooks, hook_attrs = _hooks(sub, walk)
        attrs = {}
        for k, v in sorted(vars(sub).items()):
            if k in _SKIP_ATTRS or k in skip or k in hook_attrs:
                continue
            attrs[k] = walk.child(k, v)
        attrs.update(hooks)
        entry = {
            "class": _qualname(type(sub)),
            "attrs": attrs,
            "params": [
                [n, str(p.dtype), list(p.shape), p.requires_grad]
                for n, p in sub._parameters.items()
                if p is not None
            ],
            "buffers": [
                [n, str(b.dtype), list(b.shape), n in sub._non_persistent_buffers_set]
                for n, b in sub._buffers.items()
                if b is not None
            ],
            "children": list(sub._modules),
        }
        modules[name] = digest_json(entry)
    code = code_fingerprint(classes)
    return StructureFingerprint(digest_json([sorted(modules.items()), code]), modules, code)


# --------------------------------------------------------------------------- code


def code_fingerprint(classes: Iterable[type]) -> dict[str, str]:
    """Source digests of the files defining ``classes`` (and their bases) and of every
    module they import from outside site-packages, transitively; versions of the installed
    distributions the rest comes from. Raises FingerprintError when source is unavailable."""
    out: dict[str, str] = {}
    names: list[str] = []
    for cls in classes:
        for base in cls.__mro__:
            if base.__module__ in ("builtins",) or base is torch.nn.Module:
                continue
            names.append(base.__module__)
            if is_own(base.__module__):
                # a model built on a graphbuild class: that class's file, not all of graphbuild
                path = find_file(base.__module__)
                if path is not None:
                    out[base.__module__] = file_digest(path)
            elif base.__module__ == "__main__" or not find_file(base.__module__):
                out[f"<source {_qualname(base)}>"] = _class_source_digest(base)
    out.update(code_closure(dict.fromkeys(names)))
    return dict(sorted(out.items()))


def _module_file(name: str) -> str | None:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return path if path and os.path.exists(path) else None


def _class_source_digest(cls: type) -> str:
    try:
        return digest_bytes(inspect.getsource(cls).encode())
    except (OSError, TypeError) as err:
        raise FingerprintError(
            f"cannot read the source of {_qualname(cls)} ({err}); define it in a file, or "
            "give the stage an explicit version"
        ) from err


def callable_version(fn: Callable) -> str:
    """Digest of a callable's code: its source, defaults and closure values."""
    if id(fn) in _ACTIVE.ids:  # a recursive closure: its code is being digested already
        return f"cycle:{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    _ACTIVE.ids.add(id(fn))
    try:
        return _callable_version(fn)
    finally:
        _ACTIVE.ids.discard(id(fn))


def _callable_version(fn: Callable) -> str:
    if isinstance(fn, functools.partial):
        return digest_json(
            [callable_version(fn.func), fingerprint(list(fn.args)), fingerprint(fn.keywords)]
        )
    if isinstance(fn, types.MethodType) and not isinstance(fn.__self__, type):
        # a bound method: its function, and the object it is bound to
        return digest_json([callable_version(fn.__func__), fingerprint(fn.__self__)])
    target = getattr(fn, "__func__", fn)
    module_name = getattr(target, "__module__", None) or ""
    path = _module_file(module_name)
    if path is not None and is_library(path):
        return (
            f"{module_name}.{getattr(target, '__qualname__', '?')}@{library_version(module_name)}"
        )
    if not hasattr(target, "__code__") and callable(target) and not isinstance(target, type):
        # a callable object: its class code and its attributes
        return digest_json(fingerprint(target))
    try:
        source = _source(target)
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        if code is None:
            name = getattr(target, "__qualname__", None) or stable_text(repr(target), "a builtin")
            return f"builtin:{getattr(target, '__module__', '')}.{name}"
        source = _code_form(code)
    parts: list[Any] = [source]
    defaults = getattr(target, "__defaults__", None)
    if defaults:
        parts.append(fingerprint(list(defaults)))
    kwdefaults = getattr(target, "__kwdefaults__", None)
    if kwdefaults:
        parts.append({"kwdefaults": fingerprint(dict(kwdefaults))})
    closure = getattr(target, "__closure__", None)
    if closure:
        parts.append([_closure_value(c) for c in closure])
    return digest_json(parts)


# code object -> (digest of its file, its source): inspect.getsource tokenizes the whole
# file, once per process and file version is enough
_SOURCES: dict[types.CodeType, tuple[str, str]] = {}


def _source(target: Any) -> str:
    code = getattr(target, "__code__", None)
    if code is None:
        return inspect.getsource(target)
    try:
        version = file_digest(code.co_filename)
    except (OSError, ValueError):
        return inspect.getsource(target)
    known = _SOURCES.get(code)
    if known is not None and known[0] == version:
        return known[1]
    linecache.updatecache(code.co_filename)  # its (mtime, size) check can miss an edit
    source = _code_source(code)
    _SOURCES[code] = (version, source)
    return source


# where a function's source starts, as inspect.findsource looks for it
_DEF_LINE = re.compile(r"^(\s*def\s)|(\s*async\s+def\s)|(.*(?<!\w)lambda(:|\s))|^(\s*@)")


def _code_source(code: types.CodeType) -> str:
    """inspect.getsource of a function, without inspect.getmodule (which scans every
    loaded module on a miss): the block that starts at its first line in its file."""
    lines = linecache.getlines(code.co_filename)
    if not lines:
        raise OSError(f"could not get the source of {code.co_name}")
    lnum = code.co_firstlineno - 1
    if lnum >= len(lines):
        raise OSError(f"{code.co_filename} has no line {code.co_firstlineno}")
    while lnum > 0 and not _DEF_LINE.match(lines[lnum]):
        lnum -= 1
    return "".join(inspect.getblock(lines[lnum:]))


def _code_form(code: types.CodeType) -> Any:
    """A code object without its source, in a form that is the same in every process: the
    default ``repr`` of a nested code object holds its address, and a frozenset constant's
    order follows string hash randomization."""
    return [
        digest_bytes(code.co_code),
        [_const_form(c) for c in code.co_consts],
        list(code.co_names),
    ]


def _const_form(value: Any) -> Any:
    if isinstance(value, types.CodeType):
        return {"code": _code_form(value)}
    if isinstance(value, (frozenset, set)):
        return {"set": sorted((_const_form(v) for v in value), key=digest_json)}
    if isinstance(value, tuple):
        return [_const_form(v) for v in value]
    if isinstance(value, float):
        return {"float": value.hex()}
    if isinstance(value, (str, int, bool, type(None))):
        return value
    return {type(value).__name__: stable_text(repr(value), "a code constant")}


def _closure_value(cell: types.CellType) -> Any:
    try:
        value = cell.cell_contents
    except ValueError:
        return None
    return fingerprint(value)


def code_identity(obj: Any) -> Any:
    """A registered object (a recogniser, a codec, a preset factory, a fingerprint function)
    as code: its source, the source files it can reach, and its configuration (attributes);
    fingerprinted like a stage's code, so registering or editing one changes the keys of the
    stages that consult it."""
    if isinstance(obj, functools.partial):
        return {
            "partial": code_identity(obj.func),
            "args": fingerprint(list(obj.args)),
            "keywords": fingerprint(dict(obj.keywords)),
        }
    target = getattr(obj, "__func__", obj)
    if isinstance(target, type):
        return {"class": _qualname(target), "files": _files_of(target.__module__)}
    if hasattr(target, "__code__"):
        module = getattr(target, "__module__", None) or ""
        return {"function": callable_version(target), "files": _files_of(module)}
    return {"object": fingerprint(obj), "files": _files_of(type(obj).__module__)}


def stage_code_version(fn: Callable) -> str:
    """A stage's code version: its source (``callable_version``) and the source files its
    code can reach: its own module's file, the modules it imports (inside the function or
    at the top of its file, for the names it uses), and theirs, transitively. graphbuild's
    own stages key on exactly the files they use, not on the whole package."""
    return digest_json({"fn": callable_version(fn), "files": function_files(fn)})


def _files_of(module: str) -> dict[str, str]:
    if module == "__main__" or not find_file(module):
        return {}
    return code_closure([module], own=is_own(module))


#: Registries that stages consult, by name: a stage that declares ``"registry.<name>"`` keys
#: on the code and configuration of every entry (DESIGN.md, invariant 9).
_REGISTRIES: dict[str, Callable[[], Iterable[Any]]] = {}


def register_registry(name: str, entries: Callable[[], Iterable[Any]]) -> None:
    """Make ``"registry.<name>"`` a read: ``entries()`` returns the registered objects (or a
    mapping of names to them) at the time a key is computed."""
    _REGISTRIES[name] = entries


def read_registry(name: str) -> Reading:
    entries = _REGISTRIES.get(name)
    if entries is None:
        known = ", ".join(sorted(_REGISTRIES)) or "none"
        return Reading(None, reason=f"registry.{name}: no such registry (known: {known})")
    try:
        current = entries()
        if isinstance(current, Mapping):
            form: Any = {"entries": [[k, code_identity(v)] for k, v in sorted(current.items())]}
        else:
            form = [code_identity(v) for v in current]
    except FingerprintError as err:
        return Reading(None, reason=f"registry.{name}: {err}")
    digest = digest_json(form)
    size = len(form["entries"]) if isinstance(form, dict) else len(form)
    return Reading(digest, f"{size} entries <{digest[:12]}>")


# --------------------------------------------------------------------------- facets


@dataclass(frozen=True)
class Reading:
    """What one declared read saw: a digest, a short value for people, and details
    (per tensor, per submodule) that let ``explain`` say what changed. ``digest`` is None
    when the read could not be fingerprinted; ``reason`` then says why."""

    digest: str | None
    value: Any = None
    details: dict[str, str] = field(default_factory=dict)
    reason: str | None = None


def read_value(value: Any) -> Reading:
    """Reading of a context value: its canonical form, shown whole when it is short."""
    try:
        fp = fingerprint(value)
    except FingerprintError as err:
        return Reading(None, reason=str(err))
    shown = value if _is_plain(value) else _short(fp)
    return Reading(digest_json(fp), shown)


def _is_plain(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool, type(None))):
        return True
    if isinstance(value, (list, tuple)):
        return len(value) <= 16 and all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return len(value) <= 16 and all(
            isinstance(k, str) and _is_plain(v) for k, v in value.items()
        )
    return False


def _short(fp: Any) -> str:
    return f"<{digest_json(fp)[:12]}>"


class InputFacets:
    """Lazily computed facets of one run's pipeline input and sample inputs."""

    def __init__(self, pipeline_input: Any, samples: Any):
        self.pipeline_input = pipeline_input
        self.samples = samples
        self._cache: dict[str, Reading] = {}

    def read(self, facet: str) -> Reading:
        if facet.startswith("registry."):
            return read_registry(facet[len("registry.") :])
        if facet not in self._cache:
            self._cache[facet] = self._compute(facet)
        return self._cache[facet]

    def _compute(self, facet: str) -> Reading:
        try:
            if facet == "input.structure":
                return self._structure()
            if facet == "input.state":
                return self._state()
            if facet == "samples.spec":
                return _samples_spec(self.samples)
            if facet == "samples.values":
                return Reading(digest_json(fingerprint(self.samples)))
        except FingerprintError as err:
            return Reading(None, reason=f"{facet}: {err}")
        raise KeyError(facet)

    def _structure(self) -> Reading:
        obj = self.pipeline_input
        if isinstance(obj, torch.nn.Module):
            fp = structure_fingerprint(obj)
            return Reading(fp.digest, _short(fp.digest), dict(fp.modules))
        return Reading(digest_json(fingerprint(obj)))

    def _state(self) -> Reading:
        obj = self.pipeline_input
        if isinstance(obj, torch.nn.Module):
            sd = state_digests(obj)
            return Reading(sd.digest, f"{len(sd.tensors)} tensors", sd.tensors)
        return Reading(digest_json(fingerprint(obj)))


def _samples_spec(samples: Any) -> Reading:
    leaves, spec = torch.utils._pytree.tree_flatten(samples)
    shown = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shown.append(f"{str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}")
        else:
            shown.append(fingerprint(leaf))
    value = [stable_text(str(spec), "the sample inputs' pytree spec"), shown]
    return Reading(digest_json(value), shown if len(shown) <= 8 else _short(value))


# the fingerprint functions graphbuild registers itself; any other registration carries its code
_BUILTIN_FINGERPRINTS = frozenset(fingerprint_type.registry.values())
