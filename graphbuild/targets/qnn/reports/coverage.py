"""The coverage report: does the export quantize what QNN HTP runs quantized?

QNN runs quantized exactly the tensors the encodings name, so a tensor the HTP rules
(:mod:`graphbuild.targets.qnn.rules.plan`) quantize but the export leaves float runs in float on the
device, and a tensor quantized with other settings (a symmetric grid where HTP wants an
asymmetric one) is one Qualcomm's tools reject. The report compares the rules, applied to the
exported ONNX model itself, with the quantizers the export wrote, and says for every tensor
left float why: an op the preset does not support (named, with its module), a tensor that
exists only inside one op's ONNX lowering, calibration that dropped the quantizer, or a
pre-quantized model without a quantizer there. It also flags degenerate calibrated ranges:
a range below a few steps of the smallest scale (the values collapse onto a few grid points,
a random-init network whose activations vanish) or one so wide no grid resolves ordinary
values (a ``finfo.min`` attention mask). And it names the tensors in the pattern of a known
defect of QNN's HTP backend (:mod:`graphbuild.targets.qnn.reports.defects`), with the reason and
the test that reproduces it. ``weight_bytes`` is the weights' size as the device stores
them (an encoded weight at its bits).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import torch

from graphbuild.errors import CoverageError
from graphbuild.quant.quantmap import QuantMap, QuantSpec, QuantValues
from graphbuild.targets.qnn.presets.overrides import (
    apply_layer_overrides,
    onnx_tensor_modules,
    parse_layer_overrides,
)
from graphbuild.targets.qnn.reports.defects import defect_candidates, defects_at
from graphbuild.targets.qnn.rules.aten_view import UNSUPPORTED
from graphbuild.targets.qnn.rules.onnx_view import onnx_view
from graphbuild.targets.qnn.rules.plan import CONFIG_NAME, GraphView, OpNode, Plan, TensorRule, plan
from graphbuild.targets.qnn.rules.view import view_from_json, view_to_json

__all__ = ["check_coverage", "coverage_report", "coverage_structure", "summary_line"]

#: a range beyond this holds a masking constant, not data
HUGE_RANGE = 1e30
_INTERNAL = re.compile(r"^val_\d+$")


def coverage_structure(model: onnx.ModelProto) -> dict[str, Any]:
    """What the report reads of the lowered model alone, as JSON: the graph as the HTP rules
    see it and the tensors in a known defect's pattern. It depends on the graph, not on the
    bit-widths or values, so a retune reuses it (the ``htp_view`` stage)."""
    return {"view": view_to_json(onnx_view(model)), "defects": defect_candidates(model)}


def coverage_report(
    model: onnx.ModelProto,
    qmap: QuantMap,
    names: Mapping[int, str],
    values: QuantValues,
    bits: tuple[int, int] | None,
    left_float: Mapping[str, str] | None = None,
    preset: str | None = None,
    collapsed: Mapping[str, Any] | None = None,
    overrides: Mapping[str, str] | None = None,
    structure: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report for one export. ``model`` is the lowered model (either format), ``names``
    qid -> the tensor each quantizer annotates, ``bits`` the preset's (weight, activation)
    bits (None: the model brought its own quantizers; settings are then not compared) and
    ``left_float`` the tensors calibration left float (name -> why), ``collapsed`` the
    activations whose calibrated range collapsed (name -> [min, max]), ``overrides`` the
    preset's ``layer_overrides``: what it was asked to do instead of the HTP rules is what
    the report expects, and lists as overridden. ``structure``: the model's
    :func:`coverage_structure`, where a stage keeps it."""
    structure = structure if structure is not None else coverage_structure(model)
    view = view_from_json(structure["view"])
    rules = plan(view, *(bits or (8, 16)))
    overridden: dict[str, str] = {}
    if overrides and bits is not None:  # what the preset was asked to do instead
        rules, floated, changed = apply_layer_overrides(
            rules, onnx_tensor_modules(model, view), parse_layer_overrides(overrides), bits
        )
        overridden = {**floated, **changed}
    encoded = _encoded(qmap, names)
    expected = rules.quantized()
    left_float = dict(left_float or {})
    consumers = view.consumers()
    floats = [
        _float_entry(t, view, consumers, rules, left_float, preset)
        for t in expected
        if t not in encoded
    ]
    mismatched = []
    if bits is not None:
        for t, rule in expected.items():
            spec = encoded.get(t)
            if spec is not None and _settings(rule) != _spec_settings(spec):
                mismatched.append(
                    {
                        "tensor": t,
                        "expected": _describe(*_settings(rule)),
                        "encoded": _describe(*_spec_settings(spec)),
                    }
                )
    extra = [
        {"tensor": t, "reason": rules.rules[t].why if t in rules.rules else "not a float tensor"}
        for t in encoded
        if t not in expected
    ]
    report = {
        "rules": CONFIG_NAME,
        "preset": preset,
        "expected": len(expected),
        "quantized": len(expected) - len(floats) - len(mismatched),
        "float": sorted(floats, key=lambda e: e["tensor"]),
        "mismatched": sorted(mismatched, key=lambda e: e["tensor"]),
        "overridden": [{"tensor": t, "override": overridden[t]} for t in sorted(overridden)],
        "extra": sorted(extra, key=lambda e: e["tensor"]),
        "degenerate": _degenerate(qmap, names, values, collapsed or {}),
        "htp_defects": defects_at(
            structure["defects"], {t: s.bits for t, s in encoded.items() if s.param is None}
        ),
        "weight_bytes": _weight_bytes(model, encoded),
    }
    report["summary"] = summary_line(report)
    return report


