"""Code closures: the source files a piece of code can reach, read from the files alone.

A closure follows *names*, not whole modules. A function reaches the names it uses; a name
defined in a file reaches the names its definition uses (a ``def`` or ``class`` body, the
right-hand side of ``x = ...``, decorators, bases); an imported name reaches its definition
in the module it comes from; ``import m`` reaches all of ``m``. Every file reached counts by
the digest of its code (:func:`~graphbuild.engine.sources.code_digest`: comments and
docstrings do not count; a compiled module by its bytes), installed libraries by their versions. A statement a module runs for its effect
counts with the names it changes (``TABLE["k"] = ...`` with ``TABLE``); a definition that
looks names up by string (``globals()``, ``eval``) takes the whole module, and a string that
names a module outside graphbuild (``import_module("pkg.mod")``) takes that module.
graphbuild's own imports by name (declared codecs, built-in presets) and registrations into
another module are registries, which key their entries themselves (``registry.*`` reads,
codec versions): a forward closure cannot see who registers into a registry.

So a stage keys on exactly the code it can run: editing ``onnx/save.py`` does not rerun
``to_onnx``, while ``scale = _helper.scale`` at the top of a stage's file follows into
``_helper``. Nothing here imports a module or reads ``sys.modules`` beyond locating files
(``__main__`` and modules built in memory exist nowhere else): a closure is a function of
the source files, the same in every process and whatever the process imported. Where a
module's file is and what a file or library counts as is :mod:`~graphbuild.engine.sources`.

Closures are memoized per process and revalidated on every use against each file they read:
by (mtime_ns, size), and by contents while a file is too recently modified for those to
vouch for it (two writes of the same size within one clock tick). An edit is seen at the
next key computation, and a warm run computes each closure once.
"""

from __future__ import annotations

import ast
import collections
import functools
import inspect
import os
import re
import sys
import textwrap
import threading
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphbuild.engine import source_memo, sources
from graphbuild.engine.sources import (
    code_digest,
    file_digest,
    find_file,
    is_library,
    is_own,
    library_label,
    library_version,
)
from graphbuild.errors import FingerprintError

__all__ = [
    "class_named_by",
    "code_closure",
    "forget",
    "function_files",
    "is_library",
    "library_version",
    "find_file",
    "file_digest",
    "is_own",
    "name_closure",
]

#: (module, name or None for the whole module, whether the name must exist there: it was
#: imported from that module, so a missing one is a submodule or set at run time)
Need = tuple[str, "str | None", bool]

# Names through which a definition reaches other names by string.
_DYNAMIC = frozenset({"globals", "vars", "eval", "exec", "__import__", "locals"})
_MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


# --------------------------------------------------------------------------- one file


@dataclass
class _ModuleInfo:
    """What a source file defines at the top level, and what each definition uses."""

    package: str
    uses: dict[str, list[Need]] = field(default_factory=dict)  # top-level name -> needs
    star: list[str] = field(default_factory=list)  # ``from m import *``


_info_cache: dict[tuple[str, str, str], _ModuleInfo] = {}


def _module_info(path: str, name: str) -> _ModuleInfo:
    """What file ``path`` (module ``name``) defines and uses: parsed once per process and
    file version, and kept in the run's cache (:mod:`~graphbuild.engine.source_memo`) for
    the next process, named by the file's digest."""
    digest = file_digest(path)
    ident = (path, name, digest)
    info = _info_cache.get(ident)
    if info is None:
        is_init = os.path.basename(path) == "__init__.py"
        key = source_memo.record_key("module", name, is_init, digest, file_digest(__file__))
        info = _info_from_json(source_memo.get(key, "module"))
        if info is None:
            info = _parse_module(Path(path).read_bytes(), path, name)
            source_memo.put(key, "module", _info_to_json(info))
        _info_cache[ident] = info
    return info


