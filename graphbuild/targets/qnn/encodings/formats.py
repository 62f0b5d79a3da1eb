"""Each encodings version's entries and document (1.0.0, 0.6.1, 2.0.0, LPBQ in 1.0.0 and 2.0.0),
written from one quantizer resolved to numbers (:class:`_Quantizer`): what
:func:`~.write.build_encodings` assembles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphbuild.errors import ExportError
from graphbuild.quant.lpbq import lpbq_axes
from graphbuild.quant.quantmap import QuantSpec
from graphbuild.targets.qnn.encodings.grid import (
    SECTIONS,
    full_grid,
)
from graphbuild.targets.qnn.encodings.text import _ChannelList, _FloatList
from graphbuild.version import __version__

_CONTAINER_BITS = (4, 8, 16, 32)


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


def _producer() -> dict[str, str]:
    return {"package": "graphbuild", "version": __version__}


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
