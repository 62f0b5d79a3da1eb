"""The presets' split quantization, values (see :mod:`.placement` for the whole): the preset's
grids (``quant_map``; ``quant_sites``, what ``onnx`` lowering reads) and scales and zero
points from the statistics and the range method (``qparams``), then the stages after them
that read the placement or the statistics: ``bind`` (the folded and created tensors),
``encodings`` (the range method's AIMET name), ``coverage`` (the collapsed ranges) and
``reference`` (the marker graph run with each marker a quantize-dequantize).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphbuild.frontend.capture import as_args
from graphbuild.frontend.devices import host_state, to_device
from graphbuild.frontend.programs import lifted_runner, with_state
from graphbuild.quant.markers import MARKER_TARGET
from graphbuild.quant.quantmap import QParams, QuantMap, QuantSpec, QuantValues
from graphbuild.targets.qnn.pipeline.placement import Overlay
from graphbuild.targets.qnn.pipeline.site_rules import SiteRules


def _preset(quantizer: Any) -> str:
    return quantizer if isinstance(quantizer, str) else quantizer.preset


def _spec_of(rule: Mapping[str, Any], axis: int | None) -> Any:
    from graphbuild.targets.qnn.presets.observers import quantization_spec

    fixed = tuple(rule["fixed"]) if rule["fixed"] is not None else None
    axis = axis if rule["per_channel"] else None
    if axis is None and rule["per_channel"]:  # as the preset's annotator does
        return quantization_spec(rule["bits"], symmetric=rule["symmetric"])
    return quantization_spec(
        rule["bits"],
        symmetric=rule["symmetric"],
        axis=axis,
        fixed=fixed,
        min_scale=rule["min_scale"],
    )


def quant_map(inputs: tuple, samples: Any, context: Any) -> tuple:
    """The preset's grid for every kept quantizer, with ``layer_overrides`` and LPBQ applied
    (and, as the one-stage path records it, what calibration left float)."""
    (layout, _), kept = inputs
    rules = SiteRules(layout, context["layer_overrides"])
    return _quant_map(layout, kept, _preset(context["quantizer"]), rules)


def quant_sites(inputs: tuple, samples: Any, context: Any) -> tuple:
    """The quant map of the placement's first preset, whatever preset is set: what lowering for
    ``onnx`` reads (which tensor each qid marks, never a grid), the same for every preset,
    so a preset change does not lower the skeleton again. (The split's outputs are compared
    byte for byte with the one-stage pipeline's for every preset: a lowering that read a
    grid would show there.)"""
    (layout, _), kept = inputs
    return _quant_map(layout, kept, layout["presets"][0], SiteRules(layout, None))


def _quant_map(
    layout: Mapping[str, Any], kept: Mapping[str, Any], preset: str, rules: SiteRules
) -> tuple:
    specs = []
    for site, qid in zip(layout["sites"], kept["qids"], strict=True):
        if qid is None:
            continue
        group = layout["groups"][site["group"]]
        rule = rules.rule(site["group"], preset)
        if rule["lpbq"]:
            specs.append(_lpbq_spec(qid, site))
            continue
        spec = _spec_of(rule, group["axis"])
        per_channel = spec.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine)
        axis = spec.ch_axis if per_channel else None
        kind = "channel" if per_channel else "tensor"
        specs.append(
            QuantSpec(
                qid=qid,
                bits=(spec.quant_max - spec.quant_min).bit_length(),
                signed=spec.quant_min < 0,
                qmin=spec.quant_min,
                qmax=spec.quant_max,
                axis=axis,
                param=site["tensor"] if site["input"] == "state" else None,
                op=f"quantized_decomposed.quantize_per_{kind}.default",
                node=site["source"],
                symmetric=spec.quant_min < 0,
            )
        )
    doc = QuantMap(tuple(specs)).to_json()
    if kept["left_float"]:
        doc["left_float"] = dict(kept["left_float"])
    return doc, {}


def _lpbq_spec(qid: int, site: Mapping[str, Any]) -> QuantSpec:
    """An LPBQ weight as ``normalize`` reads the one-stage program's blocked pair back."""
    from graphbuild.targets.qnn.presets.lpbq_weights import BLOCK_SIZE, SCALE_BITS, lpbq_spec

    spec = lpbq_spec()
    return QuantSpec(
        qid=qid,
        bits=(spec.quant_max - spec.quant_min).bit_length(),
        signed=True,
        qmin=spec.quant_min,
        qmax=spec.quant_max,
        axis=1,
        block_size=BLOCK_SIZE,
        param=site["tensor"],
        op="quantized_decomposed.quantize_per_channel_group.default",
        node=site["source"],
        symmetric=True,
        block_scale_bits=SCALE_BITS,
    )


