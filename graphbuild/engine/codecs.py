"""Artifact codecs: how each stage output type is written, read and digested.

A codec turns a value into :class:`Encoded`: a JSON ``meta``, a list of byte ``parts`` (each
stored as one content-addressed blob) and children for composite values. The artifact digest
covers exactly what the artifact holds; dependents key on it, which is what gives early
cutoff. Nothing here unpickles: parts are raw bytes, JSON, or protobuf.
"""

from __future__ import annotations

import json
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphbuild.engine.checking import checking
from graphbuild.errors import CodecError
from graphbuild.hashing import canonical_json, digest_bytes, digest_json

if TYPE_CHECKING:
    import torch

__all__ = [
    "Codec",
    "Encoded",
    "Part",
    "register_codec",
    "codec_for",
    "encode",
    "decode",
    "FileArtifact",
    "roundtrip",
    "snapshot",
    "tensor_tokens",
    "array_token",
    "codec_modules",
    "declare_codecs",
]


@dataclass
class Part:
    """One blob's worth of bytes, read in place where possible."""

    data: bytes | bytearray | memoryview
    digest: str = ""

    def __post_init__(self) -> None:
        if not self.digest:
            self.digest = digest_bytes(self.data)

    @property
    def size(self) -> int:
        return memoryview(self.data).nbytes


@dataclass
class Encoded:
    """A value as stored: codec name, JSON meta, byte parts, child artifacts, digest."""

    codec: str
    meta: Any
    parts: list[Part] = field(default_factory=list)
    children: list[Encoded] = field(default_factory=list)
    digest: str = ""

    def __post_init__(self) -> None:
        if not self.digest:
            self.digest = digest_json(
                [
                    self.codec,
                    self.meta,
                    [p.digest for p in self.parts],
                    [c.digest for c in self.children],
                ]
            )

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts) + sum(c.size for c in self.children)

    def all_parts(self) -> list[Part]:
        out = list(self.parts)
        for c in self.children:
            out.extend(c.all_parts())
        return out

    def describe(self) -> dict[str, Any]:
        """The manifest form: everything but the bytes."""
        return {
            "codec": self.codec,
            "meta": self.meta,
            "digest": self.digest,
            "parts": [[p.digest, p.size] for p in self.parts],
            "children": [c.describe() for c in self.children],
        }


class Codec:
    """Base class: ``name``, the ``types`` it handles, ``encode`` and ``decode``."""

    name: str = ""
    types: tuple[type, ...] = ()

    def accepts(self, value: Any) -> bool:
        return isinstance(value, self.types)

    def encode(self, value: Any) -> Encoded:
        raise NotImplementedError

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        raise NotImplementedError

    def snapshot(self, value: Any) -> Any:
        """A token of ``value``'s current contents: equal before and after a stage runs
        unless the stage changed the value in place, by any means (the scheduler compares
        them; docs/design.md, invariant 9). Tensors and arrays count by a digest of their bytes,
        not by a version counter that ``.data`` or a numpy view bypasses. Compared within
        one process only, so identities may appear in it. None: the codec cannot tell."""
        return None


_CODECS: list[Codec] = []
_BY_NAME: dict[str, Codec] = {}


def register_codec(codec: Codec, *, first: bool = True) -> Codec:
    """Add a codec; by default it takes precedence over those registered before it."""
    if codec.name in _BY_NAME:
        _CODECS.remove(_BY_NAME[codec.name])
    _BY_NAME[codec.name] = codec
    _CODECS.insert(0 if first else len(_CODECS), codec)
    return codec


# codec name -> the module whose import registers it, as the layer that defines it declared
_DECLARED: dict[str, str] = {}


def declare_codecs(module: str, *names: str) -> None:
    """Declare that importing ``module`` registers the codecs ``names``, without importing
    it yet. A layer whose codecs import heavy libraries (torch.export, ONNX) declares them
    from its package's ``__init__``, which every import of the layer runs: a process that
    meets a value no registered codec takes, or a cache entry such a codec wrote, imports
    the module then, and a codec's version (:func:`codec_modules`) is the same before and
    after. The engine names no module above it: what it imports is what was declared."""
    for name in names:
        _DECLARED[name] = module


def _load_declared(name: str | None = None) -> None:
    import importlib

    for codec, module in list(_DECLARED.items()):
        if (name is None or codec == name) and codec not in _BY_NAME:
            importlib.import_module(module)


def codec_for(value: Any) -> Codec:
    for attempt in range(2):
        for codec in _CODECS:
            if codec.accepts(value):
                return codec
        if attempt == 0:
            _load_declared()
    raise CodecError(
        f"no artifact codec for stage outputs of type {type(value).__module__}."
        f"{type(value).__qualname__}; return a JSON-able value, bytes, tensors, or register one "
        "with graphbuild.engine.codecs.register_codec(...)"
    )


