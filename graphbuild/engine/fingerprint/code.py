"""Code versions: a callable's source, defaults and closure values; a class's files.

``callable_version`` digests what a function computes; ``stage_code_version`` adds the source
files its code can reach (:mod:`~graphbuild.engine.closure`); ``code_identity`` is how a
registered object (a recogniser, a codec, a preset factory) counts as code.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import os
import re
import sys
import textwrap
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from graphbuild.engine.closure import code_closure, function_files
from graphbuild.engine.fingerprint.walk import _ACTIVE, _qualname, fingerprint, stable_text
from graphbuild.engine.sources import (
    code_digest,
    file_digest,
    find_file,
    is_library,
    is_own,
    library_version,
    source_code_digest,
)
from graphbuild.errors import FingerprintError
from graphbuild.hashing import digest_bytes, digest_json


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
                    out[base.__module__] = code_digest(path)
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


# code object -> (digest of its file, its source's code digest): inspect.getsource tokenizes
# the whole file, once per process and file version is enough
_SOURCES: dict[types.CodeType, tuple[str, str]] = {}


def _source(target: Any) -> str:
    """The digest of ``target``'s source as code (comments and docstrings do not count:
    :func:`~graphbuild.engine.sources.source_code_digest`)."""
    code = getattr(target, "__code__", None)
    if code is None:
        return _code_of(inspect.getsource(target))
    try:
        version = file_digest(code.co_filename)
    except (OSError, ValueError):
        return _code_of(inspect.getsource(target))
    known = _SOURCES.get(code)
    if known is not None and known[0] == version:
        return known[1]
    linecache.updatecache(code.co_filename)  # its (mtime, size) check can miss an edit
    source = _code_of(_code_source(code))
    _SOURCES[code] = (version, source)
    return source


def _code_of(source: str) -> str:
    return source_code_digest(textwrap.dedent(source))


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
