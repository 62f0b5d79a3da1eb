"""What QNN took of a model: onnxruntime's node assignment, QNN EP's reasons for the nodes it
left (its verbose validation log) and the ops QNN received in float (its JSON graph dump)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "QNN_EP",
    "CpuNode",
    "FloatOp",
    "PartitionReport",
    "error_lines",
    "read_partition",
    "strip_ansi",
]

#: The execution provider onnxruntime assigns the nodes QNN takes to.
QNN_EP = "QNNExecutionProvider"

_QNN_FLOAT_TYPES = {0x0216: "float16", 0x0232: "float32", 0x0264: "float64"}
#: QNN ops whose float side is their job: they convert to or from the quantized grid
_CONVERSIONS = frozenset({"Quantize", "Dequantize", "Cast", "Convert"})
#: QNN's ``QNN_QUANTIZATION_ENCODING_BLOCKWISE_EXPANSION``: a tensor in LPBQ blocks
_LPBQ_ENCODING = 5


@dataclass(frozen=True)
class CpuNode:
    """An ONNX node onnxruntime left on its CPU, and QNN's reason where its log gave one."""

    name: str
    op_type: str
    reason: str = ""


@dataclass(frozen=True)
class FloatOp:
    """An op of the graph QNN built that has a floating-point input or output (QNN's own
    names and op type, with the float tensors and their QNN data types)."""

    name: str
    op_type: str
    float_tensors: tuple[str, ...]
    dtypes: tuple[str, ...] = ()


@dataclass(frozen=True)
class PartitionReport:
    """What QNN took of a model: ``qnn_nodes`` of ``total_nodes`` ONNX nodes (as onnxruntime
    partitioned them), the nodes left on the CPU, the QNN graphs' op count and its float ops."""

    total_nodes: int
    qnn_nodes: int
    cpu_nodes: tuple[CpuNode, ...] = ()
    qnn_ops: int = 0
    float_ops: tuple[FloatOp, ...] = ()
    qnn_graphs: int = 0
    #: tensors QNN holds in LPBQ blocks (blockwise expansion: integer block scales under a
    #: float scale per channel), by QNN's names
    lpbq_tensors: tuple[str, ...] = ()

    @property
    def fully_on_qnn(self) -> bool:
        return not self.cpu_nodes and self.qnn_nodes == self.total_nodes

    def summary(self) -> str:
        line = f"{self.qnn_nodes}/{self.total_nodes} ONNX nodes on QNN"
        if self.cpu_nodes:
            line += f", {len(self.cpu_nodes)} on the CPU"
        line += f", {len(self.float_ops)} QNN ops float"
        if self.lpbq_tensors:
            line += f", {len(self.lpbq_tensors)} LPBQ weights"
        return line

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> PartitionReport:
        """The inverse of :meth:`to_json` (a report read back from the cache)."""
        return cls(
            total_nodes=int(doc["total_nodes"]),
            qnn_nodes=int(doc["qnn_nodes"]),
            cpu_nodes=tuple(CpuNode(**n) for n in doc.get("cpu_nodes", ())),
            qnn_ops=int(doc.get("qnn_ops", 0)),
            float_ops=tuple(
                FloatOp(o["name"], o["op_type"], tuple(o["float_tensors"]), tuple(o["dtypes"]))
                for o in doc.get("float_ops", ())
            ),
            qnn_graphs=int(doc.get("qnn_graphs", 0)),
            lpbq_tensors=tuple(doc.get("lpbq_tensors", ())),
        )

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["cpu_nodes"] = [asdict(n) for n in self.cpu_nodes]
        doc["float_ops"] = [
            {**asdict(o), "float_tensors": list(o.float_tensors), "dtypes": list(o.dtypes)}
            for o in self.float_ops
        ]
        doc["lpbq_tensors"] = list(self.lpbq_tensors)
        return doc