def _info_to_json(info: _ModuleInfo) -> dict[str, Any]:
    return {
        "package": info.package,
        "uses": {n: [list(need) for need in needs] for n, needs in info.uses.items()},
        "star": list(info.star),
    }


def _info_from_json(value: Any) -> _ModuleInfo | None:
    """A summary as :func:`_info_to_json` wrote it; None for anything else (read from a
    cache: untrusted)."""
    if type(value) is not dict or type(value.get("package")) is not str:
        return None
    uses, star = value.get("uses"), value.get("star")
    if type(uses) is not dict or type(star) is not list or not all(type(m) is str for m in star):
        return None
    info = _ModuleInfo(value["package"], star=list(star))
    for bound, needs in uses.items():
        if type(needs) is not list:
            return None
        for need in needs:
            if (
                type(need) is not list
                or len(need) != 3
                or type(need[0]) is not str
                or type(need[1]) not in (str, type(None))
                or type(need[2]) is not bool
            ):
                return None
        info.uses[bound] = [(m, n, strict) for m, n, strict in needs]
    return info


def _parse(source: bytes | str, path: str) -> ast.Module:
    try:
        return ast.parse(source, filename=path)
    except (SyntaxError, ValueError) as err:
        raise FingerprintError(f"cannot parse {path} to find what it uses ({err})") from err


def _parse_module(source: bytes, path: str, name: str) -> _ModuleInfo:
    """Top-level bindings and what each uses. A statement run for its effect counts with
    the names it changes: ``TABLE[k] = v`` and ``TABLE.update(...)`` with ``TABLE``, a call
    of a function of this file with the globals that function changes. A call into another
    module (``register_codec(...)``) registers into a registry there, which keys its entries
    itself (``registry.*`` reads, codec versions); a condition counts with what its block
    defines."""
    package = name if os.path.basename(path) == "__init__.py" else name.rpartition(".")[0]
    info = _ModuleInfo(package)
    effects: list[tuple[ast.AST, list[Need]]] = []  # effect statement, what it runs under
    defs: dict[str, list[ast.AST]] = {}
    used: set[str] = set()  # every name the file reads

    def uses(nodes: Iterable[ast.AST]) -> list[Need]:
        return _uses(nodes, name, package, used)

    def bind(bound: str, needs: list[Need]) -> None:
        info.uses.setdefault(bound, []).extend(needs)

    def visit(body: list[ast.stmt], heads: list[Need]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs.setdefault(node.name, []).append(node)
                bind(node.name, [*heads, *uses([node])])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    bind(
                        alias.asname or alias.name.split(".")[0], [*heads, (alias.name, None, True)]
                    )
            elif isinstance(node, ast.ImportFrom):
                base = _import_base(node, package)
                for alias in node.names:
                    if not base:
                        continue
                    if alias.name == "*":
                        info.star.append(base)
                    else:
                        bind(alias.asname or alias.name, [*heads, (base, alias.name, True)])
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = [node.value] if node.value is not None else []
                elements = [
                    e
                    for t in targets
                    for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
                ]
                needs = [*heads, *uses(value)]
                for e in elements:
                    if isinstance(e, ast.Name):  # x = ...: a binding (x += ...: keeps x)
                        bind(e.id, needs)
                    else:  # TABLE[k] = ..., obj.attr = ...: an effect on TABLE, obj
                        effects.append((e, [*needs, *uses([e])]))
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                parts = [getattr(node, a) for a in ("test", "iter") if hasattr(node, a)]
                parts += [item.context_expr for item in getattr(node, "items", [])]
                inner = [*heads, *uses(parts)]
                if isinstance(node, ast.For):
                    for e in ast.walk(node.target):
                        if isinstance(e, ast.Name):
                            bind(e.id, inner)
                for part in ("body", "orelse", "finalbody"):
                    visit(getattr(node, part, []), inner)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body, inner)
            elif isinstance(node, ast.Expr):
                effects.append((node.value, [*heads, *uses([node])]))

    tree = _parse(source, path)
    visit(tree.body, [])
    for target, needs in effects:
        for changed in _changed_names(target, defs):
            if changed in info.uses:
                bind(changed, needs)
    # an import whose name the file never uses is there for its effect (programs.py imports
    # markers to register an op): it counts with everything the module defines
    used |= _exported_names(tree)
    imported_for_effect = [
        need
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
        if alias.name != "*" and (alias.asname or alias.name.split(".")[0]) not in used
        for need in info.uses.get(alias.asname or alias.name.split(".")[0], [])
    ]
    for bound in list(info.uses):
        info.uses[bound] = [*info.uses[bound], *imported_for_effect]
    return info


