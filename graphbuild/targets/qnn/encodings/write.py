"""Write QNN encodings (1.0.0, 0.6.1, 2.0.0) from a quant map and its current values.

A quantizer is ``x = s * (q - z)`` with ``q`` in ``[qmin, qmax]`` (docs/design.md, "QNN encodings
formats"). QNN's 1.0.0 and 0.6.1 store an *offset* on the unsigned grid instead of ``z``; 2.0.0
stores ``z`` itself, as ONNX QuantizeLinear does.

The documents carry what AIMET's own exports carry (aimet-onnx / aimet-torch 2.42,
``QuantizationSimModel.export``): a ``producer``; in 1.0.0 and 0.6.1 ``quantizer_args`` (the
run-wide defaults QNN's converter falls back on) and ``excluded_layers`` (aimet-torch writes it
in both). Offsets are JSON integers, as aimet-torch writes them (aimet-onnx writes ``-128.0``;
both parse the same). With an ONNX model at hand, int32 bias encodings are derived
as AIMET does by default for 2.0.0 (:mod:`.bias`). Each version's entries are written by
:mod:`.formats`, the document's text by :mod:`.text`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import torch

from graphbuild.errors import ExportError
from graphbuild.quant.quantmap import QuantMap, QuantSpec, QuantValues
from graphbuild.targets.qnn.encodings.bias import BiasScale, find_int32_biases
from graphbuild.targets.qnn.encodings.formats import _DOC_WRITERS, _ENTRY_WRITERS, _Quantizer
from graphbuild.targets.qnn.encodings.grid import (
    DEFAULT_VERSION,
    check_version,
    full_grid,
)

__all__ = ["build_encodings"]

BIAS_OP = "graphbuild.int32_bias"
"""The ``op`` of the quantizer an int32 bias encoding is written from (no graph op has it)."""


def build_encodings(
    qmap: QuantMap,
    values: QuantValues,
    names: Mapping[int, str],
    version: str = DEFAULT_VERSION,
    *,
    model: onnx.ModelProto | None = None,
    int32_bias: bool | None = None,
    quant_scheme: str | None = None,
) -> dict[str, Any]:
    """The QNN encodings document for every quantizer of ``qmap``, in qid order.

    ``names[qid]`` is the ONNX tensor the quantizer annotates. Two quantizers on one tensor
    are written once when their encodings agree; disagreeing ones are an :class:`ExportError`.

    ``int32_bias`` adds an int32 encoding for every Conv/ConvTranspose/Gemm/MatMul+Add bias of
    ``model`` whose input and weight are quantized (scale = input scale x weight scale, as
    AIMET derives it); ``None`` means AIMET's default: on for 2.0.0 when ``model`` is given,
    off for 1.0.0 and 0.6.1. ``quant_scheme`` goes into ``quantizer_args`` when known.
    """
    check_version(version)
    quantizers = [_resolve(spec, values, names) for spec in sorted(qmap, key=lambda s: s.qid)]
    default = version == "2.0.0" and model is not None  # aimet-onnx: export_int32_bias=None
    wants_bias = int32_bias if int32_bias is not None else default
    if wants_bias:
        if model is None:
            raise ExportError("int32 bias encodings need the ONNX model the encodings describe")
        quantizers = _with_biases(quantizers, model, names, len(qmap))
    rows = _unique_rows((q, _ENTRY_WRITERS[version](q)) for q in quantizers)
    return _DOC_WRITERS[version](rows, _quantizer_args(quantizers, quant_scheme))


def _with_biases(
    quantizers: list[_Quantizer], model: onnx.ModelProto, names: Mapping[int, str], next_qid: int
) -> list[_Quantizer]:
    """``quantizers`` with an int32 bias quantizer after the weight quantizer it derives from."""
    known = {q.spec.qid: (q.spec, _bias_weight_scale(q)) for q in quantizers}
    after: dict[int, list[_Quantizer]] = {}
    for i, bias in enumerate(find_int32_biases(model, known, names)):
        after.setdefault(bias.weight_qid, []).append(_bias_quantizer(bias, next_qid + i))
    out: list[_Quantizer] = []
    for q in quantizers:
        out.append(q)
        out.extend(after.get(q.spec.qid, ()))
    return out


def _bias_weight_scale(q: _Quantizer) -> np.ndarray:
    """The weight scale an int32 bias derives from: an LPBQ weight's per-channel float scale
    (laid out like its block scales, one block per channel), as AIMET and QNN's execution
    provider derive it; else the quantizer's own scale."""
    if q.channel_scale is None:
        return q.scale
    shape = list(q.scale.shape)
    shape[q.spec.axis % len(shape)] = 1
    return q.channel_scale.reshape(shape)


def _bias_quantizer(bias: BiasScale, qid: int) -> _Quantizer:
    """The signed int32 grid with zero point 0 that AIMET gives a bias."""
    lo, hi = full_grid(32, True)
    spec = QuantSpec(
        qid=qid,
        bits=32,
        signed=True,
        qmin=lo,
        qmax=hi,
        axis=None if bias.per_tensor else 0,
        param=bias.name,
        op=BIAS_OP,
        node=bias.node,
        symmetric=True,
    )
    scale = bias.scale.reshape(-1).astype(np.float32)
    return _Quantizer(bias.name, spec, scale, np.zeros(scale.shape, dtype=np.int64))


