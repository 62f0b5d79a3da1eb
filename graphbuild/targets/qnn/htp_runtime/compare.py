"""The HTP's numbers against onnxruntime's CPU on the same model, and the whole check of one
model for one target (compile with no CPU fallback, partition, numbers) as one report.

ORT's CPU run is at ``ORT_ENABLE_BASIC``: at its default level onnxruntime's QDQ fusions
mis-type some w8a8 models ("output_dtype INT8 does not match y_zero_point type UINT8")."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx

from graphbuild.targets.qnn.htp_runtime.backend import HtpTarget, backend_versions, require_backend
from graphbuild.targets.qnn.htp_runtime.errors import HtpRefusedError
from graphbuild.targets.qnn.htp_runtime.partition import PartitionReport
from graphbuild.targets.qnn.htp_runtime.session import HtpSession, ModelSource, open_session

__all__ = [
    "HtpCheck",
    "OutputComparison",
    "check_model",
    "compare_with_cpu",
    "output_steps",
    "run_cpu",
]


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
        head = f"QNN HTP {self.target}: " + ("compiled" if self.compiled else "refused")
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
