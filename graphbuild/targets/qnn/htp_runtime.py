"""Qualcomm's HTP backend as the judge: compile a QDQ model for an HTP architecture with no CPU
fallback, see what QNN took and how, and compare its numbers with onnxruntime's CPU.

onnxruntime-qnn (the ``htp`` extra) ships Qualcomm's HTP backend (``libQnnHtp.so``: graph
preparation and an HTP simulator on x86_64 Linux) as an onnxruntime plugin execution provider.
This module is the one place graphbuild talks to it:

- :func:`availability` / :func:`require_backend`: is the backend usable here, and if not, why;
  :func:`backend_versions`: what a stage that runs it keys on;
- :class:`HtpTarget`: an HTP architecture (``htp_arch``) and SoC model (``soc_model``);
- :func:`open_session`: an HTP session for a model, CPU fallback disabled unless asked; QNN's
  refusal is an :class:`~graphbuild.errors.HtpRefusedError` carrying QNN's own messages and,
  where a session with fallback builds, the partition;
- :class:`PartitionReport`: ONNX nodes QNN took / all, the nodes left on the CPU with QNN's
  reason, and every op QNN received with a float tensor (from QNN's own JSON graph);
- :func:`compare_with_cpu`: per output, max |HTP - ORT CPU| in output quantization steps and
  SQNR of each against a float reference;
- :func:`check_model`: all of the above for one model, as one JSON-able report.

ORT's CPU run is at ``ORT_ENABLE_BASIC``: at its default level onnxruntime's QDQ fusions
mis-type some w8a8 models ("output_dtype INT8 does not match y_zero_point type UINT8").
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from graphbuild.errors import ConfigError, ExportError

__all__ = [
    "QNN_EP",
    "SOC_MODELS",
    "Availability",
    "HtpError",
    "HtpRefusedError",
    "HtpUnavailableError",
    "CpuNode",
    "FloatOp",
    "HtpSession",
    "HtpTarget",
    "OutputComparison",
    "PartitionReport",
    "availability",
    "backend_versions",
    "check_model",
    "compare_with_cpu",
    "open_session",
    "output_steps",
    "require_backend",
    "run_cpu",
]

QNN_EP = "QNNExecutionProvider"
INSTALL = (
    "install the htp extra: pip install 'graphbuild[htp]' (onnxruntime-qnn 2.7, which ships "
    "QNN's HTP backend for Linux x86_64 and Windows on ARM64 and needs onnxruntime >= 1.24.2)"
)

#: The SoC model each HTP architecture is prepared for by default (QNN's SoC ids: SM8350,
#: SM8450, SM8550, SM8650, SM8750, SM8850). Without a SoC model some graphs fail to finalize.
SOC_MODELS: Mapping[str, str] = {
    "68": "30",
    "69": "36",
    "73": "43",
    "75": "57",
    "79": "69",
    "81": "87",
}

#: QNN data types that are floating point (Qnn_DataType_t: FLOAT_16, FLOAT_32, FLOAT_64)
_QNN_FLOAT_TYPES = {0x0216: "float16", 0x0232: "float32", 0x0264: "float64"}
#: QNN ops whose float side is their job: they convert to or from the quantized grid
_CONVERSIONS = frozenset({"Quantize", "Dequantize", "Cast", "Convert"})

_CPU_FALLBACK_REFUSED = "assigned to the default CPU EP"


# --------------------------------------------------------------------------- errors


class HtpError(ExportError):
    """Qualcomm's HTP backend (onnxruntime-qnn) could not be used or did not accept a model."""


class HtpUnavailableError(HtpError):
    """The HTP backend cannot run here: onnxruntime-qnn missing, or not for this platform."""


class HtpRefusedError(HtpError):
    """QNN's HTP backend would not compile a model as asked (CPU fallback disabled).

    ``onnxruntime_message`` is onnxruntime's error, ``qnn_messages`` the error lines QNN and its
    execution provider logged, ``partition`` (where a session with CPU fallback builds) what
    QNN would take, with its reason for each node left on the CPU."""

    def __init__(
        self,
        onnxruntime_message: str,
        target: str,
        qnn_messages: Sequence[str] = (),
        partition: PartitionReport | None = None,
    ):
        self.onnxruntime_message = onnxruntime_message
        self.target = target
        self.qnn_messages = list(qnn_messages)
        self.partition = partition
        lines = [f"QNN's HTP backend ({target}) refused the model: {onnxruntime_message}"]
        cpu = partition.cpu_nodes if partition is not None else ()
        if cpu:
            lines.append(f"{len(cpu)} node(s) QNN would not take:")
            lines += [f"  {n.name} ({n.op_type}): {n.reason or 'no reason logged'}" for n in cpu]
        shown = [m for m in self.qnn_messages if m not in onnxruntime_message]
        if shown:
            lines.append("QNN said:")
            lines += [f"  {m}" for m in shown[:20]]
        super().__init__("\n".join(lines))


