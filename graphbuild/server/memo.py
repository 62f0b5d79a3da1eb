"""Built models kept between commands, and the files a build read.

A memo entry is the ``(model, samples, calibration)`` a config's factories returned, under a
key of the factories' specs (model, samples, calibration), the config's directory and the
working directory (a project process serves one ``sys.path``); with it, every file the build opened (recorded by an
audit hook on ``open``: a checkpoint, a tokenizer, a data file) and the project's own source files imported by then. An entry is valid while each of
those files has the contents it had (:func:`graphbuild.engine.sources.file_digest`: by
(mtime, size), by contents when too recent to vouch for it). Directory listings are not
recorded (the import system lists every directory on ``sys.path``): a file added to a
folder the factory lists counts once the factory opens it. Installed libraries and the standard library are not recorded: a server restarts when
they change. The model factory's code closure is within the project's sources, and an edited
source restarts the project process (:mod:`~graphbuild.server.project`), which drops every
entry built from the old code.

What a build opens with code that bypasses Python's ``open`` (a memory map made by a Rust
or C++ library, as ``safetensors`` does) is not seen: such a factory's reads are not
covered.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Entry", "MEMO", "build_recorded", "memo_key", "project_sources", "recording"]

_SKIP = ("/dev/", "/proc/", "/sys/")
#: the import system's bytecode caches: written by the first import, so never the same twice;
#: the sources they come from count instead
_BYTECODE = f"{os.sep}__pycache__{os.sep}"
_state = threading.local()
_hooked = False


def _hook(event: str, args: tuple) -> None:
    reads = getattr(_state, "reads", None)
    if reads is None or event != "open":
        return
    path = args[0] if args else None
    if path is None or isinstance(path, int):
        return
    try:
        text = os.fsdecode(os.fspath(path))
    except TypeError:
        return
    reads.add(os.path.abspath(text))


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """The paths this thread opens while in the block."""
    global _hooked
    if not _hooked:
        sys.addaudithook(_hook)
        _hooked = True
    reads: set[str] = set()
    previous = getattr(_state, "reads", None)
    _state.reads = reads
    try:
        yield reads
    finally:
        _state.reads = previous


def _library(path: str) -> bool:
    from graphbuild.engine.sources import is_library

    return is_library(path)


def _own(path: str) -> bool:
    import graphbuild

    return path.startswith(os.path.dirname(os.path.realpath(graphbuild.__file__)) + os.sep)


def digest(path: str) -> str:
    """The digest of a file's bytes, or ``missing``."""
    from graphbuild.engine.sources import file_digest

    try:
        return file_digest(path)
    except OSError:
        return "missing"


def digests(paths: set[str] | list[str]) -> dict[str, str]:
    keep = [
        p
        for p in sorted(paths)
        if not p.startswith(_SKIP) and not _library(p) and _BYTECODE not in p
    ]
    return {p: digest(p) for p in keep}


def project_sources(exclude: frozenset[str] = frozenset()) -> dict[str, str]:
    """Module name -> file of every imported module that is the project's: not the standard
    library, not an installed library, not graphbuild (nor a name in ``exclude``)."""
    out = {}
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if name in exclude or not where or name == "__main__":
            continue
        where = os.path.abspath(where)
        if where.endswith(".py") and not _library(where) and not _own(where):
            out[name] = where
    return out


def memo_key(cfg: Any) -> str:
    return repr(
        (
            str(cfg.root),
            cfg.model,
            cfg.samples,
            cfg.calibration,
            os.getcwd(),
        )
    )


@dataclass
class Entry:
    """A built ``(model, samples, calibration)`` and the digests of what the build read."""

    value: Any
    reads: dict[str, str]
    sources: dict[str, str] = field(default_factory=dict)

    def changed(self) -> list[str]:
        """The recorded files whose contents (or presence) differ now."""
        return [p for p, d in {**self.reads, **self.sources}.items() if digest(p) != d]


#: Entries by :func:`memo_key`, kept by the project process and inherited by its requests.
MEMO: dict[str, Entry] = {}


def build_recorded(cfg: Any, build: Callable[[], Any]) -> Entry:
    """Run ``build`` recording what it reads; the entry (not stored)."""
    with recording() as reads:
        value = build()
    files = project_sources()
    return Entry(value, digests(reads), digests(list(files.values())))
