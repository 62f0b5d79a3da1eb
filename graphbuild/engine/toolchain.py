"""What every key covers beside the stage itself: tool versions, the engine's files, the codecs,
and the programs and shared libraries a stage calls.

A new torch or an edit to the engine's code (not to its comments or docstrings) changes every
key; a codec's code and configuration are
recorded in each entry it wrote, which is a miss once they change.

A stage's code closure covers the Python it runs, not an executable it starts or a shared
library a library loads for it (Arm's model converter, QNN's HTP backend). Those are
:class:`Tool` entries of a registry: a stage declares the ones it calls as reads
(``"tool.<name>"``), each read is the tool's identity (its files' content digest, and a
version where the tool reports one), and the lock file's ``toolchain`` lists them. An
identity never holds a path, so keys do not depend on where a tool is installed; a file's
digest is kept by (path, size, mtime, inode), so an unchanged tool is not read again.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphbuild.engine import source_memo
from graphbuild.engine.closure import class_named_by, code_closure, name_closure
from graphbuild.engine.codecs import codec_modules
from graphbuild.engine.fingerprint import Reading, code_identity
from graphbuild.engine.sources import code_digest
from graphbuild.errors import PipelineError
from graphbuild.hashing import Hasher, digest_json

if TYPE_CHECKING:
    from graphbuild.engine.pipeline import Pipeline


@functools.cache
def _engine_digest() -> str:
    """The engine's own code (keys, fingerprints, codecs, scheduler): it decides what every
    key means. Each stage's code is keyed by the files it reaches (``stage_code_version``),
    so editing one stage's module reruns that stage, not every stage."""
    return engine_digest(Path(__file__).parent)


def engine_digest(root: Path) -> str:
    """The digest of the code of the engine at ``root`` (every module under it, and
    ``hashing.py`` beside it), by each file's path under the package and its
    :func:`~graphbuild.engine.sources.code_digest`: an edited comment or docstring in the
    engine keeps every key, a team's shared cache included; an edited line of code does not."""
    files = [*sorted(root.rglob("*.py")), root.parent / "hashing.py"]
    form = {f.relative_to(root.parent).as_posix(): code_digest(str(f)) for f in files}
    return digest_json(form)[:16]


#: the distributions every key includes (a tool may not take one of their names)
_DISTRIBUTIONS = ("torch", "onnx", "onnxscript", "onnx-ir", "torchao", "graphbuild")


@functools.cache
def _tool_versions() -> dict[str, str]:
    out = {}
    for dist in _DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "absent"
    out["graphbuild"] += f"+{_engine_digest()}"
    return out


def toolchain_versions() -> dict[str, str]:
    """Versions that every key includes: a new torch or graphbuild engine invalidates the
    cache."""
    return dict(_tool_versions())


def codec_files(name: str) -> dict[str, str]:
    """The source files the codec registered under ``name`` runs: its class's definition
    and what its methods use (``engine.closure``), found in the source when the codec is
    registered lazily and not loaded yet. Editing a module a codec does not use (the ONNX
    writer beside the ONNX codec) leaves the entries it wrote valid."""
    for codec_name, module, codec in codec_modules():
        if codec_name != name:
            continue
        cls = type(codec).__qualname__ if codec is not None else None
        cls = cls or class_named_by(module, "name", name)
        if cls is None:  # not found in the source: all of its module
            return code_closure([module], own=True)
        return name_closure([(module, cls.split(".")[0], False)], own=True)
    return {}


def codec_version(name: str) -> str:
    """The code and configuration of the codec registered under ``name`` (loaded or not yet:
    a lazily registered codec counts the same). A cache entry records the versions of the
    codecs that wrote it and is a miss when one has changed since."""
    for codec_name, _, codec in codec_modules():
        if codec_name == name:
            form: dict[str, Any] = {"files": codec_files(name)}
            if codec is not None and vars(codec):
                form["config"] = code_identity(codec)
            return digest_json(form)[:16]
    return "unknown"


def codec_names(description: Mapping[str, Any]) -> set[str]:
    names = {description["codec"]}
    for child in description.get("children", ()):
        names |= codec_names(child)
    return names


# --------------------------------------------------------------------------- tools

#: a read naming a tool: ``"tool.<name>"``
TOOL_READ = "tool."

#: (name, path) of each of a tool's files: the name is what a key sees (a command name, a
#: path relative to the package that ships the file), the path where it is here
ToolFiles = list[tuple[str, Path]]


@dataclass(frozen=True)
class Tool:
    """An executable or shared library a stage calls outside Python's imports.

    ``files`` finds its files (an empty list: not installed here); ``version``, when given,
    says which version the files are, for people (the lock file) and as part of the key.
    Build one with :meth:`executable` or :meth:`package_files`, or give ``files`` directly
    (a test's stub)."""

    name: str
    files: Callable[[], ToolFiles]
    version: Callable[[ToolFiles], str | None] | None = None

    @classmethod
    def executable(
        cls,
        name: str,
        *commands: str,
        env: str | None = None,
        version_args: tuple[str, ...] | None = None,
    ) -> Tool:
        """A program found as the caller finds it: the file ``$env`` names, else the first
        of ``commands`` (default: ``name``) on ``PATH``. ``version_args`` (``("--version",)``)
        runs it for a version: a wrapper script's bytes do not say which program it starts."""
        names = commands or (name,)

        def files() -> ToolFiles:
            given = os.environ.get(env) if env else None
            if given and os.path.isfile(given) and os.access(given, os.X_OK):
                return [(names[0], Path(given))]
            for command in names:
                found = shutil.which(command)
                if found:
                    return [(command, Path(found))]
            return []

        version = None
        if version_args:
            args = tuple(version_args)

            def version(found: ToolFiles) -> str | None:
                return _reported_version(found[0][1], args)

        return cls(name, files, version)

    @classmethod
    def package_files(
        cls, name: str, package: str, *patterns: str, distribution: str | None = None
    ) -> Tool:
        """Files of an installed Python package (a shared library it loads), found without
        importing it: each file under the package's directory that one of ``patterns``
        (globs) matches; for a top-level module that is no package, its own file.
        ``distribution``: the installed distribution whose version names them."""

        def files() -> ToolFiles:
            spec = importlib.util.find_spec(package) if "." not in package else None
            if spec is None:
                return []
            roots = list(spec.submodule_search_locations or [])
            if not roots and spec.origin and os.path.isfile(spec.origin):
                return [(Path(spec.origin).name, Path(spec.origin))]
            found: dict[str, Path] = {}
            for root in map(Path, roots):
                for pattern in patterns:
                    for path in sorted(root.glob(pattern)):
                        if path.is_file():
                            found.setdefault(path.relative_to(root).as_posix(), path)
            return sorted(found.items())

        version = None
        if distribution is not None:
            dist = distribution

            def version(found: ToolFiles) -> str | None:
                try:
                    return f"{dist} {importlib.metadata.version(dist)}"
                except importlib.metadata.PackageNotFoundError:
                    return None

        return cls(name, files, version)


TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool) -> str:
    """Make ``"tool.<name>"`` a read (a later registration under the same name replaces the
    earlier one); returns the read, for the stages that declare it."""
    if tool.name in _DISTRIBUTIONS or not tool.name or "/" in tool.name:
        raise PipelineError(f"'{tool.name}' cannot name a tool (every key lists it already)")
    TOOLS[tool.name] = tool
    return TOOL_READ + tool.name


def tool_identity(name: str) -> str:
    """What a key and the lock file see of tool ``name``: ``absent``, or its version (when
    it says one) and the xxh3 of its files' names and contents. KeyError for no such tool."""
    tool = TOOLS[name]
    found = tool.files()
    if not found:
        return "absent"
    digest = digest_json([[label, file_digest(path)] for label, path in found])[:16]
    version = tool.version(found) if tool.version is not None else None
    return f"{version} xxh3:{digest}" if version else f"xxh3:{digest}"


def read_tool(name: str) -> Reading:
    """The reading of ``"tool.<name>"``: without a digest (always rerun, with the reason)
    for a tool nobody registered, or one whose files cannot be read."""
    if name not in TOOLS:
        known = ", ".join(sorted(TOOLS)) or "none"
        return Reading(None, reason=f"{TOOL_READ}{name}: no such tool (known: {known})")
    try:
        identity = tool_identity(name)
    except OSError as err:
        return Reading(None, reason=f"{TOOL_READ}{name}: {err}")
    return Reading(digest_json(["tool", identity]), identity)


def pipeline_tools(pipeline: Pipeline) -> dict[str, str]:
    """Every tool a stage of ``pipeline`` declares, with its identity: the lock file's
    ``toolchain`` lists them beside the distributions."""
    names = sorted(
        {
            read[len(TOOL_READ) :]
            for stage in pipeline.stages
            for read in stage.reads or ()
            if read.startswith(TOOL_READ)
        }
    )
    return {n: read_tool(n).value or "unknown" for n in names}


# A file's digest, by what says it is unchanged: (real path, size, mtime, inode). Kept in the
# process and in the cache's memo records; not for a file modified so recently that its mtime
# does not vouch for its bytes (git's "racily clean", as in ``source_memo``).
_RACY_NS = 2_000_000_000
_digests: dict[tuple[str, int, int, int], str] = {}
_digests_lock = threading.Lock()


def file_digest(path: Path) -> str:
    """The xxh3-128 of the file at ``path`` (read once per unchanged file)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = (real, st.st_size, st.st_mtime_ns, st.st_ino)
    racy = time.time_ns() - st.st_mtime_ns < _RACY_NS
    with _digests_lock:
        known = None if racy else _digests.get(stamp)
    if known is not None:
        return known
    key = source_memo.record_key("tool file", *stamp)
    known = None if racy else source_memo.get(key, "tool file")
    if not isinstance(known, str):
        known = _hash_file(real)
        if not racy:
            source_memo.put(key, "tool file", known)
    if not racy:
        with _digests_lock:
            _digests[stamp] = known
    return known


def _json_version(text: str) -> str | None:
    """The ``version`` string of a JSON object ``text``, or None when it is not one."""
    try:
        found = json.loads(text)
    except ValueError:
        return None
    version = found.get("version") if isinstance(found, dict) else None
    return str(version) if isinstance(version, str | int | float) and str(version) else None


def _hash_file(path: str) -> str:
    hasher = Hasher()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()


_versions: dict[tuple[Any, ...], str | None] = {}


def _reported_version(path: Path, args: Iterable[str]) -> str | None:
    """The first line ``path`` prints for ``args`` (once per unchanged file), or the
    ``version`` of the JSON object it prints (Arm's model converter), less anything that looks
    like a path; None when it fails or prints nothing."""
    args = tuple(args)
    st = os.stat(path)
    stamp = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino, args)
    racy = time.time_ns() - st.st_mtime_ns < _RACY_NS
    if not racy and stamp in _versions:
        return _versions[stamp]
    try:
        done = subprocess.run(
            [str(path), *args], capture_output=True, text=True, timeout=20, check=False
        )
        text = done.stdout + done.stderr if done.returncode == 0 else ""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        lines = []
    first = _json_version(text) if lines and lines[0].startswith("{") else None
    if first is not None:
        lines = [first]
    words = [w for w in (lines[0].split() if lines else []) if "/" not in w and "\\" not in w]
    version = " ".join(words)[:80] or None
    if not racy:
        _versions[stamp] = version
    return version