# --------------------------------------------------------------------------- the backend


@dataclass(frozen=True)
class Availability:
    """Whether QNN's HTP backend can run here; ``reason`` says why not (and what to do)."""

    available: bool
    reason: str = ""


_register_lock = threading.Lock()


@cache
def availability() -> Availability:
    """Import onnxruntime-qnn and register its execution provider (once per process)."""
    try:
        import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - onnxruntime is a dependency
        return Availability(False, f"onnxruntime does not import ({exc}); {INSTALL}")
    try:
        import onnxruntime_qnn
    except ImportError as exc:
        where = f"{sys.platform}/{platform.machine()}"
        return Availability(
            False, f"onnxruntime-qnn is not installed ({exc}) on {where}; {INSTALL}"
        )
    if not hasattr(ort, "register_execution_provider_library"):
        return Availability(
            False,
            f"onnxruntime {ort.__version__} has no plugin execution providers; {INSTALL}",
        )
    htp = Path(onnxruntime_qnn.get_qnn_htp_path())
    if not htp.is_file():
        return Availability(
            False,
            f"onnxruntime-qnn {onnxruntime_qnn.__version__} has no HTP backend for "
            f"{sys.platform}/{platform.machine()} ({htp.name} missing); {INSTALL}",
        )
    with _register_lock:
        try:
            if not _qnn_devices(ort):
                ort.register_execution_provider_library(QNN_EP, onnxruntime_qnn.get_library_path())
        except Exception as exc:  # onnxruntime raises its own Fail/RuntimeError types
            return Availability(False, f"onnxruntime could not load QNN's provider: {exc}")
        if not _qnn_devices(ort):
            return Availability(False, f"onnxruntime-qnn registered no {QNN_EP} device here")
    return Availability(True)


def _qnn_devices(ort: Any) -> list[Any]:
    return [d for d in ort.get_ep_devices() if d.ep_name == QNN_EP]


def require_backend() -> None:
    """Raise :class:`HtpUnavailableError` (with the reason) where the backend is unusable."""
    found = availability()
    if not found.available:
        raise HtpUnavailableError(f"QNN's HTP backend is not available: {found.reason}")


@cache
def backend_versions() -> dict[str, str]:
    """What prepares and runs an HTP graph here: onnxruntime, onnxruntime-qnn and the QNN SDK
    its backend was built from. A stage that runs the backend keys on these."""
    require_backend()
    import onnxruntime as ort
    import onnxruntime_qnn

    info = getattr(onnxruntime_qnn, "build_and_package_info", None)
    return {
        "onnxruntime": ort.__version__,
        "onnxruntime_qnn": onnxruntime_qnn.__version__,
        "qnn_sdk": str(getattr(info, "qnn_version", "unknown")),
    }


# --------------------------------------------------------------------------- the target


@dataclass(frozen=True)
class HtpTarget:
    """An HTP architecture (``"81"`` for v81) and the SoC model QNN prepares graphs for."""

    htp_arch: str
    soc_model: str

    @classmethod
    def of(cls, htp_arch: str | int, soc_model: str | int | None = None) -> HtpTarget:
        """From ``81``, ``"81"`` or ``"v81"``; the SoC model defaults to the arch's
        (:data:`SOC_MODELS`)."""
        arch = str(htp_arch).strip().lower().removeprefix("v")
        if arch not in SOC_MODELS:
            raise ConfigError(
                f"unknown HTP architecture {htp_arch!r}; supported: "
                + ", ".join(f"v{a}" for a in SOC_MODELS)
            )
        soc = SOC_MODELS[arch] if soc_model is None else str(soc_model).strip()
        if not soc.isdigit():
            raise ConfigError(f"soc_model must be QNN's numeric SoC id, not {soc_model!r}")
        return cls(arch, soc)

    @property
    def label(self) -> str:
        """``v81-soc87``: a name for reports and file names."""
        return f"v{self.htp_arch}-soc{self.soc_model}"

    def provider_options(self) -> dict[str, str]:
        import onnxruntime_qnn

        return {
            "backend_path": onnxruntime_qnn.get_qnn_htp_path(),
            "htp_arch": self.htp_arch,
            "soc_model": self.soc_model,
        }


