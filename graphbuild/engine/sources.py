"""Where a module's source lives, and what version it is, found without importing it.

A module's file is found on disk (``sys.modules`` first: ``__main__`` and modules built in
memory exist nowhere else); a file is read again only when its (mtime, size) changed or was
too recent to vouch for its contents, and counts by the digest of its code
(:func:`code_digest`: the syntax tree without docstrings, so an edited comment, docstring or
layout keeps every key); an installed library (the
standard library, site-packages) counts by its distribution's version, and graphbuild's own
modules by graphbuild's version in a model's closure. :mod:`~graphbuild.engine.closure`
follows names through these files.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import sysconfig
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphbuild.engine import source_memo
from graphbuild.hashing import digest_bytes

__all__ = [
    "code_digest",
    "file_digest",
    "find_file",
    "forget",
    "is_library",
    "is_own",
    "library_label",
    "library_version",
]


@functools.cache
def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple(sorted(os.path.realpath(r) + os.sep for r in roots))


def is_source(path: str) -> bool:
    """Whether a module's file is Python source; else a compiled extension (``.so``,
    ``.pyd``) or bytecode without its source, which no closure can read past."""
    return path.endswith(tuple(importlib.machinery.SOURCE_SUFFIXES))


@functools.lru_cache(maxsize=4096)
def is_library(path: str) -> bool:
    real = os.path.realpath(path)
    return real.startswith(_library_roots()) or "site-packages" in real or "dist-packages" in real


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


def library_version(module_name: str) -> str:
    """What an installed library counts as: the Python minor version for the standard library
    (never the build: two builds of 3.11 share a cache), else its distribution's version.
    Read from the installed metadata once per process, and kept in the run's cache for the
    next process while the ``sys.path`` directories are as they were
    (:func:`~graphbuild.engine.source_memo.environment_stamp`)."""
    top = module_name.split(".")[0]
    if top in sys.stdlib_module_names or top == "builtins":
        return f"python {sys.version_info[0]}.{sys.version_info[1]}"
    known = _versions.get(top)
    if known is None:
        table, key = _installed()
        known = table.get(top) if type(table.get(top)) is str else None
        if known is None:
            known = _read_version(top)
            table[top] = known
            if key is not None:
                source_memo.put(key, "library versions", dict(sorted(table.items())))
        _versions[top] = known
    return known


_versions: dict[str, str] = {}
_tables: dict[str, dict[str, Any]] = {}


def _installed() -> tuple[dict[str, Any], str | None]:
    """The versions known for this environment (read from the run's cache once), and the
    name of their record (None while the environment is changing)."""
    stamp = source_memo.environment_stamp()
    if stamp is None:
        return {}, None
    key = source_memo.record_key("library versions", stamp)
    if key not in _tables:
        found = source_memo.get(key, "library versions")
        _tables[key] = dict(found) if type(found) is dict else {}
    return _tables[key], key


def _read_version(top: str) -> str:
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


def forget() -> None:
    """Forget what this process learnt about files and libraries (tests: a new process)."""
    _versions.clear()
    _tables.clear()
    _file_cache.clear()
    _code_digests.clear()
    _distributions.cache_clear()
    _is_library_package.cache_clear()
    is_library.cache_clear()
    _library_roots.cache_clear()


#: A file modified less than this long before its digest was taken may be rewritten within
#: the same clock tick with the same size: its (mtime, size) proves nothing ("racily clean",
#: as git calls it), so its contents are digested again at every use.
RACY_NS = 2_000_000_000

# path -> (mtime_ns, size, digest, whether (mtime, size) alone may vouch for the digest)
_file_cache: dict[str, tuple[int, int, str, bool]] = {}


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


def file_digest(path: str) -> str:
    """xxh3 of the file's bytes, read again only when its (mtime, size) changed or was
    too recent to vouch for its contents."""
    mtime, size = _stamp(path)
    known = _file_cache.get(path)
    if known is not None and known[:2] == (mtime, size) and known[3]:
        return known[2]
    digest = digest_bytes(Path(path).read_bytes())
    _file_cache[path] = (mtime, size, digest, time.time_ns() - mtime > RACY_NS)
    return digest


# file digest -> code digest: a pure function of the bytes
_code_digests: dict[str, str] = {}


def code_digest(path: str) -> str:
    """The digest of a Python file's code, not of its text: its syntax tree without
    docstrings (:func:`source_code_digest`), so comments, docstrings and layout do not count.
    Computed once per process and file version, and kept in the run's cache for the next
    process (:mod:`~graphbuild.engine.source_memo`), named by the file's bytes."""
    raw = file_digest(path)
    known = _code_digests.get(raw)
    if known is None:
        key = source_memo.record_key("code", raw, file_digest(__file__))
        found = source_memo.get(key, "code")
        if type(found) is str:
            known = found
        else:
            known = source_code_digest(Path(path).read_bytes(), path)
            source_memo.put(key, "code", known)
        _code_digests[raw] = known
    return known


def module_digest(path: str) -> str:
    """What a module's file counts as: the digest of its code (:func:`code_digest`), or of its
    bytes where it is compiled (:func:`is_source`)."""
    return code_digest(path) if is_source(path) else f"compiled {file_digest(path)}"


def source_code_digest(source: bytes | str, filename: str = "<source>") -> str:
    """The digest of ``source``'s syntax tree without docstrings, written out field by field
    with empty fields left out (so the same code digests alike under the Python versions
    graphbuild supports, whose trees differ by fields that are empty here: ``type_params``);
    source that does not parse counts by its bytes."""
    try:
        tree = ast.parse(source, filename=filename)
    except (SyntaxError, ValueError):
        return digest_bytes(source.encode() if isinstance(source, str) else source)
    out: list[str] = []
    _normal_form(tree, out)
    return digest_bytes("".join(out).encode())


_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _normal_form(node: Any, out: list[str]) -> None:
    if isinstance(node, list):
        out.append("[")
        for item in node:
            _normal_form(item, out)
            out.append(",")
        out.append("]")
    elif isinstance(node, ast.AST):
        out.append(f"{type(node).__name__}(")
        for name, value in ast.iter_fields(node):
            if name == "body" and isinstance(node, _DOCUMENTED) and _is_docstring(value[:1]):
                value = value[1:]
            if value is None or (isinstance(value, list) and not value):
                continue
            out.append(f"{name}=")
            _normal_form(value, out)
            out.append(",")
        out.append(")")
    else:
        out.append(f"{type(node).__name__}:{node!r}")


def _is_docstring(first: list[ast.stmt]) -> bool:
    return (
        bool(first)
        and isinstance(first[0], ast.Expr)
        and isinstance(first[0].value, ast.Constant)
        and isinstance(first[0].value.value, str)
    )


def is_own(name: str) -> bool:
    """graphbuild's own modules: covered by its version in a model's closure, never by
    following them (what a script's ``import graphbuild`` has loaded so far must not matter)."""
    return name == "graphbuild" or name.startswith("graphbuild.")


@functools.cache
def _graphbuild_version() -> str:
    try:
        return f"graphbuild {importlib.metadata.version('graphbuild')}"
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - always installed
        return "graphbuild (unversioned)"


def find_file(name: str) -> str | None:
    """The source file of module ``name``, found on disk without importing anything;
    ``sys.modules`` is consulted first (``__main__``, a module built in memory exist nowhere
    else, and a loaded module's file is the one found on disk anyway)."""
    module = sys.modules.get(name)
    if module is not None:
        path = getattr(module, "__file__", None)
    else:
        spec = _find_spec(name)
        path = getattr(spec, "origin", None) if spec is not None else None
    if not path or not os.path.exists(path):
        return None
    return path


@functools.cache
def _is_library_package(top: str) -> bool:
    """Whether a top-level module or package (a namespace package too) is installed."""
    module = sys.modules.get(top)
    if module is not None:
        places = [getattr(module, "__file__", None), *getattr(module, "__path__", ())]
    else:
        spec = _find_spec(top)
        if spec is None:
            return False
        places = [spec.origin, *(spec.submodule_search_locations or ())]
    return any(p and os.path.exists(p) and is_library(p) for p in places)


def _find_spec(name: str) -> Any:
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return None
    prefix = top
    for part in rest:
        parent = sys.modules.get(prefix)
        if parent is not None:
            locations = getattr(parent, "__path__", None)
        else:
            locations = spec.submodule_search_locations if spec is not None else None
        if not locations:
            return None
        prefix = f"{prefix}.{part}"
        try:
            spec = importlib.machinery.PathFinder.find_spec(prefix, list(locations))
        except (ImportError, ValueError, KeyError):  # a namespace path whose parent is gone
            return None
        if spec is None:
            return None
    return spec


def library_label(name: str, own: bool) -> tuple[str, str] | None:
    """("<lib top>", version) when ``name`` is not followed: the standard library, an
    installed package, or graphbuild itself in a model's closure."""
    top = name.split(".")[0]
    if is_own(name) and not own:
        return "<lib graphbuild>", _graphbuild_version()
    if top in sys.builtin_module_names or top in sys.stdlib_module_names:
        return f"<lib {top}>", library_version(name)
    if _is_library_package(top):
        return f"<lib {top}>", library_version(name)
    return None