def _exported_names(tree: ast.Module) -> set[str]:
    """The names a file's ``__all__`` exports (a re-export counts as a use)."""
    used: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            used |= {
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
    return used


def _changed_names(node: ast.AST, defs: Mapping[str, list[ast.AST]]) -> set[str]:
    """The top-level names an effect statement changes: the root of a subscript or an
    attribute target, the receiver of a method call, or what a function of this file that
    it calls changes (its ``global`` names, the roots it assigns into or calls methods of)."""
    root = _root_name(node)
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):
            out: set[str] = set()
            for d in defs.get(func.id, []):
                out |= _changed_by(d)
            return out
        root = _root_name(func.value) if isinstance(func, ast.Attribute) else None
    return {root} if root else set()


def _changed_by(definition: ast.AST) -> set[str]:
    out: set[str] = set()
    for sub in ast.walk(definition):
        if isinstance(sub, ast.Global):
            out.update(sub.names)
        elif isinstance(sub, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = sub.targets if isinstance(sub, (ast.Assign, ast.Delete)) else [sub.target]
            out.update(
                r
                for t in targets
                if isinstance(t, (ast.Subscript, ast.Attribute))
                for r in [_root_name(t)]
                if r
            )
        elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
            r = _root_name(sub.func.value)
            if r:
                out.add(r)
    return out


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Subscript, ast.Attribute, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _import_base(node: ast.ImportFrom, package: str) -> str:
    base = node.module or ""
    if node.level:
        parts = package.split(".") if package else []
        parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
        base = ".".join([*parts, *([base] if base else [])])
    return base


def _uses(
    nodes: Iterable[ast.AST], module: str, package: str, seen: set[str] | None = None
) -> list[Need]:
    """Needs of some code in ``module``: the names it uses (looked up in the same module),
    the imports inside it, module paths it names in strings (``import_module("a.b")``), and
    the whole module when it looks names up by string. The names are added to ``seen``."""
    out: list[Need] = []
    names: set[str] = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                names.add(sub.id)
            elif isinstance(sub, ast.Import):
                out += [(alias.name, None, True) for alias in sub.names]
            elif isinstance(sub, ast.ImportFrom):
                base = _import_base(sub, package)
                if base:
                    out += [(base, None if a.name == "*" else a.name, True) for a in sub.names]
            elif (
                isinstance(sub, ast.Constant)
                and isinstance(sub.value, str)
                and _MODULE_PATH.fullmatch(sub.value)
                and not is_own(sub.value)  # graphbuild's imports by name are registries
            ):
                out.append((sub.value, None, False))  # a module only if one exists there
    if names & _DYNAMIC:
        out.append((module, None, True))
    out += [(module, n, False) for n in sorted(names)]
    if seen is not None:
        seen |= names
    return out


# --------------------------------------------------------------------------- closures


class _Closure:
    """One closure computation: what it reached, and the files it read (to revalidate)."""

    def __init__(self, own: bool) -> None:
        self.own = own
        self.out: dict[str, str] = {}
        self.files: dict[str, str] = {}  # path -> digest, to revalidate a memoized closure
        self.resolved: dict[str, str | None] = {}  # module -> the file it was found in
        self.infos: dict[str, _ModuleInfo] = {}
        self.done: set[Need] = set()

    def find(self, module: str) -> str | None:
        if module not in self.resolved:
            self.resolved[module] = find_file(module)
        return self.resolved[module]

    def file(self, path: str) -> str:
        if path not in self.files:
            self.files[path] = file_digest(path)
        return self.files[path]

    def info(self, path: str, module: str) -> _ModuleInfo:
        if module not in self.infos:
            self.file(path)
            self.infos[module] = _module_info(path, module)
        return self.infos[module]

    def run(self, needs: Iterable[Need]) -> None:
        todo = collections.deque(needs)
        while todo:
            module, name, strict = todo.popleft()
            if not module or (module, name, strict) in self.done:
                continue
            self.done.add((module, name, strict))
            guessed = name is None and not strict  # a string that may name a module
            label = library_label(module, self.own)
            if label is not None:
                if not guessed:
                    self.out[label[0]] = label[1]
                continue
            path = self.find(module)
            if path is None:
                if not guessed:
                    top = module.split(".")[0]
                    self.out[f"<lib {top}>"] = library_version(module)
                continue
            if is_library(path):
                self.out[f"<lib {module.split('.')[0]}>"] = library_version(module)
                continue
            self.file(path)  # its bytes revalidate the memoized closure
            self.out[module] = sources.module_digest(path)
            if not sources.is_source(path):  # compiled: nothing to follow
                continue
            info = self.info(path, module)
            if name is None:
                todo.extend((module, n, False) for n in info.uses)
                todo.extend((m, None, True) for m in info.star)
            elif name in info.uses:
                todo.extend(info.uses[name])
            elif strict:  # imported from here but not defined here
                todo.extend(self._missing(module, name, info))
            else:  # a name this file uses: from a ``*`` import, or a builtin or a local
                todo.extend((m, name, False) for m in info.star)

    def _missing(self, module: str, name: str, info: _ModuleInfo) -> list[Need]:
        sub = f"{module}.{name}"
        if self.find(sub) is not None or library_label(sub, self.own) is not None:
            return [(sub, None, True)]  # ``from package import submodule``
        if info.star:
            return [(m, name, True) for m in info.star]
        return [(module, None, True)]  # set at run time: the whole module


class _Memo:
    """Closures by key, each valid while the files it read hold the same bytes (checked by
    (mtime, size), and by contents for a file too recently modified to trust those) and its
    module names still name the same files: a module imported since from its file, the same
    ``sys.path`` for those not imported (a name found in one project's directory must not
    stand for another project's module of the same name)."""

    def __init__(self) -> None:
        self.entries: dict[Any, tuple[dict[str, str], _Closure, tuple[str, ...]]] = {}
        self.lock = threading.Lock()

    def get(self, key: Any) -> dict[str, str] | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        out, closure, search_path = entry
        same_path = tuple(sys.path) == search_path
        for module, path in closure.resolved.items():
            loaded = sys.modules.get(module)
            if loaded is not None:
                if (getattr(loaded, "__file__", None) or None) != path:
                    return None
            elif not same_path:
                return None
        try:
            if all(file_digest(p) == d for p, d in closure.files.items()):
                return out
        except OSError:
            pass
        return None

    def put(self, key: Any, closure: _Closure) -> dict[str, str]:
        out = dict(sorted(closure.out.items()))
        with self.lock:
            self.entries[key] = (out, closure, tuple(sys.path))
        return out


_MEMO = _Memo()


def forget() -> None:
    """Forget every closure, summary and version this process computed, as a new process
    starts (what the run's cache keeps for the next process stays)."""
    with _MEMO.lock:
        _MEMO.entries.clear()
    _info_cache.clear()
    sources.forget()


def name_closure(needs: Iterable[Need], *, own: bool = False) -> dict[str, str]:
    """Digests of the files that the ``needs`` reach (see the module docstring); installed
    libraries as their versions. graphbuild's own modules are followed only with
    ``own=True`` (graphbuild's stages and codecs); a model's closure covers graphbuild by
    its version."""
    needs = tuple(needs)
    key = ("needs", needs, own)
    found = _MEMO.get(key)
    if found is not None:
        return found
    closure = _Closure(own)
    closure.run(needs)
    return _MEMO.put(key, closure)


def code_closure(modules: Iterable[str], *, own: bool = False) -> dict[str, str]:
    """The closure of whole modules (every name each defines)."""
    return name_closure([(m, None, True) for m in modules], own=own)


def function_files(fn: Callable) -> dict[str, str]:
    """The source files a function's code can reach: its own module's file and the
    definitions of every name it uses, transitively; functions and modules it holds in its
    closure cells, defaults or ``functools.partial`` arguments too."""
    out: dict[str, str] = {}
    _function_files(fn, out, set())
    return dict(sorted(out.items()))


def _function_files(fn: Any, out: dict[str, str], seen: set[int]) -> None:
    if id(fn) in seen:
        return
    seen.add(id(fn))
    held: list[Any] = []
    while isinstance(fn, functools.partial):
        held += [*fn.args, *fn.keywords.values()]
        fn = fn.func
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    fn = inspect.unwrap(fn) if hasattr(fn, "__wrapped__") else fn
    if isinstance(fn, type):
        out.update(_class_files(fn))
    elif not hasattr(fn, "__code__"):
        out.update(_class_files(type(fn)))  # a callable object: its class
    else:
        out.update(_code_files(fn))
        held += list(getattr(fn, "__defaults__", None) or ())
        held += list((getattr(fn, "__kwdefaults__", None) or {}).values())
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                held.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    for value in held:
        if isinstance(value, types.ModuleType):
            out.update(code_closure([value.__name__], own=True))
        elif isinstance(value, type) or (
            callable(value) and hasattr(inspect.unwrap(value), "__code__")
        ):
            _function_files(value, out, seen)


def _class_files(cls: type) -> dict[str, str]:
    module = cls.__module__
    path = find_file(module)
    if path is None or is_library(path):
        return {}
    top = cls.__qualname__.split(".")[0]
    return name_closure([(module, top, False)], own=True)


def _code_files(fn: Any) -> dict[str, str]:
    module = getattr(fn, "__module__", None) or ""
    path = find_file(module)
    if path is None or is_library(path):
        return {}
    code = fn.__code__
    key = ("function", module, code)
    found = _MEMO.get(key)
    if found is not None:
        return found
    closure = _Closure(own=True)
    closure.run(_function_needs(fn, module, path))
    closure.file(path)
    closure.out.setdefault(module, code_digest(path))
    return _MEMO.put(key, closure)


def _function_needs(fn: Any, module: str, path: str) -> list[Need]:
    qualname = getattr(fn, "__qualname__", "")
    top = qualname.split(".")[0]
    if "<" not in qualname and top in _module_info(path, module).uses:
        return [(module, top, False)]  # a top-level function or a method: its definition
    # nested (a closure, a lambda): the names its code uses, the imports in its source
    needs: list[Need] = []
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        needs += [(module, n, False) for n in code.co_names]
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    if fn.__name__ == "<lambda>":
        return needs  # a lambda holds no import statement
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return [*needs, (module, None, True)]
    package = module if os.path.basename(path) == "__init__.py" else module.rpartition(".")[0]
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return [*needs, (module, None, True)]
    return [*needs, *(n for n in _uses([tree], module, package) if n[0] != module)]


def class_named_by(module: str, attribute: str, value: str) -> str | None:
    """The top-level class of ``module`` whose body sets ``attribute = value`` (a codec's
    ``name = "onnx"``), read from the source without importing it; None if none does."""
    path = find_file(module)
    if path is None:
        return None
    tree = _parse(Path(path).read_bytes(), path)
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if (
                isinstance(stmt, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == attribute for t in stmt.targets)
                and isinstance(stmt.value, ast.Constant)
                and stmt.value.value == value
            ):
                return node.name
    return None