# --------------------------------------------------------------------------- partition


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

    @property
    def fully_on_qnn(self) -> bool:
        return not self.cpu_nodes and self.qnn_nodes == self.total_nodes

    def summary(self) -> str:
        line = f"{self.qnn_nodes}/{self.total_nodes} ONNX nodes on QNN"
        if self.cpu_nodes:
            line += f", {len(self.cpu_nodes)} on the CPU"
        return line + f", {len(self.float_ops)} QNN ops float"

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["cpu_nodes"] = [asdict(n) for n in self.cpu_nodes]
        doc["float_ops"] = [
            {**asdict(o), "float_tensors": list(o.float_tensors), "dtypes": list(o.dtypes)}
            for o in self.float_ops
        ]
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


def _float_ops(json_dir: Path) -> tuple[int, int, list[FloatOp]]:
    """(QNN graphs, their ops, the float ones) from the graphs QNN EP dumped as JSON."""
    graphs = ops = 0
    found: list[FloatOp] = []
    for path in sorted(json_dir.glob("*.json")):
        if path.name.endswith("_tensor_log.json"):
            continue
        graph = json.loads(path.read_text()).get("graph", {})
        tensors = graph.get("tensors", {})
        graphs += 1
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
    return graphs, ops, found


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


def _errors(log: str) -> list[str]:
    """onnxruntime's and QNN's error lines, once each, in order."""
    found = (_ANSI.sub("", m.group("message")).strip() for m in _QNN_ERROR.finditer(log))
    return list(dict.fromkeys(found))


# --------------------------------------------------------------------------- sessions

_stderr_lock = threading.Lock()


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """Everything written to file descriptor 2 meanwhile (onnxruntime and QNN log there, from
    C++), handed back in the yielded list when the block ends."""
    got: list[str] = []
    with _stderr_lock, tempfile.TemporaryFile(mode="w+b") as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            yield got
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            got.append(_ANSI.sub("", sink.read().decode("utf-8", "replace")))


ModelSource = str | os.PathLike | bytes


