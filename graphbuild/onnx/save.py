"""Writing a bound model: in memory (``materialize``) or to disk (``save_model``), streamed.

The protobuf is written field by field around the tensors (no >2 GiB message is built, no full
copy of the weights is made), inline or with external data, each file atomically.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from graphbuild.errors import ExportError
from graphbuild.onnx.bind import META_PREFIX, BoundModel, is_reference, iter_references

EXTERNAL_DATA_THRESHOLD = 2**31
"""Above this many tensor bytes :func:`save_model` writes external data (protobuf's limit)."""
_ALIGNMENT = 64
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


def save_model(bound: BoundModel, path: Path, *, external_data: bool | None = None) -> list[Path]:
    """Write ``path`` (``<name>.onnx``) and, with external data, ``<name>.onnx.data``.

    External data is used when asked for, or by default when the tensors exceed 2 GiB;
    tensors are then streamed to the data file one by one (no >2 GiB proto is built). Inline,
    the model is streamed too (:func:`_stream_inline`): it loads as :func:`materialize`
    builds it, but no full copy is made. Either way the bytes depend on ``bound`` only. Each
    file is written to a temporary name and renamed into place. Returns the written paths.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if external_data is None:
        total = sum(a.nbytes for a in bound.tensors.values())
        external_data = total > EXTERNAL_DATA_THRESHOLD
    if not external_data:
        _write_atomic(path, _stream_inline(bound))
        return [path]
    data_path = path.with_name(path.name + ".data")
    model = onnx.ModelProto()
    model.CopyFrom(bound.model)
    _write_atomic(data_path, _stream_tensors(bound, model, data_path.name))
    _write_atomic(path, [model.SerializeToString(deterministic=True)])
    return [path, data_path]


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
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _clear_reference(init: onnx.TensorProto) -> None:
    del init.external_data[:]
    init.data_location = onnx.TensorProto.DEFAULT
    kept = [e for e in init.metadata_props if not e.key.startswith(META_PREFIX)]
    del init.metadata_props[:]
    init.metadata_props.extend(kept)


def _stream_tensors(bound: BoundModel, model: onnx.ModelProto, location: str) -> Iterator[bytes]:
    """Yield the data file's chunks, pointing each reference of ``model`` at its bytes."""
    offset = 0
    for init in iter_references(model.graph):
        data = _byte_view(init, _tensor(bound, init.name))
        pad = -offset % _ALIGNMENT
        if pad:
            yield b"\0" * pad
            offset += pad
        _clear_reference(init)
        init.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", offset), ("length", len(data))):
            entry = init.external_data.add()
            entry.key, entry.value = key, str(value)
        yield data
        offset += len(data)


def _stream_inline(bound: BoundModel) -> Iterator[bytes | memoryview]:
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
            chunks = _inline_tensor(init, _tensor(bound, init.name))
        else:
            chunks = [init.SerializeToString(deterministic=True)]
        tensor_size = sum(len(c) for c in chunks)
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


def _inline_tensor(init: onnx.TensorProto, array: np.ndarray) -> list[bytes | memoryview]:
    """``init`` with ``array`` as ``raw_data``, serialized: the bytes are a view, not copied."""
    tensor = onnx.TensorProto()
    tensor.CopyFrom(init)  # a reference: no data of its own
    _clear_reference(tensor)
    head, tail = onnx.TensorProto(), onnx.TensorProto()
    head.CopyFrom(tensor)
    tail.CopyFrom(tensor)
    for field, _ in tensor.ListFields():  # fields before raw_data, and after it
        (tail if field.number < _TENSOR_RAW_DATA else head).ClearField(field.name)
    data = _byte_view(init, array)
    return [
        head.SerializeToString(deterministic=True),
        _field_key(_TENSOR_RAW_DATA) + _varint(len(data)),
        data,
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


def _write_atomic(path: Path, chunks: Iterable[bytes | memoryview]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
