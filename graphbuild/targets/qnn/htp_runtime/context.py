"""A deployable QNN context: the graph prepared for one HTP target, as onnxruntime's EPContext
model (``<name>_ctx.onnx``, one ``EPContext`` node) and the QNN context binary beside it
(``ep.context_enable = 1``, ``ep.context_embed_mode = 0``: the binary is a file the node names).

Preparation is an HTP session with CPU fallback disabled that writes the context while it
compiles, so a model QNN refuses gets no context (:class:`HtpRefusedError`), and the session's
partition report comes with the files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import onnx

from graphbuild.errors import ExportError
from graphbuild.targets.qnn.htp_runtime.backend import HtpTarget
from graphbuild.targets.qnn.htp_runtime.partition import PartitionReport
from graphbuild.targets.qnn.htp_runtime.session import ModelSource, open_session

__all__ = ["PreparedContext", "context_binaries", "prepare_context"]

_EP_CONTEXT = "EPContext"


@dataclass(frozen=True)
class PreparedContext:
    """The EPContext model, the context binaries it names (beside it) and what QNN took."""

    model: Path
    binaries: tuple[Path, ...]
    partition: PartitionReport


def prepare_context(model: ModelSource, target: HtpTarget, out: Path) -> PreparedContext:
    """Compile ``model`` for ``target`` with CPU fallback disabled and write its EPContext
    model to ``out`` (a ``.onnx`` path in an existing directory) and the context binary
    beside it."""
    if out.suffix != ".onnx" or not out.parent.is_dir():
        raise ExportError(f"a context model is written as <name>.onnx into a directory: {out}")
    session = open_session(
        model,
        target,
        session_config={
            "ep.context_enable": "1",
            "ep.context_file_path": os.fspath(out),
            "ep.context_embed_mode": "0",
        },
    )
    if not out.is_file():
        raise ExportError(f"QNN's execution provider wrote no context model at {out}")
    binaries = tuple(out.parent / name for name in context_binaries(out))
    missing = [b.name for b in binaries if not b.is_file()]
    if missing:
        raise ExportError(f"the context model {out.name} names missing binaries: {missing}")
    return PreparedContext(out, binaries, session.partition)


def context_binaries(model: Path) -> list[str]:
    """The context binary files an EPContext model names, checked to be plain file names
    beside it (a model read from anywhere decides no path outside its directory)."""
    graph = onnx.load(os.fspath(model), load_external_data=False).graph
    names: list[str] = []
    for node in graph.node:
        if node.op_type != _EP_CONTEXT:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("embed_mode", 1) != 0:
            continue
        name = attrs.get("ep_cache_context", b"")
        name = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
        if not name or Path(name).name != name or name in (".", ".."):
            raise ExportError(f"{model.name}: EPContext node '{node.name}' names {name!r}")
        names.append(name)
    if not any(n.op_type == _EP_CONTEXT for n in graph.node):
        raise ExportError(f"{model.name} has no EPContext node")
    return list(dict.fromkeys(names))