@dataclass
class HtpSession:
    """An onnxruntime session on QNN's HTP backend, and what QNN took of the model.
    ``cpu_fallback`` says whether onnxruntime was allowed to put nodes on its CPU."""

    session: Any
    target: HtpTarget
    partition: PartitionReport
    cpu_fallback: bool

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.session.get_inputs()]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.session.get_outputs()]

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs by name."""
        results = self.session.run(None, dict(feeds))
        return dict(zip(self.output_names, results, strict=True))


def _session_options(
    target: HtpTarget,
    *,
    cpu_fallback: bool,
    json_dir: Path | None,
    verbose: bool,
    provider_options: Mapping[str, str] | None,
    session_config: Mapping[str, str] | None,
) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 0 if verbose else 3
    options.add_session_config_entry(
        "session.disable_cpu_ep_fallback", "0" if cpu_fallback else "1"
    )
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    for key, value in (session_config or {}).items():
        options.add_session_config_entry(key, str(value))
    ep_options = target.provider_options()
    # graph inputs' Q and outputs' DQ on QNN, as without fallback, so the partition with
    # fallback shows only what QNN could not take
    ep_options["offload_graph_io_quantization"] = "0"
    if json_dir is not None:
        ep_options.update({"dump_json_qnn_graph": "1", "json_qnn_graph_dir": str(json_dir)})
    ep_options.update({k: str(v) for k, v in (provider_options or {}).items()})
    options.add_provider_for_devices(_qnn_devices(ort), ep_options)
    return options


def _create(
    model: ModelSource,
    target: HtpTarget,
    *,
    cpu_fallback: bool,
    verbose: bool = False,
    provider_options: Mapping[str, str] | None = None,
    session_config: Mapping[str, str] | None = None,
) -> tuple[Any, PartitionReport | None, str, BaseException | None]:
    """(session or None, partition or None, captured log, the error if it failed)."""
    import onnxruntime as ort

    source = model if isinstance(model, bytes) else os.fspath(model)
    with tempfile.TemporaryDirectory(prefix="graphbuild-qnn-json-") as tmp:
        json_dir = Path(tmp)
        options = _session_options(
            target,
            cpu_fallback=cpu_fallback,
            json_dir=json_dir,
            verbose=verbose,
            provider_options=provider_options,
            session_config=session_config,
        )
        session = error = None
        with _captured_stderr() as captured:
            try:
                session = ort.InferenceSession(source, sess_options=options)
            except Exception as exc:  # onnxruntime's Fail / InvalidGraph / RuntimeException
                error = exc
        log = captured[0] if captured else ""
        partition = None
        if session is not None:
            total, qnn, cpu = _assignment(session)
            reasons = _reasons(log)
            graphs, ops, floats = _float_ops(json_dir)
            partition = PartitionReport(
                total_nodes=total,
                qnn_nodes=qnn,
                cpu_nodes=tuple(CpuNode(n, t, reasons.get(n, "")) for n, t in cpu),
                qnn_ops=ops,
                float_ops=tuple(floats),
                qnn_graphs=graphs,
            )
    return session, partition, log, error


def open_session(
    model: ModelSource,
    target: HtpTarget,
    *,
    allow_cpu_fallback: bool = False,
    provider_options: Mapping[str, str] | None = None,
    session_config: Mapping[str, str] | None = None,
) -> HtpSession:
    """An HTP session for ``model`` (a path, or the bytes of a model without external data).

    With CPU fallback disabled (the default) a model QNN does not take whole is refused:
    :class:`HtpRefusedError` then carries onnxruntime's message, QNN's error lines and, where a
    session with fallback builds, the partition with QNN's reason for each CPU node.
    ``provider_options`` add QNN EP options (``ep.context_enable``...) and ``session_config``
    session config entries."""
    require_backend()
    extra = {"provider_options": provider_options, "session_config": session_config}
    session, partition, log, error = _create(
        model, target, cpu_fallback=allow_cpu_fallback, **extra
    )
    if session is not None and partition is not None:
        return HtpSession(session, target, partition, allow_cpu_fallback)
    messages = _errors(log)
    diagnosis = None
    if not allow_cpu_fallback:
        # what QNN would take, and its reason for each node it would not
        _, diagnosis, verbose_log, _ = _create(
            model, target, cpu_fallback=True, verbose=True, **extra
        )
        if diagnosis is None:
            messages = list(dict.fromkeys([*messages, *_errors(verbose_log)]))
    raise HtpRefusedError(str(error), target.label, messages, diagnosis)


# --------------------------------------------------------------------------- numbers


@dataclass(frozen=True)
class OutputComparison:
    """One output: HTP against ORT CPU on the same inputs, and each against a float reference.

    ``max_diff_steps`` is max |HTP - CPU| over the output's quantization step (None where the
    output has no per-tensor encoding); the SQNRs are None without a reference."""

    name: str
    max_abs_diff: float
    output_step: float | None
    max_diff_steps: float | None
    sqnr_htp_db: float | None = None
    sqnr_cpu_db: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: _finite(v) for k, v in asdict(self).items()}


def _finite(value: Any) -> Any:
    """JSON has no inf: an exact match reports SQNR as the string ``"inf"``."""
    if isinstance(value, float) and not np.isfinite(value):
        return "inf" if value > 0 else "-inf"
    return value


def run_cpu(model: ModelSource, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``model`` on onnxruntime's CPU at ``ORT_ENABLE_BASIC`` (see the module's docstring)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    source = model if isinstance(model, bytes) else os.fspath(model)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, dict(feeds)), strict=True))


_PASS_THROUGH = frozenset(
    {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "QuantizeLinear"}
)


def output_steps(model: onnx.ModelProto) -> dict[str, float | None]:
    """The quantization step of each graph output of a QDQ model: the scale of the
    per-tensor DequantizeLinear that produces it (through data-movement ops), else None."""
    producer = {o: n for n in model.graph.node for o in n.output}
    scalars = {
        i.name: onnx.numpy_helper.to_array(i)
        for i in model.graph.initializer
        if len(i.dims) == 0 or (len(i.dims) == 1 and i.dims[0] == 1)
    }
    for node in model.graph.node:  # Constant nodes holding a scale
        if node.op_type == "Constant" and node.attribute:
            with contextlib.suppress(Exception):
                value = onnx.numpy_helper.to_array(
                    onnx.helper.get_attribute_value(node.attribute[0])
                )
                if value.size == 1:
                    scalars[node.output[0]] = value
    steps: dict[str, float | None] = {}
    for out in model.graph.output:
        name, step, seen = out.name, None, set()
        while name in producer and name not in seen:
            seen.add(name)
            node = producer[name]
            if node.op_type == "DequantizeLinear":
                scale = scalars.get(node.input[1]) if len(node.input) > 1 else None
                step = float(np.asarray(scale).reshape(-1)[0]) if scale is not None else None
                break
            if node.op_type not in _PASS_THROUGH or not node.input:
                break
            name = node.input[0]
        steps[out.name] = step
    return steps


def compare_with_cpu(
    htp: HtpSession,
    cpu_model: ModelSource,
    feeds: Mapping[str, np.ndarray],
    *,
    steps: Mapping[str, float | None] | None = None,
    reference: Mapping[str, np.ndarray] | Sequence[np.ndarray] | None = None,
) -> list[OutputComparison]:
    """Run ``feeds`` on the HTP session and on ``cpu_model`` (the same QDQ model, or the one an
    EPContext model was compiled from) on ORT's CPU; compare per output. ``steps`` gives each
    output's quantization step (:func:`output_steps` of the QDQ model); ``reference`` the float
    model's outputs (by name, or in output order) for SQNR."""
    from graphbuild.frontend.reference import sqnr_db

    got = htp.run(feeds)
    cpu = run_cpu(cpu_model, feeds)
    if isinstance(reference, Sequence):
        reference = dict(zip(htp.output_names, reference, strict=False))
    results = []
    for name in htp.output_names:
        h = np.asarray(got[name], dtype=np.float64)
        c = np.asarray(cpu[name], dtype=np.float64).reshape(h.shape)
        diff = float(np.max(np.abs(h - c))) if h.size else 0.0
        step = (steps or {}).get(name)
        sqnr_h = sqnr_c = None
        if reference is not None and name in reference:
            ref = np.asarray(reference[name], dtype=np.float32).reshape(h.shape)
            sqnr_h, sqnr_c = sqnr_db(ref, h), sqnr_db(ref, c)
        results.append(
            OutputComparison(
                name=name,
                max_abs_diff=diff,
                output_step=step,
                max_diff_steps=diff / step if step else None,
                sqnr_htp_db=sqnr_h,
                sqnr_cpu_db=sqnr_c,
            )
        )
    return results


