"""GGML's tensor types and the block layouts of the quantized ones (Q8_0, Q4_0).

A quantized tensor is a sequence of blocks of 32 consecutive values of a row (GGUF's
``ne[0]``, torch's last dimension). Each block holds a float16 scale ``d`` and 32 codes:

- ``Q8_0`` (34 bytes): ``d``, then 32 int8 codes; ``x = d * q``.
- ``Q4_0`` (18 bytes): ``d``, then 16 bytes; byte ``j`` holds value ``j`` in its low nibble
  and value ``j + 16`` in its high nibble, each stored as ``q + 8``; ``x = d * q``, ``q`` in
  ``[-8, 7]``.

(ggml's ``block_q8_0`` and ``block_q4_0``, ``ggml/src/ggml-common.h``.) Codes and scales are
computed elsewhere: from the model's own quantizers (:mod:`.weights`) or, for the presets, by
:func:`quantize_q8_0` and :func:`quantize_q4_0`, which repeat llama.cpp's reference quantizers
(``quantize_row_q8_0_ref``, ``quantize_row_q4_0_ref`` in ``ggml-quants.c``) step for step in
float32, so the blocks are the bytes llama.cpp's own converter writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphbuild.errors import ExportError

QK = 32
"""Values per block of Q8_0 and Q4_0."""


@dataclass(frozen=True)
class GgmlType:
    """One GGML tensor type: its id in the file, values per block and bytes per block, and
    the signed code range of a quantized type (``None`` for a float type)."""

    name: str
    id: int
    block_size: int
    type_size: int
    codes: tuple[int, int] | None = None

    @property
    def quantized(self) -> bool:
        return self.codes is not None

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a tensor of torch ``shape`` (rows of ``shape[-1]`` values)."""
        n = int(np.prod(shape, dtype=np.int64))
        return n // self.block_size * self.type_size


F32 = GgmlType("F32", 0, 1, 4)
F16 = GgmlType("F16", 1, 1, 2)
Q4_0 = GgmlType("Q4_0", 2, QK, 2 + QK // 2, (-8, 7))
Q8_0 = GgmlType("Q8_0", 8, QK, 2 + QK, (-128, 127))

GGML_TYPES = {t.name: t for t in (F32, F16, Q4_0, Q8_0)}

#: ``general.file_type`` (llama.cpp's ``llama_ftype``) of a file whose quantized tensors are
#: mostly of this type.
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7}


def check_blockable(name: str, shape: tuple[int, ...], ggml: GgmlType) -> None:
    """An ExportError naming the tensor when its rows do not split into whole blocks."""
    if ggml.quantized and (len(shape) < 2 or shape[-1] % ggml.block_size):
        raise ExportError(
            f"tensor '{name}' of shape {list(shape)} cannot be stored as {ggml.name}: its rows "
            f"({shape[-1] if shape else 0} values) are not a multiple of {ggml.block_size}; keep "
            "it float (float_type) or quantize it with another block size"
        )


# --------------------------------------------------------------------------- presets


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``quantize_row_q8_0_ref`` on the rows of ``x`` (float32, last dimension a
    multiple of 32): ``(codes int8 [..., n/32, 32], d float16 [..., n/32])``.

    ``d = amax / 127`` in float32, codes ``roundf(x * (1 / d))`` (half away from zero) from
    the float32 ``d``; the float16 ``d`` is what the file stores."""
    return _quantize(x, _q8_0_chunk)


def quantize_q4_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``quantize_row_q4_0_ref`` on the rows of ``x``: ``(codes int8 in [-8, 7],
    d float16)``.

    ``d = max / -8`` where ``max`` is the first value of largest magnitude (so ``d`` carries
    its sign and that value is stored as -8), codes ``min(15, trunc(x * (1 / d) + 8.5)) - 8``
    in float32."""
    return _quantize(x, _q4_0_chunk)


_CHUNK = 8192
"""Blocks per pass of the quantizers (256K values): each chunk's temporaries stay in cache."""


