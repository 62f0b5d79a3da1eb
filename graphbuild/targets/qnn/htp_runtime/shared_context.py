"""One weight-shared QNN context binary for several graphs with the same weights (an LLM part's
prompt graph, AR-N, and token graph, AR-1): the weights are in the binary once.

onnxruntime's EPContext weight sharing does it: each graph is compiled in its own session with
``ep.context_enable = 1``, ``ep.context_embed_mode = 0`` and ``ep.share_ep_contexts = 1``, the
last one also with ``ep.stop_share_ep_contexts = 1``. QNN's execution provider then compiles
every graph into the one QNN context of the first session (created with QNN HTP's
weight-sharing option: onnxruntime-qnn turns it on itself, on x86-64, for a session that shares
EP contexts; there is no provider option for it), names the binary after the first session's
``ep.context_file_path`` (``<stem>_qnn.bin``), writes it when the last session compiles, and
gives every session's EPContext model one node that names that binary (``ep_cache_context``,
``main_context = 1``, ``partition_name`` the QNN graph's name, ``source``
``QNNExecutionProvider``). Each session writes its EPContext model to its own
``ep.context_file_path``.

:func:`prepare_shared_context` runs this in a fresh Python process, each graph loaded by a
relative path (the QNN graph name hashes the path a model is loaded from; the binary numbers
tensors with counters that run on across a process), so the same graphs and target give the
same bytes. The process is also where the execution provider's share state lives: a graph QNN
refuses midway leaves it holding the half-built context, which a later preparation in the same
process would otherwise add its graphs to. The binary is renamed ``<name>.bin`` and each
EPContext model, ``<graph name>.onnx``, points at it.

The QNN graph names are not the given names, and onnxruntime-qnn 2.7 cannot make them so: QNN's
execution provider names each graph (and its EPContext node, and that node's ``partition_name``)
after the node onnxruntime fuses for it, which onnxruntime names itself, for any plugin
execution provider, ``<EP>_<EP>_<hash of the model's load path>_<id>_<k>``: here
``QNNExecutionProvider_QNNExecutionProvider_<hash>_<n>_0``. The plugin API gives the provider
no say in it, and ``ep.context_node_name_prefix`` is read but not applied. The EPContext model's
graph carries the given name, and :class:`SharedGraph` maps one to the other.

QNN HTP shares weights between graphs from v73 on; an earlier architecture is refused before
anything compiles. That guard and the measure of the shared weights are :mod:`.shared_weights`'s
job, the build key's facts :mod:`.shared_key`'s, running the graphs :mod:`.shared_check`'s.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from graphbuild.errors import ConfigError, ExportError
from graphbuild.targets.qnn.htp_runtime.backend import HtpTarget, require_backend
from graphbuild.targets.qnn.htp_runtime.context import context_binaries
from graphbuild.targets.qnn.htp_runtime.errors import HtpRefusedError
from graphbuild.targets.qnn.htp_runtime.partition import PartitionReport
from graphbuild.targets.qnn.htp_runtime.session import ModelSource
from graphbuild.targets.qnn.htp_runtime.shared_weights import (
    WeightSharing,
    _check_sharing,
    _weight_sharing,
    require_weight_sharing,
)
from graphbuild.targets.workers import describe_exit, run_worker

__all__ = [
    "RECIPE",
    "SharedContext",
    "SharedGraph",
    "prepare_shared_context",
    "shared_session_config",
]

#: What a preparation does besides its inputs (the session options, the layout, the isolated
#: process): a build key holds it, so a change here is a new key.
RECIPE = "qnn-shared-context/1: share_ep_contexts, embed_mode=0, fresh process, relative paths"

_WORKER = "graphbuild.targets.qnn.htp_runtime.shared_worker"
_MODELS_DIR = "models"
_CONTEXT_DIR = "context"
_RESULT = "result.json"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_EP_CONTEXT = "EPContext"


@dataclass(frozen=True)
class SharedGraph:
    """One graph of a shared context: its given name, its EPContext model, the QNN graph the
    model's node runs in the binary, and what QNN took of the graph when it compiled."""

    name: str
    model: Path
    qnn_graph: str
    partition: PartitionReport

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model.name,
            "qnn_graph": self.qnn_graph,
            "partition": self.partition.to_json(),
        }


@dataclass(frozen=True)
class SharedContext:
    """Several graphs prepared into one weight-shared QNN context binary for ``target``: an
    EPContext model per graph (``<graph name>.onnx``) and the one binary (``<name>.bin``)
    beside them."""

    name: str
    target: HtpTarget
    binary: Path
    graphs: tuple[SharedGraph, ...]
    weights: WeightSharing

    @property
    def models(self) -> dict[str, Path]:
        """The EPContext model of each graph, by the graph's name."""
        return {g.name: g.model for g in self.graphs}

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "htp_arch": self.target.htp_arch,
            "soc_model": self.target.soc_model,
            "binary": self.binary.name,
            "graphs": [g.to_json() for g in self.graphs],
            "weights": self.weights.to_json(),
        }


