"""The GGUF container: header, key-value metadata, tensor infos, then the aligned tensor data.

Version 3, little-endian (ggml's ``gguf.cpp``, the ``gguf`` package's ``GGUFWriter``)::

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv x      (string key, u32 value type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset)
    zero padding to ``general.alignment``
    tensor data, each tensor starting at its offset (a multiple of the alignment)

A string is a u64 byte count and UTF-8 bytes; an array a u32 element type, a u64 count and
the elements. ``ne[0]`` is the innermost dimension (torch's last). Offsets count from the
start of the data section, so a tensor's bytes and its padding do not depend on the
metadata before them: a file whose metadata changed keeps every tensor's bytes, at a new
place, and :class:`GgufFile` lets the placement copy them from the previous file.

Metadata entries are ``(key, type, value)`` triples with the value types' names below, so
that stages can pass them on as JSON and the bytes depend on nothing but the entries.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphbuild.errors import ExportError

MAGIC = b"GGUF"
VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_NAME_BYTES = 63
"""ggml's GGML_MAX_NAME (64) less the terminating zero."""

#: GGUF value types: id and struct format (``None``: string or array).
VALUE_TYPES: dict[str, tuple[int, str | None]] = {
    "uint8": (0, "<B"),
    "int8": (1, "<b"),
    "uint16": (2, "<H"),
    "int16": (3, "<h"),
    "uint32": (4, "<I"),
    "int32": (5, "<i"),
    "float32": (6, "<f"),
    "bool": (7, "<?"),
    "string": (8, None),
    "array": (9, None),
    "uint64": (10, "<Q"),
    "int64": (11, "<q"),
    "float64": (12, "<d"),
}

#: One metadata entry: key, value type (``"array[string]"`` for an array), value.
Entry = tuple[str, str, Any]


def string(text: str | bytes) -> bytes:
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return struct.pack("<Q", len(data)) + data


def _value(kind: str, value: Any, key: str) -> bytes:
    if kind.startswith("array[") and kind.endswith("]"):
        inner = kind[6:-1]
        if inner not in VALUE_TYPES or inner == "array":
            raise ExportError(f"GGUF metadata '{key}': unknown array element type '{inner}'")
        head = struct.pack("<IQ", VALUE_TYPES[inner][0], len(value))
        if inner == "string":
            return head + b"".join(string(v) for v in value)
        fmt = VALUE_TYPES[inner][1]
        return head + np.asarray(value, dtype=np.dtype(fmt)).tobytes()
    if kind not in VALUE_TYPES or kind == "array":
        raise ExportError(f"GGUF metadata '{key}': unknown value type '{kind}'")
    if kind == "string":
        return string(value)
    fmt = VALUE_TYPES[kind][1]
    try:
        return struct.pack(fmt, value)
    except struct.error as err:
        raise ExportError(
            f"GGUF metadata '{key}': {value!r} is not a valid {kind}: {err}"
        ) from None


def entry_bytes(entry: Entry) -> bytes:
    """One key-value pair as the file holds it."""
    key, kind, value = entry
    base = "array" if kind.startswith("array[") else kind
    if base not in VALUE_TYPES:
        raise ExportError(f"GGUF metadata '{key}': unknown value type '{kind}'")
    return string(key) + struct.pack("<I", VALUE_TYPES[base][0]) + _value(kind, value, key)


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as the header describes it: name, torch shape, GGML type id, byte count."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    nbytes: int


def pad(n: int, alignment: int) -> int:
    return -n % alignment


def header(
    entries: Sequence[Entry], tensors: Sequence[TensorInfo], alignment: int
) -> tuple[bytes, list[int]]:
    """The bytes before the data section (padding included) and each tensor's offset in it.

    ``general.alignment`` must be among ``entries`` when ``alignment`` is not GGUF's default
    (32); keys must be unique, as must tensor names."""
    keys = [e[0] for e in entries]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ExportError(f"GGUF metadata keys given twice: {', '.join(repeated)}")
    names = [t.name for t in tensors]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ExportError(f"GGUF tensor names given twice: {', '.join(twice)}")
    long = [n for n in names if len(n.encode()) > MAX_NAME_BYTES]
    if long:
        raise ExportError(
            f"GGUF tensor name '{long[0]}' is longer than llama.cpp's {MAX_NAME_BYTES} bytes"
        )
    declared = {e[0]: e[2] for e in entries}.get("general.alignment", DEFAULT_ALIGNMENT)
    if declared != alignment or alignment <= 0 or alignment & (alignment - 1):
        raise ExportError(
            f"GGUF alignment {alignment} must be a power of two and match general.alignment"
        )
    out = bytearray(MAGIC + struct.pack("<IQQ", VERSION, len(tensors), len(entries)))
    for entry in entries:
        out += entry_bytes(entry)
    offsets, offset = [], 0
    for t in tensors:
        out += string(t.name) + struct.pack("<I", len(t.shape))
        out += struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape))  # ne[0] innermost
        out += struct.pack("<IQ", t.ggml_type, offset)
        offsets.append(offset)
        offset += t.nbytes + pad(t.nbytes, alignment)
    out += bytes(pad(len(out), alignment))
    return bytes(out), offsets