def encode(value: Any) -> Encoded:
    # A value roundtrip() made is encoded again by the scheduler when the stage returns it,
    # and again when a later stage passes the same object on (normalize's marker graph,
    # returned by marker_graph): its encoding is known while the codec's token of its
    # contents is what it was (the token the input-mutation guard trusts). Without a token
    # the entry serves once. Check mode always encodes afresh.
    known = _ENCODED.get(id(value))
    if known is not None and known[0]() is value and not checking():
        _, encoded, token = known
        if token is not None and snapshot(value) == token:
            return encoded
        _ENCODED.pop(id(value), None)
        if token is None:
            return encoded
    return codec_for(value).encode(value)


# value id -> (weak reference, its Encoded, its snapshot token): what roundtrip() serialized
_ENCODED: dict[int, tuple[Any, Encoded, Any]] = {}


def snapshot(value: Any) -> Any:
    """The codec's token of ``value``'s contents (see :meth:`Codec.snapshot`)."""
    try:
        return codec_for(value).snapshot(value)
    except CodecError:
        return None


def codec_modules() -> list[tuple[str, str, Codec | None]]:
    """(name, module, codec or None while not loaded) of every codec this process can use,
    registered or declared (:func:`declare_codecs`), by name: what a codec's version covers,
    the same before and after a declared codec is loaded."""
    out = {name: (name, type(c).__module__, c) for name, c in _BY_NAME.items()}
    for name, module in _DECLARED.items():
        out.setdefault(name, (name, module, None))
    return [out[n] for n in sorted(out)]


def decode(description: dict[str, Any], read_part: Callable[[str, int], bytes]) -> Any:
    """Rebuild a value from its manifest description, reading each blob through
    ``read_part`` (which verifies the digest). A blob the description names more than once
    (one file placed in two folders) is read once, and its parts share the bytes."""
    read: dict[str, bytes] = {}

    def once(digest: str, size: int) -> bytes:
        if digest not in read:
            read[digest] = read_part(digest, size)
        return read[digest]

    return _decode(description, once)


def _decode(description: dict[str, Any], read_part: Callable[[str, int], bytes]) -> Any:
    codec = _BY_NAME.get(description["codec"])
    if codec is None and description["codec"] in _DECLARED:
        _load_declared(description["codec"])
        codec = _BY_NAME.get(description["codec"])
    if codec is None:
        raise CodecError(
            f"the cache holds an artifact of codec '{description['codec']}', which this process "
            "has neither registered nor declared: import the module that registers it "
            "(graphbuild.engine.codecs.register_codec or declare_codecs) before loading it"
        )
    parts = [read_part(d, s) for d, s in description["parts"]]
    children = [_decode(c, read_part) for c in description["children"]]
    return codec.decode(description["meta"], parts, children)


def roundtrip(value: Any) -> Any:
    """``value`` as a later run would load it from the cache. Stages whose outputs do not
    survive encoding unchanged return this, so a hit and a fresh run feed dependents alike."""
    encoded = encode(value)
    parts = {p.digest: bytes(p.data) for p in encoded.all_parts()}
    loaded = decode(encoded.describe(), lambda digest, size: parts[digest])
    try:
        ref = weakref.ref(loaded, lambda _, key=id(loaded): _ENCODED.pop(key, None))
    except TypeError:  # not weakly referenceable: nothing to remember
        return loaded
    _ENCODED[id(loaded)] = (ref, encoded, snapshot(loaded))  # encoding it again: same bytes
    return loaded


# --------------------------------------------------------------------------- built-ins


def _is_json(value: Any) -> bool:
    """True when ``value`` reads back from JSON as an equal value of the same types: no
    tuples (they would come back as lists), no non-string keys (they would come back as
    strings), no subclasses."""
    kind = type(value)
    if kind in (str, int, float, bool, type(None)):
        return True
    if kind is list:
        return all(_is_json(v) for v in value)
    if kind is dict:
        return all(type(k) is str and _is_json(v) for k, v in value.items())
    return False


class JsonCodec(Codec):
    name = "json"
    types = (dict, list, str, int, float, bool, type(None))

    def accepts(self, value: Any) -> bool:
        return _is_json(value)

    def encode(self, value: Any) -> Encoded:
        text = canonical_json(value)
        return Encoded(self.name, None, [Part(text.encode())])

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        return json.loads(parts[0])

    def snapshot(self, value: Any) -> Any:
        return digest_json(value)


