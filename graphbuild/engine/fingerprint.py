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
import importlib.metadata
import inspect
import os
import sys
import sysconfig
import threading
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

import torch

from graphbuild.engine.hashing import Hasher, digest_bytes, digest_json
from graphbuild.engine.pipeline import FACETS
from graphbuild.errors import FingerprintError

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


class _Walk:
    """State of one recursive fingerprint: cycle guard and the path for error messages."""

    def __init__(self) -> None:
        self.active: set[int] = set()
        self.path: list[str] = []

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
        return {
            "object": _qualname(cls),
            "code": code_fingerprint([cls]),
            "attrs": {
                k: walk.child(k, v) for k, v in sorted(state.items()) if not k.startswith("__")
            },
        }
    slots = _slot_values(value)
    if slots is not None:
        return {"object": _qualname(cls), "attrs": {k: walk.child(k, v) for k, v in slots}}
    raise FingerprintError(
        f"cannot fingerprint {'.'.join(walk.path)} of type {_qualname(cls)}; register it with "
        f"@graphbuild.engine.fingerprint.fingerprint_type.register({cls.__name__})"
    )


def _fp(value: Any, walk: _Walk) -> Any:
    return fingerprint_type(value, walk)


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


@fingerprint_type.register(torch.dtype)
@fingerprint_type.register(torch.device)
@fingerprint_type.register(torch.memory_format)
@fingerprint_type.register(torch.layout)
def _(value: Any, walk: _Walk) -> Any:
    return {"torch": str(value)}


@fingerprint_type.register(torch.Size)
def _(value: torch.Size, walk: _Walk) -> Any:
    return {"size": list(value)}


@fingerprint_type.register(torch.Tensor)
def _(value: torch.Tensor, walk: _Walk) -> Any:
    return {"tensor": tensor_digest(value), "dtype": str(value.dtype), "shape": list(value.shape)}


@fingerprint_type.register(types.ModuleType)
def _(value: types.ModuleType, walk: _Walk) -> Any:
    return {"module": value.__name__}


@fingerprint_type.register(types.FunctionType)
@fingerprint_type.register(types.BuiltinFunctionType)
@fingerprint_type.register(types.MethodType)
@fingerprint_type.register(functools.partial)
def _(value: Any, walk: _Walk) -> Any:
    return {"function": callable_version(value)}


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
    # A module held as an option (not the pipeline input): its structure and its values.
    if id(value) in _ACTIVE.ids:
        return {"module-cycle": _qualname(type(value))}
    return {"module": structure_fingerprint(value).digest, "state": state_digests(value).digest}


try:
    import numpy as np

    @fingerprint_type.register(np.ndarray)
    def _(value: np.ndarray, walk: _Walk) -> Any:
        arr = np.ascontiguousarray(value)
        return {"ndarray": digest_bytes(arr.view(np.uint8).reshape(-1)), "dtype": str(arr.dtype)}

    @fingerprint_type.register(np.generic)
    def _(value: Any, walk: _Walk) -> Any:
        return {"numpy": str(value.dtype), "value": value.item().__repr__()}

except ImportError:  # pragma: no cover - numpy ships with torch
    pass


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
    digests = dict(zip(unique, tensor_digests(list(unique.values())), strict=True))
    out: dict[str, str] = {}
    for name, t in named:
        if t is None:
            continue
        d = digests[idents[name]] if name in idents else f"empty:{t.device.type}"
        out[name] = f"{t.dtype}{list(t.shape)}:{d}"
    return StateDigests(digest_json(sorted(out.items())), out)


