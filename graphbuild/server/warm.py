"""What a command worked out that the next one can start with: the code closures the engine
computed (:mod:`graphbuild.engine.closure`, memoized per process and revalidated against the
files on every use). A request process forked from its project process starts with the
project process's memo; a closure it computes dies with it. So each request lists the closures
it computed (:func:`computed`: a stage function by module and qualified name, a set of names
as they are) and the project process computes them again (:func:`recompute`), reading the
same files, before it forks the next request. Nothing is trusted from the request: the project
process computes every closure itself.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any

__all__ = ["computed", "recompute"]


def computed() -> list[list[Any]]:
    """``["function", module, qualname]`` and ``["needs", needs, own]`` per memoized closure."""
    closure = sys.modules.get("graphbuild.engine.closure")
    if closure is None:
        return []
    out: list[list[Any]] = []
    for key in list(closure._MEMO.entries):
        if key[0] == "function":
            qualname = getattr(key[2], "co_qualname", "")
            if qualname and "<" not in qualname:
                out.append(["function", key[1], qualname])
        elif key[0] == "needs":
            out.append(["needs", [list(n) for n in key[1]], bool(key[2])])
    return out


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def recompute(entries: list[list[Any]]) -> None:
    """Compute again, in this process, the closures another process listed; an entry that no
    longer resolves is skipped."""
    if not entries:
        return
    from graphbuild.engine import closure
    from graphbuild.engine.fingerprint.code import stage_code_version

    for entry in entries:
        with contextlib.suppress(Exception):
            if entry[0] == "function":
                fn = _resolve(entry[1], entry[2])
                stage_code_version(fn)
                closure.function_files(fn)
            elif entry[0] == "needs":
                closure.name_closure([tuple(n) for n in entry[1]], own=entry[2])
