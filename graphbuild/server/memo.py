"""Built models kept between commands, and the files a build read.

A memo entry is the ``(model, samples, calibration)`` a config's factories returned, under a
key of the factories' specs (model, samples, calibration), the config's directory, the
working directory (a project process serves one ``sys.path``) and a digest of the
environment variables (:func:`environment_digest`); with it, every file the build opened,
from any thread (recorded by an audit hook on ``open``: a checkpoint, a tokenizer, a data
file), a stamp (name, size, mtime, inode) of the other files in each such file's directory,
and the project's own source files imported by then. An entry is valid while each of those
files has the contents it had (:func:`graphbuild.engine.sources.file_digest`: by (mtime,
size), by contents when too recent to vouch for it) and each stamped directory holds the
same files with the same stamps. The stamps cover what a build reads bypassing Python's
``open`` (a memory map made by a Rust or C++ library, as ``safetensors`` does) when it opens
something beside it with ``open`` (a ``config.json``); a directory of more than
:data:`MAX_LISTED` files is not stamped. Installed libraries and the standard library are not
recorded: a server restarts when they change. The model factory's code closure is within the
project's sources, and an edited source restarts the project process
(:mod:`~graphbuild.server.project`), which drops every entry built from the old code.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Entry",
    "MEMO",
    "Memo",
    "build_recorded",
    "environment_digest",
    "memo_key",
    "project_sources",
    "recording",
]

_SKIP = ("/dev/", "/proc/", "/sys/")
#: the import system's bytecode caches: written by the first import, so never the same twice;
#: the sources they come from count instead
_BYTECODE = f"{os.sep}__pycache__{os.sep}"
#: the paths opened while a build runs, by any thread (None when no build records)
_reads: set[str] | None = None
_lock = threading.Lock()
_hooked = False
#: a directory with more files than this is not stamped (listing it would cost each command)
MAX_LISTED = 10_000
#: variables that differ between shells and terminals but not between builds
_VOLATILE = frozenset(
    [
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
        "TERM",
        "COLORTERM",
        "COLUMNS",
        "LINES",
        "NO_COLOR",
        "FORCE_COLOR",
        "CLICOLOR",
        "CLICOLOR_FORCE",
        "TERM_PROGRAM",
        "TERM_PROGRAM_VERSION",
        "TERM_SESSION_ID",
        "WINDOWID",
        "DISPLAY",
        "SSH_CLIENT",
        "SSH_CONNECTION",
        "SSH_TTY",
        "SSH_AUTH_SOCK",
        "TMUX",
        "TMUX_PANE",
        "STY",
        "WINDOW",
        "PYTEST_CURRENT_TEST",
        "PS1",
        "PROMPT_COMMAND",
        "XDG_SESSION_ID",
        "DBUS_SESSION_BUS_ADDRESS",
    ]
)
_VOLATILE_PREFIXES = ("GRAPHBUILD_", "VSCODE_", "ITERM_", "KITTY_", "WEZTERM_", "LC_TERMINAL")


def _hook(event: str, args: tuple) -> None:
    reads = _reads
    if reads is None or event != "open":
        return
    path = args[0] if args else None
    if path is None or isinstance(path, int):
        return
    try:
        text = os.fsdecode(os.fspath(path))
    except TypeError:
        return
    with _lock:
        reads.add(os.path.abspath(text))


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """The paths any thread of this process opens while in the block."""
    global _hooked, _reads
    if not _hooked:
        sys.addaudithook(_hook)
        _hooked = True
    reads: set[str] = set()
    with _lock:
        previous, _reads = _reads, reads
    try:
        yield reads
    finally:
        with _lock:
            _reads = previous
            if previous is not None:
                previous.update(reads)


def environment_digest(env: dict[str, str] | os._Environ | None = None) -> str:
    """A digest of the environment variables a factory may read (all of them but those that
    differ between terminals and shells, and graphbuild's own): a changed ``HF_HOME`` or a
    variable the factory reads rebuilds the model."""
    import hashlib

    env = os.environ if env is None else env
    kept = sorted(
        (k, v)
        for k, v in env.items()
        if k not in _VOLATILE and not k.startswith(_VOLATILE_PREFIXES)
    )
    return hashlib.sha256(repr(kept).encode()).hexdigest()[:16]


def listing(directory: str) -> tuple | None:
    """(name, size, mtime, inode) of the regular files in ``directory``; None when it cannot
    be listed or holds more than :data:`MAX_LISTED` entries."""
    try:
        with os.scandir(directory) as entries:
            stamps = []
            for n, entry in enumerate(entries):
                if n >= MAX_LISTED:
                    return None
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=True):
                        info = entry.stat()
                        stamps.append((entry.name, info.st_size, info.st_mtime_ns, info.st_ino))
    except OSError:
        return None
    return tuple(sorted(stamps))


def listings(reads: dict[str, str]) -> dict[str, tuple]:
    """The stamps of the directories holding the data files in ``reads`` (not the
    directories of Python sources: an import opens those)."""
    dirs = {os.path.dirname(p) for p in reads if not p.endswith((".py", ".pyc", ".so"))}
    out = {}
    for directory in sorted(dirs):
        stamp = listing(directory)
        if stamp is not None:
            out[directory] = stamp
    return out


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


def memo_key(cfg: Any, env: dict[str, str] | None = None) -> str:
    """The key of ``cfg``'s entry, with the client's environment ``env`` (else this
    process's)."""
    return repr(
        (
            str(cfg.root),
            cfg.model,
            cfg.samples,
            cfg.calibration,
            os.getcwd(),
            environment_digest(env),
        )
    )


@dataclass
class Entry:
    """A built ``(model, samples, calibration)`` and the digests of what the build read."""

    value: Any
    reads: dict[str, str]
    sources: dict[str, str] = field(default_factory=dict)
    listed: dict[str, tuple] = field(default_factory=dict)

    def changed(self) -> list[str]:
        """The recorded files whose contents (or presence) differ now, and the stamped
        directories whose files differ."""
        files = [p for p, d in {**self.reads, **self.sources}.items() if digest(p) != d]
        return files + [d for d, stamp in self.listed.items() if listing(d) != stamp]


DEFAULT_MEMO_ENTRIES = 2


def memo_entries(env: dict[str, str] | os._Environ | None = None) -> int:
    """How many models a project process keeps (``GRAPHBUILD_SERVER_MEMO``, 2 by default;
    0 keeps none): a model may hold gigabytes."""
    env = os.environ if env is None else env
    try:
        return max(0, int(env.get("GRAPHBUILD_SERVER_MEMO", DEFAULT_MEMO_ENTRIES)))
    except ValueError:
        return DEFAULT_MEMO_ENTRIES


class Memo:
    """Entries by key, least recently used first: storing one beyond ``limit()`` entries
    drops the least recently used. ``used`` lists the keys :meth:`get` found (a request
    process reports them, so that its project process knows what was used)."""

    def __init__(self, limit: Callable[[], int] = memo_entries) -> None:
        self.limit = limit
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.used: list[str] = []

    def get(self, key: str) -> Entry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.touch(key)
            self.used.append(key)
        return entry

    def touch(self, key: str) -> None:
        """Mark ``key`` most recently used (when it is here)."""
        if key in self.entries:
            self.entries.move_to_end(key)

    def put(self, key: str, entry: Entry) -> None:
        self.entries.pop(key, None)
        self.entries[key] = entry
        while len(self.entries) > self.limit():
            self.entries.popitem(last=False)

    def pop(self, key: str) -> Entry | None:
        return self.entries.pop(key, None)

    def clear(self) -> None:
        self.entries.clear()

    def values(self) -> list[Entry]:
        return list(self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries


#: Entries by :func:`memo_key`, kept by the project process and inherited by its requests.
MEMO = Memo()


def build_recorded(cfg: Any, build: Callable[[], Any]) -> Entry:
    """Run ``build`` recording what it reads; the entry (not stored)."""
    with recording() as reads:
        value = build()
    files = project_sources()
    read = digests(reads)
    return Entry(value, read, digests(list(files.values())), listings(read))
