"""The HTP's numbers against onnxruntime's CPU on the same model, per output: the largest
difference in the output's quantization steps, and the SQNR of each against a float reference.

ORT's CPU run is at ``ORT_ENABLE_BASIC``: at its default level onnxruntime's QDQ fusions
mis-type some w8a8 models ("output_dtype INT8 does not match y_zero_point type UINT8")."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx

from graphbuild.targets.qnn.htp_runtime.session import HtpSession, ModelSource

__all__ = [
    "OutputComparison",
    "compare_with_cpu",
    "grid_steps",
    "output_steps",
    "run_cpu",
    "scalar_constants",
]


@dataclass(frozen=True)
class OutputComparison:
    """One output: HTP against ORT CPU on the same inputs, and each against a float reference.

    ``max_diff_steps`` is max |HTP - CPU| in the output's quantization steps (None where the
    output has no per-tensor encoding); ``sqnr_htp_db`` and ``sqnr_cpu_db`` are against the
    float reference (None without one), ``sqnr_htp_vs_cpu_db`` the HTP's against the CPU's.
    ``forced_max_diff_steps``: the same with every quantized activation forced to the CPU's
    value (:mod:`.forced`), where that ran."""

    name: str
    max_abs_diff: float
    output_step: float | None
    max_diff_steps: float | None
    sqnr_htp_db: float | None = None
    sqnr_cpu_db: float | None = None
    sqnr_htp_vs_cpu_db: float | None = None
    forced_max_diff_steps: float | None = None

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
    scalars = scalar_constants(model)
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
                max_diff_steps=grid_steps(h, c, step) if step else None,
                sqnr_htp_db=sqnr_h,
                sqnr_cpu_db=sqnr_c,
                sqnr_htp_vs_cpu_db=sqnr_db(c.astype(np.float32), h),
            )
        )
    return results


def grid_steps(a: np.ndarray, b: np.ndarray, step: float) -> float:
    """max |a - b| in steps of ``step``: exact integers where both lie on the grid (a
    DequantizeLinear's outputs, up to float32 rounding), else the plain ratio."""
    qa, qb = np.asarray(a, np.float64) / step, np.asarray(b, np.float64) / step
    if qa.size == 0:
        return 0.0
    ra, rb = np.rint(qa), np.rint(qb)
    if max(float(np.max(np.abs(qa - ra))), float(np.max(np.abs(qb - rb)))) < 0.05:
        return float(np.max(np.abs(ra - rb)))
    return float(np.max(np.abs(qa - qb)))


def scalar_constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The one-element initializers and Constant outputs of ``model``, by name."""
    scalars = {
        i.name: onnx.numpy_helper.to_array(i)
        for i in model.graph.initializer
        if len(i.dims) == 0 or (len(i.dims) == 1 and i.dims[0] == 1)
    }
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute:
            with contextlib.suppress(Exception):
                value = onnx.numpy_helper.to_array(
                    onnx.helper.get_attribute_value(node.attribute[0])
                )
                if value.size == 1:
                    scalars[node.output[0]] = value
    return scalars