def check_coverage(report: Mapping[str, Any]) -> None:
    """Raise :class:`CoverageError` when a tensor QNN HTP runs quantized is float or
    quantized with other settings (``strict_coverage``)."""
    floats, mismatched = report.get("float", []), report.get("mismatched", [])
    if not floats and not mismatched:
        return
    shown = [f"{e['tensor']} ({e['reason']})" for e in floats[:6]]
    shown += [f"{e['tensor']} ({e['encoded']}, HTP: {e['expected']})" for e in mismatched[:6]]
    more = len(floats) + len(mismatched) - len(shown)
    raise CoverageError(
        f"strict coverage: {report.get('summary', '')}: "
        + "; ".join(shown)
        + (f"; and {more} more" if more > 0 else "")
    )


def summary_line(report: Mapping[str, Any]) -> str:
    """``95/97 tensors quantized as QNN HTP runs them; 2 float: ...``"""
    line = f"{report['quantized']}/{report['expected']} tensors quantized as QNN HTP runs them"
    floats = report.get("float", [])
    if floats:
        reasons = Counter(e["reason"] for e in floats)
        parts = [f"{n} {reason}" for reason, n in reasons.most_common(3)]
        line += f"; {len(floats)} float: " + ", ".join(parts)
        if len(reasons) > 3:
            line += ", ..."
    if report.get("mismatched"):
        line += f"; {len(report['mismatched'])} with other settings than HTP's"
    if report.get("overridden"):
        line += f"; {len(report['overridden'])} as layer_overrides asked"
    if report.get("extra"):
        line += f"; {len(report['extra'])} quantized where HTP keeps float"
    if report.get("degenerate"):
        line += f"; {len(report['degenerate'])} degenerate range(s)"
    defects = report.get("htp_defects")
    if defects:
        names = ", ".join(sorted({e["defect"] for e in defects}))
        line += f"; {len(defects)} in a known QNN HTP defect's pattern ({names})"
    return line


# ---------------------------------------------------------------------------- details


_FLOAT_BYTES = {
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2,
    onnx.TensorProto.DOUBLE: 8,
}


def _weight_bytes(model: onnx.ModelProto, encoded: Mapping[str, QuantSpec]) -> int:
    """The float initializers' size as the device stores them: an encoded one at its bits,
    the rest as they are (what a sweep compares its variants' sizes by)."""
    total = 0.0
    for init in model.graph.initializer:
        size = _FLOAT_BYTES.get(init.data_type)
        if size is None:
            continue
        numel = int(np.prod(init.dims)) if len(init.dims) else 1
        spec = encoded.get(init.name)
        total += numel * (spec.bits / 8 if spec is not None and spec.param is not None else size)
    return int(math.ceil(total))


