"""Writing a bound model: in memory (``materialize``) or to disk (``save_model``), streamed.

The protobuf is written field by field around the tensors (no >2 GiB message is built, no full
copy of the weights is made): inline, with one data file, or with a data file per large tensor
(``per_tensor``), each file atomically (:mod:`graphbuild.onnx.files`).

:func:`write_model` builds the files from previously written ones where it can: a tensor whose
digest a range of a previous file was recorded under is range-copied and verified where the
file system shares blocks, and a ``per_tensor`` data file an intact previous file holds whole is
hard-linked. The bytes are the same either way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from graphbuild.errors import ExportError
from graphbuild.hashing import digest_bytes
from graphbuild.onnx.bind import (
    META_PREFIX,
    BoundModel,
    array_bytes,
    is_reference,
    iter_references,
)
from graphbuild.onnx.files import (
    Payload,
    Pending,
    PreviousFile,
    SavedFile,
    SegmentedFile,
    Sources,
    TensorRange,
    link_atomic,
    write_atomic,
    write_pending,
    write_segments,
)

__all__ = [
    "EXTERNAL_DATA_THRESHOLD",
    "PER_TENSOR",
    "PER_TENSOR_THRESHOLD",
    "Payload",
    "PreviousFile",
    "SavedFile",
    "SegmentedFile",
    "TensorRange",
    "data_file_name",
    "data_layout",
    "is_data_file",
    "materialize",
    "save_model",
    "tensor_bytes",
    "write_model",
    "write_segments",
]

EXTERNAL_DATA_THRESHOLD = 2**31
"""Protobuf's limit: a model with more tensor bytes than this cannot be written inline."""
PER_TENSOR_THRESHOLD = 32 << 20
"""Above this many tensor bytes, :func:`save_model` by default gives each large tensor a data
file of its own (``per_tensor``): a re-export then writes the files of the tensors that
changed and links the others, where one file would be rewritten whole (about 0.1 s for
32 MiB here, and every retune of an LLM pays it)."""
PER_TENSOR = "per_tensor"
"""``external_data`` for one data file per large tensor, small tensors inline."""
_ALIGNMENT = 64
_PAGE_ALIGNMENT = 4096
"""External data of a tensor of at least ``_PAGE_ALIGNED_BYTES`` starts on a page: runtimes can
map it, and a file system with shared extents can clone it whole when the file is rebuilt."""
_PAGE_ALIGNED_BYTES = 64 << 10
_MODEL_GRAPH = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number
_GRAPH_INITIALIZER = onnx.GraphProto.DESCRIPTOR.fields_by_name["initializer"].number
_TENSOR_RAW_DATA = onnx.TensorProto.DESCRIPTOR.fields_by_name["raw_data"].number
_PROTOBUF_LIMIT = 2**31 - 1
"""The largest message protobuf parses."""


def materialize(bound: BoundModel) -> onnx.ModelProto:
    """A complete in-memory model: every reference inlined as ``raw_data`` (< 2 GiB)."""
    model = onnx.ModelProto()
    model.CopyFrom(bound.model)
    for init in iter_references(model.graph):
        data = _tobytes(init, _tensor(bound, init.name))
        _clear_reference(init)
        init.raw_data = data
    return model


def save_model(
    bound: BoundModel, path: Path, *, external_data: bool | str | None = None
) -> list[Path]:
    """Write ``path`` (``<name>.onnx``) and, with external data, its data files.

    ``external_data``: ``False``, every tensor inline; ``True``, every tensor in one file,
    ``<name>.onnx.data``; ``"per_tensor"``, each tensor of 64 KiB or more in a file of its
    own, ``<name>.onnx.data.<k>`` (``k`` counting them in the graph's order), the smaller
    ones inline; ``None`` (the default), inline up to 32 MiB of tensors, ``per_tensor``
    above. External tensors are streamed to their files (no >2 GiB proto is built). Inline,
    the model is streamed too (:func:`_stream_inline`): it loads as :func:`materialize`
    builds it, but no full copy is made. Either way the bytes depend on ``bound`` only. Each
    file is written to a temporary name and renamed into place. Returns the written paths.
    """
    return [f.path for f in write_model(bound, path, external_data=external_data)]