def _quantizer_args(quantizers: Sequence[_Quantizer], quant_scheme: str | None) -> dict[str, Any]:
    """AIMET's run-wide ``quantizer_args``, read off the quantizers themselves: the most common
    activation and weight bit-widths (ties to the wider), whether every weight is symmetric and
    whether any is per-channel. Int32 biases are not weights here, as in AIMET."""
    acts = [q for q in quantizers if q.spec.param is None]
    weights = [q for q in quantizers if q.spec.param is not None and q.spec.op != BIAS_OP]
    args: dict[str, Any] = {
        "activation_bitwidth": _most_common_bits(acts),
        "dtype": "int",
        "is_symmetric": bool(weights) and all(q.is_sym for q in weights),
        "param_bitwidth": _most_common_bits(weights),
        "per_channel_quantization": any(q.spec.axis is not None for q in weights),
    }
    if quant_scheme is not None:
        args["quant_scheme"] = quant_scheme
    return args


_DEFAULT_BITS = 8


def _most_common_bits(quantizers: Sequence[_Quantizer]) -> int:
    counts: dict[int, int] = {}
    for q in quantizers:
        counts[q.spec.bits] = counts.get(q.spec.bits, 0) + 1
    if not counts:
        return _DEFAULT_BITS
    return max(counts, key=lambda bits: (counts[bits], bits))


def _resolve(spec: QuantSpec, values: QuantValues, names: Mapping[int, str]) -> _Quantizer:
    where = f"quantizer {spec.qid} ({spec.op or 'op?'} at {spec.node or 'node?'})"
    if spec.qid not in names:
        raise ExportError(f"{where} has no ONNX tensor name")
    if spec.qid not in values.values:
        raise ExportError(f"{where} has no scale / zero point values")
    qp = values[spec.qid]
    scale = qp.scale.detach().cpu().to(torch.float32).numpy().copy()
    if scale.size == 0 or not np.all(np.isfinite(scale)) or np.any(scale <= 0):
        raise ExportError(f"{where}: scales must be finite and positive, got {scale.tolist()}")
    zero_point = _zero_points(qp.zero_point, scale.shape, where)
    if spec.block_size is None:
        scale, zero_point = scale.reshape(-1), zero_point.reshape(-1)
    if spec.axis is None and scale.size != 1:
        raise ExportError(f"{where} is per-tensor but has {scale.size} scales")
    if spec.block_scale_bits is None:
        return _Quantizer(names[spec.qid], spec, scale, zero_point)
    if qp.channel_scale is None or qp.block_int_scale is None:
        raise ExportError(f"{where} is LPBQ but has no per-channel and per-block scales")
    channel = qp.channel_scale.detach().cpu().to(torch.float32).numpy().reshape(-1).copy()
    ints = qp.block_int_scale.detach().cpu().to(torch.int64).numpy().reshape(scale.shape).copy()
    if not np.all(np.isfinite(channel)) or np.any(channel <= 0):
        raise ExportError(f"{where}: LPBQ channel scales must be finite and positive")
    top = 2**spec.block_scale_bits
    if ints.size and (ints.min() < 1 or ints.max() > top):
        raise ExportError(f"{where}: LPBQ block scales must be integers in [1, {top}]")
    return _Quantizer(names[spec.qid], spec, scale, zero_point, channel, ints)


def _zero_points(zero_point: torch.Tensor, shape: tuple[int, ...], where: str) -> np.ndarray:
    """Integer zero points shaped like the scales (a single one is broadcast)."""
    z = zero_point.detach().cpu()
    if z.is_floating_point():
        if not torch.equal(z, z.round()):
            raise ExportError(f"{where}: zero points must be integers, got {z.tolist()}")
        z = z.round()
    zp = z.to(torch.int64).numpy()
    if zp.size == 1:
        return np.full(shape, int(zp.reshape(-1)[0]), dtype=np.int64)
    if zp.size != math.prod(shape):
        raise ExportError(f"{where}: {zp.size} zero points for {math.prod(shape)} scales")
    return zp.reshape(shape).astype(np.int64)


def _unique_rows(rows: Iterable[tuple[_Quantizer, Any]]) -> list[tuple[_Quantizer, Any]]:
    """One row per tensor name; a second, different encoding of the same tensor is an error."""
    seen: dict[str, tuple[_Quantizer, Any]] = {}
    for q, entry in rows:
        first = seen.setdefault(q.name, (q, entry))
        if first[0] is q:
            continue
        if (first[0].section, first[1]) != (q.section, entry):
            raise ExportError(
                f"tensor '{q.name}' has conflicting encodings from quantizers "
                f"{first[0].spec.qid} and {q.spec.qid}"
            )
    return list(seen.values())