#: Below this many bytes in all, tensors are hashed one after the other.
PARALLEL_BYTES = 64 << 20
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def tensor_digests(tensors: Sequence[torch.Tensor]) -> list[str]:
    """``tensor_digest`` of each tensor, spread over a thread per core when there is enough to
    hash: xxhash releases the GIL, so a model's weights hash at the speed of all cores. Tensors
    off the CPU go one at a time (they share a staging buffer per thread)."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    workers = min(os.cpu_count() or 1, 16)
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    if workers < 2 or len(tensors) < 2 or total < PARALLEL_BYTES or not on_cpu:
        return [tensor_digest(t) for t in tensors]
    return list(_hash_pool(workers).map(tensor_digest, tensors))


def _hash_pool(workers: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="graphbuild-hash")
        return _POOL


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
    classes: list[type] = []
    modules: dict[str, str] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        classes.append(type(sub))
        walk = _Walk()
        walk.path.append(name or "<root>")
        attrs = {}
        for k, v in sorted(vars(sub).items()):
            if k in _SKIP_ATTRS:
                continue
            if isinstance(v, dict) and k.startswith("_") and k.endswith("hooks") and not v:
                continue
            attrs[k] = walk.child(k, v)
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


@functools.cache
def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple(sorted(os.path.realpath(r) + os.sep for r in roots))


def _is_library(path: str) -> bool:
    real = os.path.realpath(path)
    return real.startswith(_library_roots()) or "site-packages" in real or "dist-packages" in real


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.cache
def _library_version(module_name: str) -> str:
    top = module_name.split(".")[0]
    if top in sys.stdlib_module_names or top == "builtins":
        return f"python {sys.version.split()[0]}"
    try:  # the common case, import name == distribution name: no scan of every package
        return f"{top} {importlib.metadata.version(top)}"
    except (importlib.metadata.PackageNotFoundError, ValueError):
        pass
    dists = _distributions().get(top, [])
    versions = []
    for dist in dists:
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(sorted(versions)) or f"{top} (unversioned)"


_file_cache: dict[tuple[str, int, int], str] = {}


def _file_digest(path: str) -> str:
    st = os.stat(path)
    ident = (path, st.st_mtime_ns, st.st_size)
    if ident not in _file_cache:
        _file_cache[ident] = digest_bytes(Path(path).read_bytes())
    return _file_cache[ident]


def _module_deps(module: types.ModuleType) -> Iterable[str]:
    """Names of the modules a module's globals come from (its imports)."""
    for value in list(vars(module).values()):
        if isinstance(value, types.ModuleType):
            yield value.__name__
        else:
            owner = getattr(value, "__module__", None)
            if isinstance(owner, str):
                yield owner


def code_fingerprint(classes: Iterable[type]) -> dict[str, str]:
    """Source digests of the files defining ``classes`` (and their bases) and of every
    module they import from outside site-packages, transitively; versions of the installed
    distributions the rest comes from. Raises FingerprintError when source is unavailable."""
    out: dict[str, str] = {}
    todo: list[str] = []
    for cls in classes:
        for base in cls.__mro__:
            if base.__module__ in ("builtins",) or base is torch.nn.Module:
                continue
            todo.append(base.__module__)
            if base.__module__ == "__main__" or not _module_file(base.__module__):
                out[f"<source {_qualname(base)}>"] = _class_source_digest(base)
    done: set[str] = set()
    while todo:
        name = todo.pop()
        if name in done:
            continue
        done.add(name)
        path = _module_file(name)
        if path is None or _is_library(path):
            lib = _library_version(name)
            out[f"<lib {name.split('.')[0]}>"] = lib
            continue
        out[os.path.realpath(path)] = _file_digest(path)
        todo.extend(_module_deps(sys.modules[name]))
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
    target = getattr(fn, "__func__", fn)
    module_name = getattr(target, "__module__", None) or ""
    path = _module_file(module_name)
    if path is not None and _is_library(path):
        return (
            f"{module_name}.{getattr(target, '__qualname__', '?')}@{_library_version(module_name)}"
        )
    if not hasattr(target, "__code__") and callable(target) and not isinstance(target, type):
        # a callable object: its class code and its attributes
        return digest_json(fingerprint(target))
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        if code is None:
            return f"builtin:{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"
        source = repr((code.co_code, code.co_consts, code.co_names))
    parts: list[Any] = [source]
    defaults = getattr(target, "__defaults__", None)
    if defaults:
        parts.append(fingerprint(list(defaults)))
    closure = getattr(target, "__closure__", None)
    if closure:
        parts.append([_closure_value(c) for c in closure])
    return digest_json(parts)


def _closure_value(cell: types.CellType) -> Any:
    try:
        value = cell.cell_contents
    except ValueError:
        return None
    return fingerprint(value)


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
    value = [str(spec), shown]
    return Reading(digest_json(value), shown if len(shown) <= 8 else _short(value))
