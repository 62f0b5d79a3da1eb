"""Write QNN encodings (1.0.0, 0.6.1, 2.0.0) from a quant map and its current values.

A quantizer is ``x = s * (q - z)`` with ``q`` in ``[qmin, qmax]`` (DESIGN.md, "QNN encodings
formats"). QNN's 1.0.0 and 0.6.1 store an *offset* on the unsigned grid instead of ``z``; 2.0.0
stores ``z`` itself, as ONNX QuantizeLinear does.

The documents carry what AIMET's own exports carry (aimet-onnx / aimet-torch 2.42,
``QuantizationSimModel.export``): a ``producer``; in 1.0.0 and 0.6.1 ``quantizer_args`` (the
run-wide defaults QNN's converter falls back on) and ``excluded_layers`` (aimet-torch writes it
in both). Offsets are JSON integers, as aimet-torch writes them (aimet-onnx writes ``-128.0``;
both parse the same). With an ONNX model at hand, int32 bias encodings are derived
as AIMET does by default for 2.0.0 (:mod:`.bias`).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch

from graphbuild.errors import ExportError
from graphbuild.hashing import digest_bytes, digest_json
from graphbuild.quant.lpbq import lpbq_axes
from graphbuild.quant.quantmap import QuantMap, QuantSpec, QuantValues
from graphbuild.targets.qnn.encodings.bias import BiasScale, find_int32_biases
from graphbuild.targets.qnn.encodings.grid import (
    DEFAULT_VERSION,
    SECTIONS,
    check_version,
    full_grid,
)
from graphbuild.version import __version__

__all__ = ["build_encodings", "dumps_encodings"]

_CONTAINER_BITS = (4, 8, 16, 32)
BIAS_OP = "graphbuild.int32_bias"
"""The ``op`` of the quantizer an int32 bias encoding is written from (no graph op has it)."""


@dataclass(frozen=True, eq=False)
class _Quantizer:
    """One quantizer resolved to numbers: what every format writer reads."""

    name: str
    spec: QuantSpec
    scale: np.ndarray  # float32; (1,) per-tensor, (C,) per-channel, weight rank if blocked
    zero_point: np.ndarray  # int64, same shape as scale
    channel_scale: np.ndarray | None = None  # LPBQ: float32 (C,)
    block_int_scale: np.ndarray | None = None  # LPBQ: int64, shaped like scale

    @property
    def offset(self) -> np.ndarray:
        """QNN's offset on the unsigned grid: ``-z``, or ``-2^(bw-1) - z`` if signed."""
        shift = 2 ** (self.spec.bits - 1) if self.spec.signed else 0
        return -shift - self.zero_point

    @property
    def is_sym(self) -> bool:
        """The spec's own answer, else: every zero point at the grid's centre."""
        if self.spec.symmetric is not None:
            return self.spec.symmetric
        centre = 0 if self.spec.signed else 2 ** (self.spec.bits - 1)
        return bool(np.all(self.zero_point == centre))

    @property
    def section(self) -> str:
        return "param_encodings" if self.spec.param is not None else "activation_encodings"


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


def _producer() -> dict[str, str]:
    return {"package": "graphbuild", "version": __version__}


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


class _FloatList(list):
    """A list of floats (what ``json`` reads and compares) that keeps the float64 array it
    came from, so :func:`dumps_encodings` writes it without formatting one float at a time
    from Python (:func:`_float_text`)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = np.ascontiguousarray(array, dtype=np.float64).reshape(-1)
        super().__init__(self.array.tolist())


class _ChannelList(list):
    """0.6.1's per-channel entries (dicts, as the document holds them) and the arrays they
    were made from, for :func:`dumps_encodings`."""

    __slots__ = ("bits", "symmetric", "columns")

    def __init__(self, bits: int, symmetric: str, columns: dict[str, np.ndarray]):
        self.bits, self.symmetric, self.columns = bits, symmetric, columns
        lists = {k: v.tolist() for k, v in columns.items()}
        super().__init__(
            {
                "bitwidth": bits,
                "dtype": "int",
                "is_symmetric": symmetric,
                "min": mn,
                "max": mx,
                "offset": o,
                "scale": sc,
            }
            for mn, mx, o, sc in zip(
                lists["min"], lists["max"], lists["offset"], lists["scale"], strict=True
            )
        )


def _floats(a: np.ndarray) -> list[float]:
    return _FloatList(a)


def _ints(a: np.ndarray) -> list[int]:
    return a.reshape(-1).tolist()


def _lpbq_axes(q: _Quantizer) -> tuple[int, int]:
    """(channel axis, block axis) of an LPBQ quantizer's block scales."""
    return lpbq_axes(q.scale.shape, int(q.spec.axis or 0), q.spec.channel_axis)