def _assignment(session: Any) -> tuple[int, int, list[tuple[str, str]]]:
    """(all nodes, QNN's, CPU ones as (name, op type)) from onnxruntime's assignment record."""
    total = qnn = 0
    cpu: list[tuple[str, str]] = []
    for subgraph in session.get_provider_graph_assignment_info():
        nodes = subgraph.get_nodes()
        total += len(nodes)
        if subgraph.ep_name == QNN_EP:
            qnn += len(nodes)
        else:
            cpu.extend((n.name, n.op_type) for n in nodes)
    return total, qnn, cpu


def _float_ops(json_dir: Path) -> tuple[int, int, list[FloatOp], list[str]]:
    """(QNN graphs, their ops, the float ones, the LPBQ tensors) from the graphs QNN EP
    dumped as JSON."""
    graphs = ops = 0
    found: list[FloatOp] = []
    lpbq: list[str] = []
    for path in sorted(json_dir.glob("*.json")):
        if path.name.endswith("_tensor_log.json"):
            continue
        graph = json.loads(path.read_text()).get("graph", {})
        tensors = graph.get("tensors", {})
        graphs += 1
        lpbq += [
            name
            for name, tensor in tensors.items()
            if (tensor.get("quant_params") or {}).get("encoding") == _LPBQ_ENCODING
        ]
        for name, node in graph.get("nodes", {}).items():
            ops += 1
            op_type = str(node.get("type", ""))
            if op_type in _CONVERSIONS:
                continue
            floats = [
                (t, _QNN_FLOAT_TYPES[tensors[t]["data_type"]])
                for t in (*node.get("input_names", ()), *node.get("output_names", ()))
                if t in tensors and tensors[t].get("data_type") in _QNN_FLOAT_TYPES
            ]
            if floats:
                names = tuple(dict.fromkeys(t for t, _ in floats))
                dtypes = tuple(dict.fromkeys(d for _, d in floats))
                found.append(FloatOp(name, op_type, names, dtypes))
    return graphs, ops, found, sorted(lpbq)


_VALIDATION = re.compile(
    r"Validation FAILED for \d+ nodes in \w+ \((?P<unit>[^)]*)\) :\s*\n"
    r"(?P<nodes>(?:\s*Operator type: .*\n)+)\s*REASON : (?P<reason>[^\n]*)"
)
_NODE_LINE = re.compile(r"Operator type: (?P<op>\S+) Node name: (?P<name>.*?) Node index:")
_QNN_ERROR = re.compile(r"\[E:onnxruntime:[^\]]*\] (?P<message>[^\n]*)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _reasons(log: str) -> dict[str, str]:
    """QNN EP's reason for each node it would not take (its verbose validation log)."""
    reasons: dict[str, str] = {}
    for match in _VALIDATION.finditer(log):
        for node in _NODE_LINE.finditer(match.group("nodes")):
            reasons.setdefault(node.group("name"), match.group("reason").strip())
    return reasons


def error_lines(log: str) -> list[str]:
    """onnxruntime's and QNN's error lines, once each, in order."""
    found = (_ANSI.sub("", m.group("message")).strip() for m in _QNN_ERROR.finditer(log))
    return list(dict.fromkeys(found))


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes (onnxruntime colours its warnings and errors)."""
    return _ANSI.sub("", text)


def read_partition(session: Any, log: str, json_dir: Path) -> PartitionReport:
    """The partition of a built session: onnxruntime's assignment record (the session was
    made with ``session.record_ep_graph_assignment_info``), QNN EP's reasons from its
    verbose ``log`` (where it was verbose), and the float ops of the QNN graphs it dumped as
    JSON into ``json_dir``."""
    total, qnn, cpu = _assignment(session)
    why = _reasons(log)
    graphs, ops, floats, lpbq = _float_ops(json_dir)
    return PartitionReport(
        total_nodes=total,
        qnn_nodes=qnn,
        cpu_nodes=tuple(CpuNode(name, op_type, why.get(name, "")) for name, op_type in cpu),
        qnn_ops=ops,
        float_ops=tuple(floats),
        qnn_graphs=graphs,
        lpbq_tensors=tuple(lpbq),
    )