def write_model(
    bound: BoundModel,
    path: Path,
    *,
    external_data: bool | str | None = None,
    previous: Sequence[PreviousFile] = (),
) -> list[SavedFile]:
    """:func:`save_model`, reporting each file's digest and tensor ranges, and taking every
    tensor it can from ``previous`` files: a whole data file an intact previous file holds
    the same bytes of is hard-linked, other tensors are range-copied (verified, see the
    module's docstring). The bytes are the same as without ``previous``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    layout = data_layout(bound, external_data)
    with Sources(previous) as sources:
        if layout is False:
            return [write_atomic(path, _stream_inline(bound), sources)]
        if layout == PER_TENSOR:
            return _write_per_tensor(bound, path, sources)
        data_path = path.with_name(path.name + ".data")
        model = onnx.ModelProto()
        model.CopyFrom(bound.model)
        data = write_atomic(data_path, _stream_tensors(bound, model, data_path.name), sources)
        onnx_file = write_atomic(path, [model.SerializeToString(deterministic=True)])
        return [onnx_file, data]


def data_layout(bound: BoundModel, external_data: bool | str | None) -> bool | str:
    """``external_data`` resolved for ``bound``: ``False``, ``True`` or ``"per_tensor"``."""
    if external_data is None:
        return PER_TENSOR if tensor_bytes(bound) > PER_TENSOR_THRESHOLD else False
    if external_data is True or external_data is False or external_data == PER_TENSOR:
        return external_data
    raise ExportError(f"external_data must be true, false or {PER_TENSOR!r}, not {external_data!r}")


def tensor_bytes(bound: BoundModel) -> int:
    """The bytes of ``bound``'s tensors, all together: what decides a layout."""
    return sum(a.nbytes for a in bound.tensors.values())


def data_file_name(model_file: str, index: int | None = None) -> str:
    """The name of a model file's data file: ``<model>.onnx.data``, or the ``index``-th
    ``per_tensor`` file, ``<model>.onnx.data.<index>``."""
    return f"{model_file}.data" if index is None else f"{model_file}.data.{index}"


def is_data_file(name: str, model_file: str) -> bool:
    """True for a name :func:`data_file_name` gives for ``model_file``."""
    stem = f"{model_file}.data"
    if name == stem:
        return True
    index = name[len(stem) + 1 :] if name.startswith(stem + ".") else ""
    return index.isdigit() and index.isascii() and str(int(index)) == index


def _write_per_tensor(bound: BoundModel, path: Path, sources: Sources) -> list[SavedFile]:
    """Each reference of 64 KiB or more into a data file of its own, the rest inline; then
    the model file, which names the data files. A data file is synced and renamed while the
    next one is written (its bytes on their way to the disk meanwhile)."""
    model = onnx.ModelProto()
    model.CopyFrom(bound.model)
    files: list[SavedFile] = []
    pending: Pending | None = None
    try:
        for init in iter_references(model.graph):
            payload = _payload(bound, init)
            length = len(payload.data)
            _clear_reference(init)
            if length < _PAGE_ALIGNED_BYTES:
                init.raw_data = bytes(payload.data)
                continue
            name = data_file_name(path.name, len(files))
            saved, written = _write_tensor_file(path.with_name(name), payload, sources)
            files.append(saved)
            if pending is not None:
                pending.settle()
            pending = written
            init.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", name), ("offset", 0), ("length", length)):
                entry = init.external_data.add()
                entry.key, entry.value = key, str(value)
        if pending is not None:
            pending, last = None, pending
            last.settle()
    finally:
        if pending is not None:
            pending.discard()
    onnx_file = write_atomic(path, [model.SerializeToString(deterministic=True)])
    return [onnx_file, *files]


def _write_tensor_file(
    path: Path, payload: Payload, sources: Sources
) -> tuple[SavedFile, Pending | None]:
    """A data file holding one tensor's bytes: a hard link to an intact previous file holding
    exactly those bytes where there is one (in place at once), else written (pending)."""
    length = len(payload.data)
    digest = payload.digest or digest_bytes(payload.data)
    whole = TensorRange(0, length, digest)
    linked = sources.whole_file(digest, length)
    if linked is not None and link_atomic(linked[0], path, linked[1]):
        return SavedFile(path, digest, length, (whole,), copied=length), None
    written = write_pending(path, [Payload(payload.data, digest)], sources)
    return written.saved, written


def _payload(bound: BoundModel, init: onnx.TensorProto) -> Payload:
    array = _tensor(bound, init.name)
    data = _byte_view(init, array)
    packed = not isinstance(data, memoryview)  # 4-bit or big-endian: not the array's bytes
    return Payload(data, None if packed else bound.digests.get(init.name))


def _tensor(bound: BoundModel, name: str) -> np.ndarray:
    array = bound.tensors.get(name)
    if array is None:
        raise ExportError(f"bound model has no value for reference '{name}'")
    return array


def _tobytes(init: onnx.TensorProto, array: np.ndarray) -> bytes:
    return ir.Tensor(array, dtype=ir.DataType(init.data_type)).tobytes()


def _byte_view(init: onnx.TensorProto, array: np.ndarray) -> memoryview | bytes:
    """The tensor's bytes as ONNX lays them out; a view (no copy) unless packing is needed."""
    dtype = ir.DataType(init.data_type)
    if dtype.bitwidth < 8 or array.dtype.byteorder == ">":
        return _tobytes(init, array)
    return array_bytes(array)