def _load_graph(model: ModelSource) -> onnx.ModelProto:
    """The graph of ``model`` (its weights stay on disk)."""
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return onnx.load(os.fspath(model), load_external_data=False)


# --------------------------------------------------------------------------- one check


@dataclass
class HtpCheck:
    """The HTP check of one model for one target: did it compile with no CPU fallback, what
    QNN took, and the numbers (from the fallback session where the strict one was refused)."""

    target: HtpTarget
    compiled: bool
    partition: PartitionReport | None
    outputs: list[OutputComparison] = field(default_factory=list)
    refusal: str = ""
    qnn_messages: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        head = f"HTP {self.target.label}: " + ("compiled" if self.compiled else "refused")
        parts = [head]
        if self.partition is not None:
            parts.append(self.partition.summary())
        steps = [o.max_diff_steps for o in self.outputs if o.max_diff_steps is not None]
        if steps:
            parts.append(f"max {max(steps):.3g} output steps from ORT CPU")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "htp_arch": self.target.htp_arch,
            "soc_model": self.target.soc_model,
            "compiled": self.compiled,
            "refusal": self.refusal,
            "qnn_messages": list(self.qnn_messages),
            "partition": self.partition.to_json() if self.partition else None,
            "outputs": [o.to_json() for o in self.outputs],
            "versions": dict(self.versions),
            "summary": self.summary(),
        }


def check_model(
    model: ModelSource,
    feeds: Mapping[str, np.ndarray],
    target: HtpTarget,
    *,
    cpu_model: ModelSource | None = None,
    steps: Mapping[str, float | None] | None = None,
    reference: Mapping[str, np.ndarray] | Sequence[np.ndarray] | None = None,
) -> HtpCheck:
    """Compile ``model`` for ``target`` with CPU fallback disabled; report the partition and
    compare with ORT CPU (on ``cpu_model``, default ``model``). A refused model is reported,
    not raised: its numbers then come from a session with CPU fallback, where one builds."""
    require_backend()
    compiled, refusal, messages = True, "", []
    try:
        session = open_session(model, target)
    except HtpRefusedError as refused:
        compiled, refusal = False, refused.onnxruntime_message
        messages = [m for m in refused.qnn_messages if m not in refusal]
        try:
            session = open_session(model, target, allow_cpu_fallback=True)
        except HtpRefusedError:
            session = None
        if session is not None and refused.partition is not None:
            session.partition = refused.partition  # with QNN's reasons for the CPU nodes
    check = HtpCheck(
        target,
        compiled,
        session.partition if session else None,
        refusal=refusal,
        qnn_messages=list(messages),
        versions=backend_versions(),
    )
    if session is not None:
        compared = cpu_model if cpu_model is not None else model
        if steps is None:
            steps = output_steps(_load_graph(compared))
        check.outputs = compare_with_cpu(session, compared, feeds, steps=steps, reference=reference)
    return check