class BytesCodec(Codec):
    name = "bytes"
    types = (bytes, bytearray)

    def encode(self, value: Any) -> Encoded:
        return Encoded(self.name, None, [Part(bytes(value))])

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        return bytes(parts[0])

    def snapshot(self, value: Any) -> Any:
        return digest_bytes(value) if isinstance(value, bytearray) else "immutable"


def tensor_part(tensor: torch.Tensor) -> tuple[dict[str, Any], Part]:
    from graphbuild.engine.fingerprint import tensor_bytes

    meta = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    return meta, Part(tensor_bytes(tensor))


def tensor_tokens(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    """Tokens of the tensors' contents: they change whenever the values change, however
    they were written (see ``engine.fingerprint.content_tokens``)."""
    from graphbuild.engine.fingerprint import content_tokens

    return content_tokens(tensors)


def tensor_token(tensor: torch.Tensor) -> tuple:
    return tensor_tokens([tensor])[0]


def array_token(array: Any) -> tuple:
    """A numpy array's contents and layout (numpy keeps no version counter: only the bytes
    tell whether a stage wrote into it)."""
    import numpy as np

    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return (digest_bytes(memoryview(flat)), str(array.dtype), tuple(array.shape))


def _is_tensor(value: Any) -> bool:
    # torch is imported lazily: a value cannot be a tensor before torch is loaded
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def tensor_from_part(meta: dict[str, Any], data: bytes) -> torch.Tensor:
    import torch

    dtype = getattr(torch, meta["dtype"])
    if not data:
        return torch.empty(meta["shape"], dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).reshape(meta["shape"])


class TensorCodec(Codec):
    name = "tensor"

    def accepts(self, value: Any) -> bool:
        return _is_tensor(value)

    def encode(self, value: torch.Tensor) -> Encoded:
        meta, part = tensor_part(value)
        return Encoded(self.name, meta, [part])

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        return tensor_from_part(meta, parts[0])

    def snapshot(self, value: Any) -> Any:
        return tensor_token(value)


class TensorDictCodec(Codec):
    """A dict of named tensors (a state dict, qparams): one blob per tensor, so unchanged
    tensors are stored once across versions."""

    name = "tensors"

    def accepts(self, value: Any) -> bool:
        return (
            isinstance(value, dict)
            and bool(value)
            and all(isinstance(k, str) and _is_tensor(v) for k, v in value.items())
        )

    def encode(self, value: dict[str, torch.Tensor]) -> Encoded:
        metas, parts = [], []
        for name in sorted(value):
            meta, part = tensor_part(value[name])
            metas.append([name, meta])
            parts.append(part)
        return Encoded(self.name, metas, parts)

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        return {
            name: tensor_from_part(m, data) for (name, m), data in zip(meta, parts, strict=False)
        }

    def snapshot(self, value: Any) -> Any:
        names = sorted(value)
        return list(zip(names, tensor_tokens([value[n] for n in names]), strict=True))


class SequenceCodec(Codec):
    """A tuple or list whose items are artifacts of any codec."""

    name = "sequence"
    types = (tuple, list)

    def encode(self, value: Sequence[Any]) -> Encoded:
        return Encoded(self.name, type(value).__name__, children=[encode(v) for v in value])

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        return tuple(children) if meta == "tuple" else list(children)

    def snapshot(self, value: Any) -> Any:
        return [len(value), *(snapshot(v) for v in value)]


class MappingCodec(Codec):
    """A dict with string keys whose values are artifacts of any codec."""

    name = "mapping"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)

    def encode(self, value: dict[str, Any]) -> Encoded:
        keys = sorted(value)
        return Encoded(self.name, keys, children=[encode(value[k]) for k in keys])

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        return dict(zip(meta, children, strict=False))

    def snapshot(self, value: Any) -> Any:
        return [[k, snapshot(value[k])] for k in sorted(value)]


@dataclass(frozen=True)
class FileArtifact:
    """A file's contents as a stage output; ``name`` is the file name it is placed under."""

    name: str
    data: bytes

    @classmethod
    def read(cls, path: str | Path) -> FileArtifact:
        p = Path(path)
        return cls(p.name, p.read_bytes())


class FileCodec(Codec):
    name = "file"
    types = (FileArtifact,)

    def encode(self, value: FileArtifact) -> Encoded:
        return Encoded(self.name, {"name": value.name}, [Part(value.data)])

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        return FileArtifact(meta["name"], bytes(parts[0]))

    def snapshot(self, value: Any) -> Any:
        return "immutable"  # a frozen dataclass of bytes


# Later registrations win: the most general first.
for _codec in (
    SequenceCodec(),
    MappingCodec(),
    JsonCodec(),
    BytesCodec(),
    TensorCodec(),
    TensorDictCodec(),
    FileCodec(),
):
    register_codec(_codec)
