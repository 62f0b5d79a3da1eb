"""What every key covers beside the stage itself: tool versions, the engine's files, the codecs.

A new torch or an edit to the engine's code (not to its comments or docstrings) changes every
key; a codec's code and configuration are
recorded in each entry it wrote, which is a miss once they change.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphbuild.engine.closure import class_named_by, code_closure, name_closure
from graphbuild.engine.codecs import codec_modules
from graphbuild.engine.fingerprint import code_identity
from graphbuild.engine.sources import code_digest
from graphbuild.hashing import digest_json


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


@functools.cache
def _tool_versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "onnx", "onnxscript", "onnx-ir", "torchao", "graphbuild"):
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