def shared_session_config(context_file: str, *, last: bool) -> dict[str, str]:
    """The session config entries of one graph's session in a weight-sharing preparation:
    its EPContext model goes to ``context_file``; ``last`` ends the sharing and writes the
    binary."""
    config = {
        "ep.context_enable": "1",
        "ep.context_embed_mode": "0",
        "ep.context_file_path": context_file,
        "ep.share_ep_contexts": "1",
    }
    if last:
        config["ep.stop_share_ep_contexts"] = "1"
    return config


def prepare_shared_context(
    models: Sequence[tuple[str, ModelSource]], target: HtpTarget, out_dir: Path, name: str
) -> SharedContext:
    """Compile ``models`` (``(graph name, QDQ model)`` pairs, the graphs of one part: the same
    weights) for ``target`` into one weight-shared QNN context, CPU fallback disabled, in a
    fresh process; write ``<graph name>.onnx`` (an EPContext model) per graph and
    ``<name>.bin`` into the existing directory ``out_dir``.

    A graph QNN does not take whole raises :class:`HtpRefusedError` (its message names the
    graph); an architecture before v73 raises :class:`ConfigError` and onnxruntime-qnn
    missing :class:`HtpUnavailableError`, both before anything compiles."""
    names = _check_names(models, name)
    require_weight_sharing(target)
    require_backend()
    if not out_dir.is_dir():
        raise ExportError(
            f"the output directory {out_dir} of the shared context {name} does not exist; "
            "create it first"
        )
    destinations = [out_dir / f"{g}.onnx" for g in names] + [out_dir / f"{name}.bin"]
    _refuse_overwriting_sources(models, destinations)
    with tempfile.TemporaryDirectory(prefix="graphbuild-shared-context-") as tmp:
        work = Path(tmp)
        sources = [_place(model, work / _MODELS_DIR / g, g) for g, model in models]
        (work / _CONTEXT_DIR).mkdir()
        request = {
            "htp_arch": target.htp_arch,
            "soc_model": target.soc_model,
            "graphs": [
                {"name": g, "model": s.relative_to(work).as_posix()}
                for g, s in zip(names, sources, strict=True)
            ],
            "context_dir": _CONTEXT_DIR,
        }
        result = _run_worker(work, request, f"preparing the shared context {name} for {target}")
        if "refused" in result:
            r = result["refused"]
            partition = r.get("partition")
            raise HtpRefusedError(
                f"graph {r['graph']}: {r['onnxruntime_message']}",
                r["target"],
                r["qnn_messages"],
                PartitionReport.from_json(partition) if partition else None,
            )
        if "error" in result:
            raise ExportError(
                f"preparing the shared context {name} for {target}: {result['error']}"
            )
        binary, qnn_graphs = _read_contexts(work / _CONTEXT_DIR, names)
        weights = _weight_sharing(sources, binary.stat().st_size)
        _check_sharing(weights, name)
        final = out_dir / f"{name}.bin"
        shutil.move(binary, final)
        graphs = []
        for g, qnn_graph, partition in zip(names, qnn_graphs, result["partitions"], strict=True):
            model = out_dir / f"{g}.onnx"
            _repoint(work / _CONTEXT_DIR / f"{g}.onnx", model, final.name, g)
            graphs.append(SharedGraph(g, model, qnn_graph, PartitionReport.from_json(partition)))
    return SharedContext(name, target, final, tuple(graphs), weights)


# --------------------------------------------------------------------------- helpers


def _check_names(models: Sequence[tuple[str, ModelSource]], name: str) -> list[str]:
    names = [g for g, _ in models]
    if len(names) < 2:
        raise ConfigError(
            f"a shared context holds two or more graphs, got {len(names)}; "
            "prepare one graph with prepare_context"
        )
    bad = [n for n in [*names, name] if not isinstance(n, str) or not _NAME.fullmatch(n)]
    if bad:
        raise ConfigError(
            f"graph and context names must be plain file names (letters, digits, '_', '.', "
            f"'-'; not starting with '.' or '-'), not {bad}"
        )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"graph name(s) given more than once: {repeated}")
    return names


def _refuse_overwriting_sources(
    models: Sequence[tuple[str, ModelSource]], destinations: Sequence[Path]
) -> None:
    for _, model in models:
        if isinstance(model, bytes):
            continue
        source = Path(model).resolve()
        if any(d.resolve() == source for d in destinations):
            raise ConfigError(
                f"the shared context would overwrite its own input {source}; write it into "
                "another directory"
            )


