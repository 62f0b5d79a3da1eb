"""Read QNN encodings (1.0.0, 0.6.1, 2.0.0) back into ``x = scale * (q - zero_point)`` form.

What the formats cannot say, and the conventions used to read them back:

- 1.0.0 and 0.6.1 store no container: symmetric entries are read as signed, asymmetric as
  unsigned (same values, the zero point moves by ``2^(bw-1)``). No format stores a grid narrower
  than its container (int8 in ``[-127, 127]``): the full grid is read back.
- 1.0.0 and 0.6.1 store no axis: per-channel is the output channel of the consuming op, blocked
  is along its input channel; :mod:`~graphbuild.targets.qnn.encodings.reinsert` resolves both
  from the ONNX graph.
- 2.0.0 has one list for params and activations, so ``is_param`` reads back as ``None``.
- LPBQ (``enc_type: LPBQ`` in 1.0.0, ``per_block_int_scale`` in 2.0.0) reads back as a blocked
  encoding on the weight's grid (``bits`` is 1.0.0's ``compressed_bw``) whose ``scale`` is the
  effective block scale ``per_block_int_scale * per-channel float scale``; the two parts are
  kept. 1.0.0 lists the block scales channel-major: ``scale`` is then ``(channels, blocks)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphbuild.errors import ExportError
from graphbuild.targets.qnn.encodings.grid import SECTIONS, check_version, full_grid

__all__ = ["TensorEncoding", "read_encodings"]


@dataclass(frozen=True, eq=False)
class TensorEncoding:
    """One tensor's encoding as read from a document, in ``x = scale * (q - zero_point)`` form.

    ``scale`` (float32) and ``zero_point`` (int64, the container's own convention) have one
    element per-tensor, one per channel, and for blocked the block grid (2.0.0) or its flat
    C-order form (1.0.0). ``axis_implied`` says the format did not store ``axis`` (1.0.0 / 0.6.1):
    it then holds the usual convention (0 per-channel, 1 blocked) and the consuming op decides.
    ``is_param`` is ``None`` when the format does not separate params (2.0.0).
    """

    name: str
    scale: np.ndarray
    zero_point: np.ndarray
    qmin: int
    qmax: int
    bits: int
    signed: bool
    is_param: bool | None
    axis: int | None = None
    block_size: int | None = None
    axis_implied: bool = False
    block_scale_bits: int | None = None
    channel_scale: np.ndarray | None = None
    block_int_scale: np.ndarray | None = None

    @property
    def granularity(self) -> str:
        if self.block_scale_bits is not None:
            return "LPBQ"
        if self.block_size is not None:
            return "PER_BLOCK"
        return "PER_TENSOR" if self.axis is None else "PER_CHANNEL"


def read_encodings(doc: Mapping[str, Any]) -> dict[str, TensorEncoding]:
    """Every tensor's encoding in ``doc`` (1.0.0, 0.6.1 or 2.0.0), by tensor name."""
    version = _doc_version(doc)
    try:
        encodings = list(_READERS[version](doc))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ExportError(f"malformed {version} encodings: {type(exc).__name__}: {exc}") from exc
    out: dict[str, TensorEncoding] = {}
    for enc in encodings:
        if out.setdefault(enc.name, enc) is not enc:
            raise ExportError(f"tensor '{enc.name}' is encoded more than once")
    return out


def _doc_version(doc: Mapping[str, Any]) -> str:
    """The document's version; a legacy file without one is 0.6.1 if its sections are objects."""
    version = doc.get("version")
    if version is None and any(isinstance(doc.get(s), dict) for s, _ in SECTIONS):
        return "0.6.1"
    check_version(str(version))
    return str(version)


def _read_doc_1_0_0(doc: Mapping[str, Any]) -> Iterable[TensorEncoding]:
    for section, is_param in SECTIONS:
        for entry in doc.get(section, []):
            yield _read_1_0_0(entry, is_param)


def _read_doc_0_6_1(doc: Mapping[str, Any]) -> Iterable[TensorEncoding]:
    for section, is_param in SECTIONS:
        for name, channels in doc.get(section, {}).items():
            yield _read_0_6_1(name, channels, is_param)


def _read_doc_2_0_0(doc: Mapping[str, Any]) -> Iterable[TensorEncoding]:
    return (_read_2_0_0(entry) for entry in doc["encodings"])


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def _zero_point_from_offset(offset: np.ndarray, bits: int, signed: bool) -> np.ndarray:
    return -offset - (2 ** (bits - 1) if signed else 0)


# The axis 1.0.0 leaves unsaid: output channel per-channel, input channel blocked.
_IMPLIED_AXIS = {"PER_TENSOR": None, "PER_CHANNEL": 0, "PER_BLOCK": 1}


def _read_1_0_0(entry: Mapping[str, Any], is_param: bool) -> TensorEncoding:
    name = entry["name"]
    if entry.get("dtype", "INT") != "INT":
        raise ExportError(f"tensor '{name}': {entry['dtype']} encodings are not integer grids")
    if entry.get("enc_type") == "LPBQ":
        return _read_lpbq_1_0_0(entry, is_param)
    bits, signed = int(entry["bw"]), _truthy(entry["is_sym"])
    scale = np.asarray(entry["scale"], dtype=np.float32).reshape(-1)
    offset = np.asarray(entry["offset"], dtype=np.int64).reshape(-1)
    enc_type = entry.get("enc_type", "PER_TENSOR" if scale.size == 1 else "PER_CHANNEL")
    if enc_type not in _IMPLIED_AXIS:
        raise ExportError(f"tensor '{name}': unsupported enc_type '{enc_type}'")
    axis, blocked = _IMPLIED_AXIS[enc_type], enc_type == "PER_BLOCK"
    return TensorEncoding(
        name,
        scale,
        _zero_point_from_offset(offset, bits, signed),
        *full_grid(bits, signed),
        bits=bits,
        signed=signed,
        is_param=is_param,
        axis=axis,
        block_size=int(entry["block_size"]) if blocked else None,
        axis_implied=axis is not None,
    )


def _lpbq_parts(
    name: str, compressed: int, decompressed: int, channel: np.ndarray, ints: np.ndarray
) -> tuple[int, np.ndarray]:
    """Block scales' bit-width and the effective scales ``ints * channel`` (float32)."""
    k = decompressed - compressed
    if not 1 <= compressed < decompressed or not 1 <= k <= 8:
        raise ExportError(
            f"tensor '{name}': LPBQ with compressed_bw {compressed} and bw {decompressed}"
        )
    if ints.size and (ints.min() < 1 or ints.max() > 2**k):
        raise ExportError(f"tensor '{name}': LPBQ block scales outside [1, {2**k}]")
    if not np.all(np.isfinite(channel)) or np.any(channel <= 0):
        raise ExportError(f"tensor '{name}': LPBQ channel scales must be finite and positive")
    return k, (ints.astype(np.float32) * channel.astype(np.float32)).astype(np.float32)


def _read_lpbq_1_0_0(entry: Mapping[str, Any], is_param: bool) -> TensorEncoding:
    """1.0.0 LPBQ: ``scale`` per channel, ``per_block_int_scale`` channel-major."""
    name = entry["name"]
    bits = int(entry["compressed_bw"])
    channel = np.asarray(entry["scale"], dtype=np.float32).reshape(-1)
    flat = np.asarray(entry["per_block_int_scale"], dtype=np.int64).reshape(-1)
    if channel.size == 0 or flat.size % channel.size:
        raise ExportError(
            f"tensor '{name}': {flat.size} LPBQ block scales for {channel.size} channels"
        )
    ints = flat.reshape(channel.size, -1)
    k, scale = _lpbq_parts(name, bits, int(entry["bw"]), channel.reshape(-1, 1), ints)
    return _lpbq_encoding(
        entry, scale, bits, True, k, channel, ints, is_param=is_param, axis=1, axis_implied=True
    )


def _read_lpbq_2_0_0(entry: Mapping[str, Any]) -> TensorEncoding:
    """2.0.0 LPBQ: both scales in the weight's layout, ``axis`` the block axis; the
    decompressed grid is twice the weight's (2.0.0 does not say it)."""
    name = entry["name"]
    bits, signed = _parse_dtype(entry["output_dtype"])
    ints = np.asarray(entry["per_block_int_scale"], dtype=np.int64)
    channel = np.asarray(entry["per_channel_float_scale"], dtype=np.float32)
    axis = int(entry["axis"])
    if ints.ndim == 0 or not -ints.ndim <= axis < ints.ndim:
        raise ExportError(f"tensor '{name}': LPBQ block axis {axis} on scales {ints.shape}")
    axis %= ints.ndim
    if channel.ndim != ints.ndim:  # one float per channel, without the block axis
        shape = list(ints.shape)
        shape[axis] = 1
        channel = channel.reshape(shape)
    k, scale = _lpbq_parts(name, bits, 2 * bits, channel, ints)
    return _lpbq_encoding(entry, scale, bits, signed, k, channel, ints, is_param=None, axis=axis)


def _lpbq_encoding(
    entry: Mapping[str, Any],
    scale: np.ndarray,
    bits: int,
    signed: bool,
    block_scale_bits: int,
    channel: np.ndarray,
    ints: np.ndarray,
    *,
    is_param: bool | None,
    axis: int,
    axis_implied: bool = False,
) -> TensorEncoding:
    """An LPBQ weight's encoding, either version's: symmetric on the full grid (zero points
    0), the decompressed per-block ``scale`` beside the parts it was made of."""
    return TensorEncoding(
        entry["name"],
        scale,
        np.zeros(scale.shape, dtype=np.int64),
        *full_grid(bits, signed),
        bits=bits,
        signed=signed,
        is_param=is_param,
        axis=axis,
        block_size=int(entry["block_size"]),
        axis_implied=axis_implied,
        block_scale_bits=block_scale_bits,
        channel_scale=channel.reshape(-1),
        block_int_scale=ints,
    )


def _read_0_6_1(name: str, channels: Sequence[Mapping[str, Any]], is_param: bool) -> TensorEncoding:
    bits, signed = int(channels[0]["bitwidth"]), _truthy(channels[0]["is_symmetric"])
    pairs = [_scale_offset_0_6_1(c, bits) for c in channels]
    offset = np.asarray([o for _, o in pairs], dtype=np.int64)
    return TensorEncoding(
        name,
        np.asarray([s for s, _ in pairs], dtype=np.float32),
        _zero_point_from_offset(offset, bits, signed),
        *full_grid(bits, signed),
        bits=bits,
        signed=signed,
        is_param=is_param,
        axis=0 if len(channels) > 1 else None,
        axis_implied=len(channels) > 1,
    )


def _scale_offset_0_6_1(channel: Mapping[str, Any], bits: int) -> tuple[float, int]:
    """A channel's scale and offset, from ``scale``/``offset`` or else from ``min``/``max``."""
    if "scale" in channel and "offset" in channel:
        return float(channel["scale"]), int(channel["offset"])
    lo, hi = float(channel["min"]), float(channel["max"])
    scale = (hi - lo) / (2**bits - 1)
    return scale, round(lo / scale)


def _parse_dtype(dtype: str) -> tuple[int, bool]:
    match = re.fullmatch(r"(u?)int(\d+)", dtype)
    if match is None:
        raise ExportError(f"output_dtype '{dtype}' is not an integer type")
    return int(match.group(2)), match.group(1) == ""


def _read_2_0_0(entry: Mapping[str, Any]) -> TensorEncoding:
    if "per_block_int_scale" in entry:
        return _read_lpbq_2_0_0(entry)
    bits, signed = _parse_dtype(entry["output_dtype"])
    scale = np.asarray(entry["y_scale"], dtype=np.float32)
    scale = scale.reshape(1) if scale.ndim == 0 else scale
    zp = np.asarray(entry.get("y_zero_point", 0), dtype=np.int64)
    block_size = entry.get("block_size")
    return TensorEncoding(
        entry["name"],
        scale,
        np.broadcast_to(zp, scale.shape).astype(np.int64),
        *full_grid(bits, signed),
        bits=bits,
        signed=signed,
        is_param=None,
        axis=entry.get("axis"),
        block_size=None if block_size is None else int(block_size),
    )


_READERS: dict[str, Callable[[Mapping[str, Any]], Iterable[TensorEncoding]]] = {
    "1.0.0": _read_doc_1_0_0,
    "0.6.1": _read_doc_0_6_1,
    "2.0.0": _read_doc_2_0_0,
}