def _encoded(qmap: QuantMap, names: Mapping[int, str]) -> dict[str, QuantSpec]:
    out: dict[str, QuantSpec] = {}
    for spec in qmap:
        name = names.get(spec.qid)
        if name is not None:
            out.setdefault(name, spec)
    return out


def _settings(rule: TensorRule) -> tuple[int, bool, bool]:
    return rule.bits, rule.symmetric, rule.per_channel


def _spec_settings(spec: QuantSpec) -> tuple[int, bool, bool]:
    symmetric = spec.symmetric if spec.symmetric is not None else spec.signed
    # an LPBQ weight is per channel with integer block scales: what the HTP runs quantized
    per_channel = spec.axis is not None and (spec.block_size is None or spec.is_lpbq)
    return spec.bits, bool(symmetric), per_channel


def _describe(bits: int, symmetric: bool, per_channel: bool) -> str:
    return (
        f"{bits}-bit {'symmetric' if symmetric else 'asymmetric'} "
        f"{'per-channel' if per_channel else 'per-tensor'}"
    )


def _float_entry(
    tensor: str,
    view: GraphView,
    consumers: Mapping[str, list[OpNode]],
    rules: Plan,
    left_float: Mapping[str, str],
    preset: str | None,
) -> dict[str, str]:
    producer = rules.producers.get(tensor)
    if producer is not None:
        op, source = producer.op_type, producer.source
    else:
        op, source = ("input" if tensor in view.inputs else "constant"), ""
        readers = consumers.get(tensor, [])
        source = readers[0].source if readers else ""
    reason = _reason(tensor, source, rules, left_float, preset)
    return {"tensor": tensor, "op": op, "source": source, "reason": reason}


def _reason(
    tensor: str, source: str, rules: Plan, left_float: Mapping[str, str], preset: str | None
) -> str:
    """Why ``tensor`` (produced, or for an input or constant read, by ``source``) is float."""
    if tensor in left_float:
        return left_float[tensor]
    producer = rules.producers.get(tensor)
    target = source.split(" in ")[0]
    op = target.split(".")[1] if target.startswith("aten.") else ""
    if op in UNSUPPORTED:
        return f"unsupported op {target}"
    if (
        producer is not None
        and producer.origin
        and producer.origin != tensor
        and (_INTERNAL.match(tensor) or producer.op_type == "Constant")
    ):
        return f"inside the ONNX lowering of {target or producer.op_type}"
    if preset is None:
        return "the model has no quantizer here"
    return "not quantized by the preset"


def _degenerate(
    qmap: QuantMap, names: Mapping[int, str], values: QuantValues, collapsed: Mapping[str, Any]
) -> list[dict]:
    """Activations whose calibrated range collapsed (below a few steps of the smallest scale,
    as calibration measured it) or spans a masking constant (from the encoding itself)."""
    out = {
        name: {
            "tensor": name,
            "min": float(low),
            "max": float(high),
            "why": "the calibrated range collapsed below a few steps of the smallest scale: "
            "every value lands on a handful of grid points (vanishing activations?)",
        }
        for name, (low, high) in collapsed.items()
    }
    for spec in qmap:
        name = names.get(spec.qid)
        if spec.param is not None or name is None or name in out or spec.qid not in values.values:
            continue
        qp = values[spec.qid]
        scale = qp.scale.detach().to(torch.float64).reshape(-1).numpy()
        zero = qp.zero_point.detach().to(torch.float64).reshape(-1).numpy()
        low = float(np.min(scale * (spec.qmin - zero)))
        high = float(np.max(scale * (spec.qmax - zero)))
        if max(abs(low), abs(high)) >= HUGE_RANGE:
            out[name] = {
                "tensor": name,
                "min": low,
                "max": high,
                "why": "the range spans a masking constant: ordinary values fall on one step",
            }
    return [out[k] for k in sorted(out)]
