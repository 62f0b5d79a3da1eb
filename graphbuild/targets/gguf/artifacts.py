"""Stage outputs of the GGUF target and their codecs: the packed tensors and the file.

Both store each tensor's bytes as one blob under the digest computed when it was packed, so
the two outputs share their blobs, a weights-only change stores only the tensors that changed,
and nothing is hashed twice. :class:`GgufFile` is a
:class:`~graphbuild.onnx.save.SegmentedFile`: the placement copies every tensor whose digest
the file it replaces holds at a recorded range, and writes the rest.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphbuild.engine.codecs import Codec, Encoded, Part, array_token, register_codec
from graphbuild.onnx.save import Payload
from graphbuild.targets.gguf.blocks import GGML_TYPES, GgmlType
from graphbuild.targets.gguf.container import pad


@dataclass(frozen=True)
class PackedTensor:
    """One tensor as the file stores it: GGUF name, GGML type, torch shape (rows last), its
    bytes (flat uint8) and their xxh3-128."""

    name: str
    ggml: str
    shape: tuple[int, ...]
    data: np.ndarray
    digest: str

    @property
    def type(self) -> GgmlType:
        return GGML_TYPES[self.ggml]


@dataclass(frozen=True)
class PackedTensors:
    """Every tensor of the file, in file order."""

    tensors: tuple[PackedTensor, ...]

    def by_name(self) -> dict[str, PackedTensor]:
        return {t.name: t for t in self.tensors}


@dataclass(frozen=True)
class GgufFile:
    """A ``.gguf`` file: its header (up to the data section, padding included) and its
    tensors, each padded to ``alignment``."""

    name: str
    head: bytes
    tensors: tuple[PackedTensor, ...]
    alignment: int

    def segments(self) -> Iterator[bytes | memoryview | Payload]:
        yield self.head
        for t in self.tensors:
            yield Payload(memoryview(t.data), t.digest)
            n = pad(t.data.nbytes, self.alignment)
            if n:
                yield bytes(n)

    def tobytes(self) -> bytes:
        """The whole file in memory (tests, the llama.cpp check)."""
        return b"".join(bytes(s.data if isinstance(s, Payload) else s) for s in self.segments())


def _meta(tensors: Sequence[PackedTensor]) -> list[list[Any]]:
    return [[t.name, t.ggml, list(t.shape)] for t in tensors]


def _parts(tensors: Sequence[PackedTensor]) -> list[Part]:
    return [Part(memoryview(t.data), t.digest) for t in tensors]


def _tensors(meta: Any, parts: Sequence[bytes]) -> tuple[PackedTensor, ...]:
    from graphbuild.hashing import digest_bytes

    out = []
    for (name, ggml, shape), data in zip(meta, parts, strict=True):
        array = np.frombuffer(bytearray(data), dtype=np.uint8)
        out.append(PackedTensor(name, ggml, tuple(shape), array, digest_bytes(array)))
    return tuple(out)


def _token(tensors: Sequence[PackedTensor]) -> list[Any]:
    return [[t.name, t.ggml, list(t.shape), t.digest, array_token(t.data)] for t in tensors]


class PackedTensorsCodec(Codec):
    name = "gguf_tensors"
    types = (PackedTensors,)

    def encode(self, value: PackedTensors) -> Encoded:
        return Encoded(self.name, _meta(value.tensors), _parts(value.tensors))

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        return PackedTensors(_tensors(meta, parts))

    def snapshot(self, value: PackedTensors) -> Any:
        return _token(value.tensors)


class GgufFileCodec(Codec):
    name = "gguf_file"
    types = (GgufFile,)

    def encode(self, value: GgufFile) -> Encoded:
        meta = {"name": value.name, "alignment": value.alignment, "tensors": _meta(value.tensors)}
        return Encoded(self.name, meta, [Part(value.head), *_parts(value.tensors)])

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        tensors = _tensors(meta["tensors"], parts[1:])
        return GgufFile(meta["name"], bytes(parts[0]), tensors, int(meta["alignment"]))

    def snapshot(self, value: GgufFile) -> Any:
        return [value.name, value.head, value.alignment, _token(value.tensors)]


register_codec(PackedTensorsCodec())
register_codec(GgufFileCodec())