def _external_files(model: Path) -> list[str]:
    """The external data files ``model`` names (plain names beside it, checked)."""
    graph = onnx.load(os.fspath(model), load_external_data=False).graph
    tensors = list(graph.initializer)
    tensors += [
        a.t for n in graph.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR
    ]
    files: list[str] = []
    for t in tensors:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in t.external_data if e.key == "location"), "")
        if not location or Path(location).name != location or location in (".", ".."):
            raise ExportError(f"{model.name}: tensor {t.name} has external data at {location!r}")
        files.append(location)
    return sorted(set(files))


def _place(model: ModelSource, directory: Path, graph: str) -> Path:
    """``model`` as ``<directory>/<graph>.onnx`` with its external data files beside it
    (hard links where the file system allows, else copies)."""
    directory.mkdir(parents=True)
    target = directory / f"{graph}.onnx"
    if isinstance(model, bytes):
        target.write_bytes(model)
        return target
    source = Path(model)
    shutil.copyfile(source, target)
    for name in _external_files(source):
        try:
            os.link(source.parent / name, directory / name)
        except OSError:
            shutil.copyfile(source.parent / name, directory / name)
    return target


def spawn_worker(work: Path, request: Mapping[str, Any]) -> tuple[subprocess.CompletedProcess, Any]:
    """The worker (:mod:`.shared_worker`) run in ``work`` on ``request``: (the process, its
    result or None)."""
    proc = run_worker(_WORKER, [json.dumps(request)], work)
    result_file = work / _RESULT
    return proc, json.loads(result_file.read_text()) if result_file.is_file() else None


def _run_worker(work: Path, request: Mapping[str, Any], what: str) -> dict[str, Any]:
    proc, result = spawn_worker(work, request)
    if result is None:
        raise ExportError(
            f"{what} in a new process failed ({describe_exit(proc.returncode)}): "
            f"{proc.stderr.strip()[-2000:] or 'it wrote nothing to stderr'}"
        )
    return result


def _ep_context_attributes(model: Path) -> dict[str, Any]:
    """The attributes of the one EPContext node of ``model``."""
    graph = onnx.load(os.fspath(model), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == _EP_CONTEXT]
    if len(nodes) != 1:
        raise ExportError(
            f"{model.name} has {len(nodes)} EPContext nodes, not one: QNN split the graph"
        )
    return {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _read_contexts(context_dir: Path, names: Sequence[str]) -> tuple[Path, list[str]]:
    """The one binary every graph's EPContext model names, and each graph's QNN graph name,
    checked: one main-context node per model, distinct QNN graphs, each inside the binary."""
    binaries, qnn_graphs = set(), []
    for g in names:
        model = context_dir / f"{g}.onnx"
        if not model.is_file():
            raise ExportError(f"QNN's execution provider wrote no context model for graph {g}")
        binaries.update(context_binaries(model))
        attrs = _ep_context_attributes(model)
        if attrs.get("main_context", 1) != 1 or attrs.get("embed_mode", 1) != 0:
            raise ExportError(f"{model.name}: not a main-context node naming a binary: {attrs}")
        qnn_graphs.append(_text(attrs.get("partition_name", "")))
    if len(binaries) != 1:
        raise ExportError(
            f"the graphs' context models name {sorted(binaries)}, not one shared binary "
            "(did onnxruntime-qnn ignore ep.share_ep_contexts?)"
        )
    binary = context_dir / binaries.pop()
    if not binary.is_file():
        raise ExportError(f"QNN's execution provider wrote no context binary {binary.name}")
    if len(set(qnn_graphs)) != len(qnn_graphs) or not all(qnn_graphs):
        raise ExportError(f"the graphs' QNN graph names are not distinct: {qnn_graphs}")
    with binary.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        absent = [q for q in qnn_graphs if data.find(q.encode()) < 0]
    if absent:
        raise ExportError(f"the shared binary {binary.name} holds no QNN graph {absent}")
    return binary, qnn_graphs


def _repoint(source: Path, target: Path, binary: str, graph: str) -> None:
    """The EPContext model ``source`` written to ``target``, its node naming ``binary`` and
    its graph named ``graph``."""
    model = onnx.load(os.fspath(source), load_external_data=False)
    model.graph.name = graph
    for node in model.graph.node:
        if node.op_type != _EP_CONTEXT:
            continue
        for attr in node.attribute:
            if attr.name == "ep_cache_context":
                attr.s = binary.encode("utf-8")
    onnx.save(model, os.fspath(target))