def _channel_major(q: _Quantizer) -> np.ndarray:
    """An LPBQ quantizer's integer block scales as (channels, blocks): the order 1.0.0 lists
    them in whatever the weight's layout (AIMET writes a MatMul weight's transposed)."""
    channel, block = _lpbq_axes(q)
    ints = np.moveaxis(q.block_int_scale, (channel, block), (0, 1))
    return ints.reshape(ints.shape[0], -1)


def _entry_1_0_0_lpbq(q: _Quantizer) -> dict[str, Any]:
    """AIMET's 1.0.0 LPBQ entry: ``bw`` the decompressed bit-width, ``compressed_bw`` the
    weight's, ``scale`` one float per channel, ``per_block_int_scale`` channel-major,
    ``offset`` the decompressed signed grid's."""
    bw = q.spec.bits + int(q.spec.block_scale_bits or 0)
    return {
        "name": q.name,
        "dtype": "INT",
        "enc_type": "LPBQ",
        "bw": bw,
        "compressed_bw": q.spec.bits,
        "is_sym": True,
        "scale": _floats(q.channel_scale),
        "per_block_int_scale": _ints(_channel_major(q)),
        "offset": [-(2 ** (bw - 1))] * int(q.channel_scale.size),
        "block_size": q.spec.block_size,
    }


def _entry_2_0_0_lpbq(q: _Quantizer) -> dict[str, Any]:
    """AIMET's 2.0.0 LPBQ entry: both scales in the weight's layout (the float one with the
    block axis of length 1), ``axis`` the block axis. 2.0.0 has no field for the decompressed
    bit-width: it is twice the weight's (AIMET refuses anything else)."""
    if q.spec.block_scale_bits != q.spec.bits:
        raise ExportError(
            f"tensor '{q.name}': encodings 2.0.0 can only express LPBQ with block scales as wide "
            f"as the weight ({q.spec.bits} bits, decompressed to {2 * q.spec.bits}); this one "
            f"has {q.spec.block_scale_bits}-bit block scales: use 1.0.0"
        )
    dtype, _ = _container(q.spec)
    _, block = _lpbq_axes(q)
    shape = list(q.scale.shape)
    shape[block] = 1
    return {
        "name": q.name,
        "output_dtype": dtype,
        "per_channel_float_scale": q.channel_scale.astype(np.float64).reshape(shape).tolist(),
        "per_block_int_scale": q.block_int_scale.tolist(),
        "axis": block,
        "block_size": q.spec.block_size,
    }


def _entry_1_0_0(q: _Quantizer) -> dict[str, Any]:
    if q.channel_scale is not None:
        return _entry_1_0_0_lpbq(q)
    entry: dict[str, Any] = {
        "name": q.name,
        "dtype": "INT",
        "enc_type": q.spec.granularity,
        "bw": q.spec.bits,
        "is_sym": q.is_sym,
        "scale": _floats(q.scale),
        "offset": _ints(q.offset),
    }
    if q.spec.block_size is not None:
        entry["block_size"] = q.spec.block_size
    return entry