def _quantize(x: np.ndarray, chunk_fn) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=np.float32)
    flat = np.ascontiguousarray(x).reshape(-1, QK)
    n = flat.shape[0]
    codes = np.empty((n, QK), dtype=np.int8)
    d = np.empty(n, dtype=np.float16)
    work = np.empty((3, min(_CHUNK, n), QK), dtype=np.float32)
    for start in range(0, n, _CHUNK):
        block = flat[start : start + _CHUNK]
        k = block.shape[0]
        codes[start : start + k], d[start : start + k] = chunk_fn(block, *work[:, :k])
    shape = (*x.shape[:-1], x.shape[-1] // QK)
    return codes.reshape(*shape, QK), d.reshape(shape)


def _q8_0_chunk(block, t, a, w):
    np.abs(block, out=a)
    d = a.max(axis=1, keepdims=True) / np.float32(127)
    np.multiply(block, _inverse(d), out=t)
    return _roundf(t, a, w), d[:, 0]


def _q4_0_chunk(block, t, a, w):
    np.abs(block, out=a)
    first = a.argmax(axis=1)[:, None]  # the first of equal magnitudes, as ggml's loop keeps
    d = np.take_along_axis(block, first, axis=1) / np.float32(-8)
    np.multiply(block, _inverse(d), out=t)
    t += np.float32(8.5)
    np.trunc(t, out=t)
    np.minimum(t, np.float32(15), out=t)
    t -= np.float32(8)
    return t, d[:, 0]


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _roundf(t: np.ndarray, a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """C's ``roundf`` of ``t`` into ``w`` (``a`` is scratch): halves away from zero, exactly
    (``floor(|x| + 0.5)`` would round 0.49999997 up in float32)."""
    np.abs(t, out=a)
    np.floor(a, out=w)
    a -= w
    a *= np.float32(2)
    np.floor(a, out=a)
    w += a
    return np.copysign(w, t, out=w)


# --------------------------------------------------------------------------- packing


def pack(ggml: GgmlType, codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Blocks of ``ggml`` from signed ``codes`` ``[..., blocks, 32]`` (within the type's code
    range) and float16 scales ``[..., blocks]``: a flat uint8 array, block after block."""
    lo, hi = ggml.codes or (0, 0)
    codes = np.asarray(codes)
    if codes.size and (int(codes.min()) < lo or int(codes.max()) > hi):
        raise ExportError(f"{ggml.name} codes outside [{lo}, {hi}]")
    scale = np.ascontiguousarray(d, dtype=np.float16).reshape(-1, 1).view(np.uint8)
    flat = codes.reshape(-1, QK)
    if ggml is Q8_0:
        body = flat.astype(np.int8).view(np.uint8)
    elif ggml is Q4_0:
        nibbles = (flat.astype(np.int16) + 8).astype(np.uint8)
        body = nibbles[:, : QK // 2] | (nibbles[:, QK // 2 :] << np.uint8(4))
    else:
        raise ExportError(f"no block packing for {ggml.name}")
    return np.concatenate([scale, body], axis=1).reshape(-1)


def unpack(ggml: GgmlType, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values (torch ``shape``) that llama.cpp dequantizes ``data`` to."""
    if not ggml.quantized:
        dtype = np.float32 if ggml is F32 else np.float16
        return np.frombuffer(data, dtype=dtype).astype(np.float32).reshape(shape)
    blocks = np.frombuffer(data, dtype=np.uint8).reshape(-1, ggml.type_size)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if ggml is Q8_0:
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
    else:
        body = blocks[:, 2:]
        q = np.concatenate([body & 0x0F, body >> 4], axis=1).astype(np.float32) - 8
    return (d * q).reshape(shape)


def dequantize(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``d * q`` in float32 as llama.cpp computes it, rows back in their shape."""
    values = d.astype(np.float32)[..., None] * codes.astype(np.float32)
    return values.reshape(*values.shape[:-2], -1)


def float_bytes(ggml: GgmlType, x: np.ndarray) -> np.ndarray:
    """A float tensor as ``ggml`` (F32 or F16) stores it: a flat uint8 array."""
    dtype = np.float32 if ggml is F32 else np.float16
    return np.ascontiguousarray(x, dtype=dtype).reshape(-1).view(np.uint8)