def _observer(spec: Any) -> Any:
    """The observer ``prepare_pt2e`` builds from ``spec`` (torchao's own recipe)."""
    from dataclasses import asdict

    kwargs = asdict(spec)
    ctr = kwargs.pop("observer_or_fake_quant_ctr")
    cls = getattr(getattr(ctr, "p", None), "func", ctr)
    if "PerChannel" not in cls.__name__:
        kwargs.pop("ch_axis")
    return ctr.with_args(**kwargs)()


def qparams(inputs: tuple, samples: Any, context: Any) -> dict:
    """Values: every kept quantizer's scale and zero point, from the statistics, the
    preset's grid and the range method: what ``convert_pt2e`` would write (per tensor as
    the literal it writes, per channel as the tensor). The asymmetric per-tensor groups of
    one grid go through their observer's arithmetic together (elementwise: the same
    numbers)."""
    from graphbuild.frontend.ranges import activation_range
    from graphbuild.frontend.statistics import Statistics, static_groups

    (layout, _), weights, activations, kept = inputs
    stats = Statistics(weights, activations)
    preset = _preset(context["quantizer"])
    rules = SiteRules(layout, context["layer_overrides"])
    sites = layout["sites"]
    lpbq: dict[int, QParams] = {}
    static = static_groups(sites)
    observers: dict[str, tuple[Any, Any]] = {}  # one per distinct grid: only min/max differ
    ranges: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}
    for site, qid in zip(sites, kept["qids"], strict=True):
        group = site["group"]
        if qid is None or group in ranges or group in lpbq:
            continue
        rule, axis = rules.rule(group, preset), layout["groups"][group]["axis"]
        if rule["lpbq"]:
            lpbq[group] = _lpbq_values(qid, site, weights, group)
            continue
        grid = repr((sorted(rule.items()), axis))
        if grid not in observers:
            spec = _spec_of(rule, axis)
            observers[grid] = (spec, _observer(spec))
        spec = observers[grid][0]
        low, high = stats.range(group)
        if group not in static and low.numel() == 1:
            steps = spec.quant_max - spec.quant_min
            symmetric = spec.qscheme == torch.per_tensor_symmetric
            low, high = activation_range(stats, group, context["range"], steps, symmetric)
        ranges[group] = (grid, low, high)
    values = {**_batched_qparams(ranges, observers), **lpbq}
    for group, (grid, low, high) in ranges.items():
        if group not in values:
            spec, observer = observers[grid]
            observer.min_val, observer.max_val = low.clone(), high.clone()
            values[group] = _as_written(spec, *observer.calculate_qparams())
    return QuantValues(
        {q: values[s["group"]] for s, q in zip(sites, kept["qids"], strict=True) if q is not None}
    ).to_tensors()


def _lpbq_values(
    qid: int, site: Mapping[str, Any], weights: Mapping[str, torch.Tensor], group: int
) -> QParams:
    """An LPBQ weight's values: its blocks' min/max (``weight_stats``) through the LPBQ
    observer's arithmetic, read back as ``normalize`` reads the one-stage program's."""
    from graphbuild.frontend.qvalues import lpbq_qparams
    from graphbuild.frontend.statistics import block_range
    from graphbuild.targets.qnn.presets.lpbq_weights import LpbqWeightObserver

    observer = LpbqWeightObserver()
    observer.min_val, observer.max_val = block_range(weights, group)
    scale, zero_point = observer.calculate_qparams()
    return lpbq_qparams(_lpbq_spec(qid, site), scale.to(torch.float32), zero_point)


def _batched_qparams(
    ranges: Mapping[int, tuple[str, torch.Tensor, torch.Tensor]],
    observers: Mapping[str, tuple[Any, Any]],
) -> dict[int, QParams]:
    """The asymmetric per-tensor groups with an observed range, one observer call per grid."""
    members: dict[str, list[int]] = {}
    for group, (grid, low, high) in ranges.items():
        spec = observers[grid][0]
        ok = low.numel() == 1 and bool(torch.isfinite(low) & torch.isfinite(high) & (low <= high))
        if spec.qscheme == torch.per_tensor_affine and ok:
            members.setdefault(grid, []).append(group)
    out: dict[int, QParams] = {}
    for grid, groups in members.items():
        spec, observer = observers[grid]
        low = torch.stack([ranges[g][1].reshape(()) for g in groups])
        high = torch.stack([ranges[g][2].reshape(()) for g in groups])
        scales, zero_points = observer._calculate_qparams(low, high)
        for i, group in enumerate(groups):
            out[group] = _as_written(spec, scales[i], zero_points[i])
    return out


def _as_written(spec: Any, scale: torch.Tensor, zero_point: torch.Tensor) -> QParams:
    """Scale and zero point as ``convert_pt2e`` writes them and ``normalize`` reads them back:
    per tensor a Python float and int in the graph, per channel the tensors."""
    if scale.numel() == 1 and spec.qscheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        scale = torch.tensor([float(scale)], dtype=torch.float64)
        zero_point = torch.tensor([int(zero_point)], dtype=torch.int64)
    return QParams(
        scale.to(torch.float32).reshape(-1).clone(),
        zero_point.to(torch.int64).reshape(-1).clone(),
    )