def _entry_0_6_1(q: _Quantizer) -> list[dict[str, Any]]:
    if q.channel_scale is not None:
        raise ExportError(
            f"tensor '{q.name}': encodings version 0.6.1 cannot express LPBQ; use 1.0.0 or 2.0.0"
        )
    if q.spec.block_size is not None:
        raise ExportError(
            f"tensor '{q.name}': encodings version 0.6.1 cannot express blocked quantization; "
            "use 1.0.0 or 2.0.0"
        )
    span = 2**q.spec.bits - 1
    scale = q.scale.astype(np.float64).reshape(-1)
    offset = q.offset.astype(np.int64).reshape(-1)
    # float64 products of the exact float64 operands, as Python's s * o computes them
    columns = {
        "min": scale * offset.astype(np.float64),
        "max": scale * (offset + span).astype(np.float64),
        "offset": offset,
        "scale": scale,
    }
    return _ChannelList(q.spec.bits, str(q.is_sym), columns)


def _entry_2_0_0(q: _Quantizer) -> dict[str, Any]:
    if q.channel_scale is not None:
        return _entry_2_0_0_lpbq(q)
    dtype, bits = _container(q.spec)
    lo, hi = full_grid(bits, q.spec.signed)
    if np.any(q.zero_point < lo) or np.any(q.zero_point > hi):
        raise ExportError(f"tensor '{q.name}': zero points do not fit in {dtype}")
    entry: dict[str, Any] = {"name": q.name, "output_dtype": dtype}
    per_tensor = q.spec.axis is None
    if per_tensor:
        entry["y_scale"] = float(q.scale.reshape(-1)[0])
    else:  # blocked keeps the weight's rank
        entry["y_scale"] = _floats(q.scale) if q.scale.ndim == 1 else q.scale.tolist()
    if np.any(q.zero_point != 0):
        zp = q.zero_point
        entry["y_zero_point"] = int(zp.reshape(-1)[0]) if per_tensor else zp.tolist()
    if not per_tensor:
        entry["axis"] = q.spec.axis
    if q.spec.block_size is not None:
        entry["block_size"] = q.spec.block_size
    return entry


def _container(spec: QuantSpec) -> tuple[str, int]:
    """The smallest ONNX integer type holding ``[qmin, qmax]`` with the spec's signedness."""
    for bits in _CONTAINER_BITS:
        lo, hi = full_grid(bits, spec.signed)
        if lo <= spec.qmin and spec.qmax <= hi:
            return f"{'int' if spec.signed else 'uint'}{bits}", bits
    raise ExportError(
        f"quantizer {spec.qid}: grid [{spec.qmin}, {spec.qmax}] fits no 4/8/16/32-bit container"
    )


Rows = Sequence[tuple[_Quantizer, Any]]