def _clear_reference(init: onnx.TensorProto) -> None:
    del init.external_data[:]
    init.data_location = onnx.TensorProto.DEFAULT
    kept = [e for e in init.metadata_props if not e.key.startswith(META_PREFIX)]
    del init.metadata_props[:]
    init.metadata_props.extend(kept)


def _stream_tensors(
    bound: BoundModel, model: onnx.ModelProto, location: str
) -> Iterator[bytes | Payload]:
    """Yield the data file's chunks, pointing each reference of ``model`` at its bytes."""
    offset = 0
    for init in iter_references(model.graph):
        payload = _payload(bound, init)
        length = len(payload.data)
        pad = -offset % (_PAGE_ALIGNMENT if length >= _PAGE_ALIGNED_BYTES else _ALIGNMENT)
        if pad:
            yield b"\0" * pad
            offset += pad
        _clear_reference(init)
        init.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", offset), ("length", length)):
            entry = init.external_data.add()
            entry.key, entry.value = key, str(value)
        yield payload
        offset += length


def _stream_inline(bound: BoundModel) -> Iterator[bytes | memoryview | Payload]:
    """The chunks of one protobuf file that parses to ``materialize(bound)``.

    Protobuf merges repeated occurrences of a message field and appends to repeated fields,
    so the file is the model without its ``graph.initializer`` (serialized deterministically),
    then, in the graph's order, one ``ModelProto {graph {initializer: <tensor>}}`` record per
    initializer. A bound tensor's record is framed by hand around a view of its bytes, in the
    field order deterministic serialization uses: memory beyond the skeleton is one tensor's
    bytes at most (a copy only where ONNX packs them: 4-bit, big-endian). References inside
    subgraphs (which no such record can reach) are inlined into the skeleton.
    """
    model = onnx.ModelProto()
    _copy_fields(model, bound.model, skip="graph")
    model.graph.SetInParent()
    _copy_fields(model.graph, bound.model.graph, skip="initializer")
    for init in iter_references(model.graph):  # subgraphs only: the initializers are gone
        data = _tobytes(init, _tensor(bound, init.name))
        _clear_reference(init)
        init.raw_data = data
    skeleton = model.SerializeToString(deterministic=True)
    size = len(skeleton)
    yield skeleton
    del model, skeleton
    for init in bound.model.graph.initializer:
        if is_reference(init):
            chunks = _inline_tensor(init, _payload(bound, init))
        else:
            chunks = [init.SerializeToString(deterministic=True)]
        tensor_size = sum(len(c.data if isinstance(c, Payload) else c) for c in chunks)
        initializer = _field_key(_GRAPH_INITIALIZER) + _varint(tensor_size)
        frame = _field_key(_MODEL_GRAPH) + _varint(len(initializer) + tensor_size) + initializer
        size += len(frame) + tensor_size
        if size > _PROTOBUF_LIMIT:
            raise ExportError(
                f"the model is over protobuf's 2 GiB limit at initializer '{init.name}': "
                "save it with external data"
            )
        yield frame
        yield from chunks


def _inline_tensor(init: onnx.TensorProto, payload: Payload) -> list[bytes | Payload]:
    """``init`` with the payload as ``raw_data``, serialized: the bytes are not copied."""
    tensor = onnx.TensorProto()
    tensor.CopyFrom(init)  # a reference: no data of its own
    _clear_reference(tensor)
    head, tail = onnx.TensorProto(), onnx.TensorProto()
    head.CopyFrom(tensor)
    tail.CopyFrom(tensor)
    for field, _ in tensor.ListFields():  # fields before raw_data, and after it
        (tail if field.number < _TENSOR_RAW_DATA else head).ClearField(field.name)
    return [
        head.SerializeToString(deterministic=True),
        _field_key(_TENSOR_RAW_DATA) + _varint(len(payload.data)),
        payload,
        tail.SerializeToString(deterministic=True),
    ]


def _copy_fields(
    dst: onnx.ModelProto | onnx.GraphProto, src: onnx.ModelProto | onnx.GraphProto, skip: str
) -> None:
    """Copy every field of ``src`` but ``skip`` into the empty ``dst``."""
    for field, value in src.ListFields():
        if field.name == skip:
            continue
        repeated = getattr(field, "is_repeated", None)
        if repeated is None:  # protobuf < 5.29
            repeated = field.label == field.LABEL_REPEATED
        if repeated:
            getattr(dst, field.name).extend(value)
        elif field.message_type is not None:
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


def _field_key(number: int) -> bytes:
    return _varint(number << 3 | 2)  # wire type 2: length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