def bind_weights(inputs: tuple, samples: Any, context: Any) -> Any:
    """The model's weights, the folded ones and the placement's own tensors into the
    lowered skeleton; what it reads of the model is keyed by ``weight_digests``."""
    from graphbuild.onnx.bind import bind

    (lowered, _), (qmap, _), qvalues, digests, (_, created), folded = inputs
    model = host_state(context.input)
    return bind(
        lowered,
        Overlay(folded, created, model),
        QuantMap.from_json(qmap),
        QuantValues.from_tensors(qvalues),
        fake_quantize_weights=context["fake_quantize_weights"],
        state_digests={
            name: d.rpartition(":")[2] for name, d in digests.items() if name not in folded
        },
    )


#: AIMET's ``quant_scheme`` names of the range methods it has (encodings' quantizer_args)
_QUANT_SCHEMES = {"minmax": "min_max", "percentile": "percentile", "mse": "tf_enhanced"}


def encodings(inputs: tuple, samples: Any, context: Any) -> Any:
    """The encodings file, its ``quant_scheme`` the range method's AIMET name."""
    from graphbuild.targets.qnn.pipeline.outputs import write_encodings

    scheme = _QUANT_SCHEMES.get(context["range"]["method"])
    return write_encodings(inputs, context, scheme)


def coverage(inputs: tuple, samples: Any, context: Any) -> dict:
    """The coverage report, with the activations whose calibrated range collapsed."""
    from graphbuild.frontend.statistics import Statistics, observed_ranges
    from graphbuild.targets.qnn.pipeline.outputs import coverage as report

    lowered, structure, (qmap, fixed), qvalues, (layout, _), weights, activations, kept = inputs
    stats = Statistics(weights, activations)
    _, degenerate = observed_ranges(layout["sites"], layout["groups"], stats)
    sites = zip(layout["sites"], kept["qids"], strict=True)
    quantized = {site["source"] for site, qid in sites if qid is not None}
    degenerate = {k: v for k, v in degenerate.items() if k in quantized}  # none overridden
    doc = dict(qmap)
    if degenerate:
        doc["degenerate"] = dict(sorted(degenerate.items()))
    return report((lowered, structure, (doc, fixed), qvalues), samples, context)


def reference(inputs: tuple, samples: Any, context: Any) -> dict:
    """The quantized model's outputs on the sample inputs, and its quantized tensors
    (``tensor:<qid>``), for ``check_numerics``: the marker graph with each marker a
    quantize-dequantize of the computed values, as the one-stage program runs them."""
    from graphbuild.frontend.reference import outputs_dict
    from graphbuild.targets.qnn.reports.numerics import TENSOR_PREFIX

    marker, (qmap, _), qvalues, (_, created), folded = inputs
    state = Overlay(folded, created, host_state(context.input))
    specs = QuantMap.from_json(qmap)
    values = QuantValues.from_tensors(qvalues)
    seen: dict[int, torch.Tensor] = {}

    def fake_quantize(x: torch.Tensor, qid: int) -> torch.Tensor:
        y = _quantize_dequantize(x, specs[qid], values[qid])
        seen[qid] = y.detach().float().contiguous()
        return y

    run = lifted_runner(
        with_state(marker.program, state), {MARKER_TARGET: fake_quantize}, keep=False
    )
    with torch.no_grad():
        flat = run(*to_device(as_args(samples), "cpu"))
    out = outputs_dict(flat)
    out.update({f"{TENSOR_PREFIX}{qid}": v for qid, v in seen.items()})
    return out


def _quantize_dequantize(x: torch.Tensor, spec: QuantSpec, value: QParams) -> torch.Tensor:
    """``quantized_decomposed`` quantize then dequantize, with the arguments convert_pt2e
    gives them (per tensor: Python numbers)."""
    from graphbuild.targets.qnn.presets.observers import _SIGNED, _UNSIGNED

    qd = torch.ops.quantized_decomposed
    dtype = (_SIGNED if spec.signed else _UNSIGNED)[spec.bits]
    if spec.block_size is not None:  # LPBQ: torch's blocked pair, as the LPBQ observer writes
        args = (value.scale, value.zero_point, spec.qmin, spec.qmax, dtype, spec.block_size)
        q = qd.quantize_per_channel_group(x, *args)
        return qd.dequantize_per_channel_group(q, *args, torch.float32)
    if spec.axis is None:
        args = (float(value.scale), int(value.zero_point), spec.qmin, spec.qmax, dtype)
        return qd.dequantize_per_tensor(qd.quantize_per_tensor(x, *args), *args)
    args = (value.scale, value.zero_point, spec.axis, spec.qmin, spec.qmax, dtype)
    return qd.dequantize_per_channel(qd.quantize_per_channel(x, *args), *args)