def _doc_1_0_0(rows: Rows, quantizer_args: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {"version": "1.0.0", "producer": _producer()}
    for section, _ in SECTIONS:
        doc[section] = [entry for q, entry in rows if q.section == section]
    doc["excluded_layers"] = []
    doc["quantizer_args"] = quantizer_args
    return doc


def _doc_0_6_1(rows: Rows, quantizer_args: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {"version": "0.6.1", "producer": _producer()}
    for section, _ in SECTIONS:
        doc[section] = {q.name: entry for q, entry in rows if q.section == section}
    doc["excluded_layers"] = []
    doc["quantizer_args"] = quantizer_args
    return doc


def _doc_2_0_0(rows: Rows, quantizer_args: dict[str, Any]) -> dict[str, Any]:
    """2.0.0 as aimet-onnx writes it: no ``quantizer_args``, no ``excluded_layers``."""
    return {"version": "2.0.0", "producer": _producer(), "encodings": [e for _, e in rows]}


_ENTRY_WRITERS: dict[str, Callable[[_Quantizer], Any]] = {
    "1.0.0": _entry_1_0_0,
    "0.6.1": _entry_0_6_1,
    "2.0.0": _entry_2_0_0,
}
_DOC_WRITERS: dict[str, Callable[[Rows, dict[str, Any]], dict[str, Any]]] = {
    "1.0.0": _doc_1_0_0,
    "0.6.1": _doc_0_6_1,
    "2.0.0": _doc_2_0_0,
}


def dumps_encodings(doc: Mapping[str, Any]) -> str:
    """The encodings document as text: one entry per line, so the file stays readable and
    diffable while large models are written by the C JSON encoder (``indent`` would switch
    to the slow pure-Python one). The lists of scales (and 0.6.1's per-channel entries) that
    :func:`build_encodings` made are written from their arrays (:func:`_float_text`), and the
    text of each is remembered by its values for the next document."""
    compact = json.JSONEncoder(separators=(", ", ": ")).encode
    used: dict[tuple, str] = {}

    def render(value: Any) -> str:
        if isinstance(value, _FloatList):
            return _remembered(("floats", value.array), lambda: _float_text(value), used)
        if type(value) is dict and any(isinstance(v, _FloatList) for v in value.values()):
            return "{" + ", ".join(f"{compact(k)}: {render(v)}" for k, v in value.items()) + "}"
        return compact(value)

    def block(value: Any, depth: int) -> str:
        pad, inner = "  " * depth, "  " * (depth + 1)
        if (
            isinstance(value, dict)
            and depth == 0
            or (
                isinstance(value, dict)
                and value
                and all(isinstance(v, list) for v in value.values())
            )
        ):
            items = [f"{inner}{compact(k)}: {block(v, depth + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}" if items else "{}"
        if isinstance(value, _ChannelList) and value:
            key = ("channels", depth, value.bits, value.symmetric, *value.columns.values())
            lines = _remembered(key, lambda: _channel_lines(value, inner, compact), used)
            return "[\n" + lines + f"\n{pad}]"
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            return "[\n" + ",\n".join(inner + render(v) for v in value) + f"\n{pad}]"
        return render(value)

    text = block(dict(doc), 0) + "\n"
    _TEXTS.keep(used)
    return text


def _float_text(values: _FloatList) -> str:
    """``json.dumps(values)``, bytes for bytes: finite floats are written with
    ``float.__repr__`` (what the JSON encoder calls) over the list in C, not element by
    element in Python."""
    if not np.isfinite(values.array).all():
        return json.dumps(list(values))  # Infinity / NaN as json spells them
    return "[" + ", ".join(map(float.__repr__, values)) + "]"


def _channel_lines(value: _ChannelList, inner: str, compact: Callable[[Any], str]) -> str:
    """0.6.1's per-channel entries, one line each, as ``compact`` writes each dict."""
    c = value.columns
    if not all(np.isfinite(c[k]).all() for k in ("min", "max", "scale")):
        return ",\n".join(inner + compact(v) for v in value)
    head = (
        f'{inner}{{"bitwidth": {value.bits}, "dtype": "int", '
        f'"is_symmetric": {compact(value.symmetric)}, "min": '
    )
    mins, maxs = map(float.__repr__, c["min"].tolist()), map(float.__repr__, c["max"].tolist())
    scales = map(float.__repr__, c["scale"].tolist())
    return ",\n".join(
        f'{head}{mn}, "max": {mx}, "offset": {o}, "scale": {sc}}}'
        for mn, mx, o, sc in zip(mins, maxs, c["offset"].tolist(), scales, strict=True)
    )


def _remembered(key: tuple, make: Callable[[], str], used: dict[tuple, str]) -> str:
    """The text of ``key`` (arrays by their bytes), from the last document if it was there."""
    digest = digest_json(
        [
            [str(k.dtype), digest_bytes(memoryview(np.ascontiguousarray(k)).cast("B"))]
            if isinstance(k, np.ndarray)
            else k
            for k in key
        ]
    )
    text = used.get(digest) or _TEXTS.get(digest)
    if text is None:
        text = make()
    used[digest] = text
    return text


class _TextMemo:
    """The texts of the last :func:`dumps_encodings` call, by the digest of their values: a
    re-export whose weight scales did not change formats none of them again. Keeps one
    document's worth (the next call keeps what it used)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._texts: dict[str, str] = {}

    def get(self, digest: str) -> str | None:
        with self._lock:
            return self._texts.get(digest)

    def keep(self, texts: dict[str, str]) -> None:
        with self._lock:
            self._texts = dict(texts)


_TEXTS = _TextMemo()
