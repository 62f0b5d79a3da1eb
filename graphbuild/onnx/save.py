"""Writing a bound model: in memory (``materialize``) or to disk (``save_model``), streamed.

The protobuf is written field by field around the tensors (no >2 GiB message is built, no full
copy of the weights is made), inline or with external data, each file atomically.

:func:`write_model` can build a file from a previously written one where the file system
shares blocks between files (btrfs, XFS: :func:`~graphbuild.onnx.filesystem.shares_blocks`): a
tensor whose bytes have a digest that a range of the previous file was recorded under is copied
from there in the kernel (``os.copy_file_range``, which shares the blocks), then read back and
hashed; a range that does not hash to its digest (the file was edited, truncated or replaced)
is written from memory instead. Where the file system does not share blocks (ext4, tmpfs) a
range copy moves the bytes as a write does, and reading it back makes it dearer than writing
the tensor, which is in memory: every tensor is written. The file is byte for byte what a full
write gives, and nothing unverified reaches it (DESIGN.md, invariant 8). :func:`write_segments`
does the same for a file of another format (:class:`SegmentedFile`: a GGUF file, say).

Each file is fsynced once, before it is renamed into place. A large one is streamed to disk as
it is written (:class:`~graphbuild.onnx.filesystem.Streamer`): its ranges go to the disk as they
are written and leave the page cache once there, so writing it reuses a few ranges' worth of
memory and the fsync finds only the tail to write.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import onnx
import onnx_ir as ir

from graphbuild.errors import ExportError
from graphbuild.hashing import Hasher, digest_bytes
from graphbuild.onnx.bind import (
    META_PREFIX,
    BoundModel,
    array_bytes,
    is_reference,
    iter_references,
)
from graphbuild.onnx.filesystem import Streamer, release, shares_blocks, start_writeback

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
_READ_CHUNK = 8 << 20
_STREAM_BYTES = 32 << 20
"""The writer hands the file to the disk in ranges of this many bytes (:class:`Streamer`)."""
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


@dataclass(frozen=True)
class TensorRange:
    """Where one tensor's bytes lie in a written file, and their xxh3-128."""

    offset: int
    length: int
    digest: str


@dataclass(frozen=True)
class SavedFile:
    """A file :func:`write_model` wrote: its xxh3-128 and size, where each tensor's bytes lie
    (``ranges``), and how many bytes were copied from previous files rather than written."""

    path: Path
    digest: str
    size: int
    ranges: tuple[TensorRange, ...]
    copied: int = 0


@dataclass(frozen=True)
class PreviousFile:
    """A file written before, with the ranges recorded for it: where unchanged tensors can be
    copied from. Untrusted: every copied range is verified against its digest. ``intact``:
    its size, modification time and inode are those recorded when it was written (nobody
    touched it since), so a file of one range can be linked whole, as placement links the
    files of an unchanged product."""

    path: Path
    ranges: Sequence[TensorRange]
    intact: bool = False


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
    with _Sources(previous) as sources:
        if layout is False:
            return [_write_atomic(path, _stream_inline(bound), sources)]
        if layout == PER_TENSOR:
            return _write_per_tensor(bound, path, sources)
        data_path = path.with_name(path.name + ".data")
        model = onnx.ModelProto()
        model.CopyFrom(bound.model)
        data = _write_atomic(data_path, _stream_tensors(bound, model, data_path.name), sources)
        onnx_file = _write_atomic(path, [model.SerializeToString(deterministic=True)])
        return [onnx_file, data]


def data_layout(bound: BoundModel, external_data: bool | str | None) -> bool | str:
    """``external_data`` resolved for ``bound``: ``False``, ``True`` or ``"per_tensor"``."""
    if external_data is None:
        total = sum(a.nbytes for a in bound.tensors.values())
        return PER_TENSOR if total > PER_TENSOR_THRESHOLD else False
    if external_data is True or external_data is False or external_data == PER_TENSOR:
        return external_data
    raise ExportError(f"external_data must be true, false or {PER_TENSOR!r}, not {external_data!r}")


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


def _write_per_tensor(bound: BoundModel, path: Path, sources: _Sources) -> list[SavedFile]:
    """Each reference of 64 KiB or more into a data file of its own, the rest inline; then
    the model file, which names the data files. A data file is synced and renamed while the
    next one is written (its bytes on their way to the disk meanwhile)."""
    model = onnx.ModelProto()
    model.CopyFrom(bound.model)
    files: list[SavedFile] = []
    pending: _Pending | None = None
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
    onnx_file = _write_atomic(path, [model.SerializeToString(deterministic=True)])
    return [onnx_file, *files]


def _write_tensor_file(
    path: Path, payload: Payload, sources: _Sources
) -> tuple[SavedFile, _Pending | None]:
    """A data file holding one tensor's bytes: a hard link to an intact previous file holding
    exactly those bytes where there is one (in place at once), else written (pending)."""
    length = len(payload.data)
    digest = payload.digest or digest_bytes(payload.data)
    whole = TensorRange(0, length, digest)
    linked = sources.whole_file(digest, length)
    if linked is not None and _link_atomic(linked, path):
        return SavedFile(path, digest, length, (whole,), copied=length), None
    written = _write_pending(path, [Payload(payload.data, digest)], sources)
    return written.saved, written


def _link_atomic(source: Path, path: Path) -> bool:
    """Make ``path`` a hard link to ``source`` (replacing ``path``); False where the file
    system cannot (another device, no hard links, too many links)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        os.link(source, tmp, follow_symlinks=False)
        os.replace(tmp, path)
    except OSError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


@dataclass(frozen=True)
class Payload:
    """A tensor's bytes as the file holds them, and their digest when known: the writer
    copies it from a previous file holding a range of that digest (verified), or writes it."""

    data: bytes | memoryview
    digest: str | None


@runtime_checkable
class SegmentedFile(Protocol):
    """A file artifact of any format that is written segment by segment: plain bytes (a
    header, padding) and :class:`Payload` s (tensor data), which the placement takes from
    the file it replaces where it can (:func:`write_segments`)."""

    name: str

    def segments(self) -> Iterable[bytes | memoryview | Payload]: ...


def write_segments(
    path: Path,
    segments: Iterable[bytes | memoryview | Payload],
    previous: Sequence[PreviousFile] = (),
) -> SavedFile:
    """Write ``segments`` to ``path`` atomically, each payload copied from a range of a
    ``previous`` file recorded under its digest where one is (verified as copied), else
    written; the bytes are the same either way. The result records every payload's range."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _Sources(previous) as sources:
        return _write_atomic(path, segments, sources)


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


def _write_atomic(
    path: Path,
    chunks: Iterable[bytes | memoryview | Payload],
    sources: _Sources | None = None,
) -> SavedFile:
    pending = _write_pending(path, chunks, sources)
    pending.settle()
    return pending.saved


@dataclass
class _Pending:
    """A file written under a temporary name and handed to the disk, not yet synced:
    :meth:`settle` waits for it, lets its pages go and renames it into place."""

    tmp: Path
    path: Path
    saved: SavedFile

    def settle(self) -> None:
        try:
            fd = os.open(self.tmp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                os.fsync(fd)
                release(fd, 0, self.saved.size)  # its pages serve the next file
            finally:
                os.close(fd)
            os.replace(self.tmp, self.path)
        finally:
            self.tmp.unlink(missing_ok=True)

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


def _write_pending(
    path: Path,
    chunks: Iterable[bytes | memoryview | Payload],
    sources: _Sources | None = None,
) -> _Pending:
    """Write ``chunks`` to a temporary name beside ``path`` and start handing them to the
    disk; the caller settles the result (:meth:`_Pending.settle`) or discards it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w+b") as f:  # read too: copied ranges are read back
            writer = _FileWriter(f, sources)
            for chunk in chunks:
                writer.add(chunk)
            f.flush()
            f.truncate(writer.pos)  # nothing of a failed copy past the end
            start_writeback(f.fileno(), 0, writer.pos)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return _Pending(tmp, path, writer.result(path))


class _Sources:
    """The previous files, opened for reading, and where each recorded digest lies in them.

    Only regular files are read (a FIFO or device in their place would block or lie), opened
    without following a symbolic link, and only ranges inside the file's current size."""

    def __init__(self, previous: Sequence[PreviousFile]):
        self._previous = previous
        self._fds: list[int] = []
        self.ranges: dict[tuple[str, int], tuple[int, int]] = {}  # (digest, length) -> (fd, off)
        self.whole: dict[tuple[str, int], Path] = {}  # intact one-tensor files

    def __enter__(self) -> _Sources:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        for prev in self._previous:
            try:
                fd = os.open(prev.path, flags | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                continue
            self._fds.append(fd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            for r in prev.ranges:
                if r.length > 0 and r.offset >= 0 and r.offset + r.length <= st.st_size:
                    self.ranges.setdefault((r.digest, r.length), (fd, r.offset))
            if prev.intact and len(prev.ranges) == 1:
                (r,) = prev.ranges
                if r.offset == 0 and r.length == st.st_size:
                    self.whole.setdefault((r.digest, r.length), prev.path)
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def find(self, digest: str, length: int) -> tuple[int, int] | None:
        return self.ranges.get((digest, length))

    def whole_file(self, digest: str, length: int) -> Path | None:
        """An intact previous file holding exactly these bytes, and nothing else."""
        return self.whole.get((digest, length))


#: errnos with which copy_file_range says it cannot copy between these files (then every
#: tensor is written from memory)
_NO_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM}


class _FileWriter:
    """Writes chunks in order, hashing the file as it goes; a payload found in the sources is
    range-copied and verified (see the module's docstring)."""

    def __init__(self, f, sources: _Sources | None):
        self.f = f
        copies = hasattr(os, "copy_file_range")  # Linux; elsewhere every tensor is written
        if sources is None or not sources.ranges or not copies or not shares_blocks(f.fileno()):
            sources = None  # copies would cost more than the writes they replace
        self.sources = sources
        self.hasher = Hasher()
        self.pos = 0
        self._stream = Streamer(f.fileno(), _STREAM_BYTES)
        self.ranges: list[TensorRange] = []
        self.copied = 0
        self._buffer: bytearray | None = None

    def add(self, chunk: bytes | memoryview | Payload) -> None:
        if not isinstance(chunk, Payload):
            self._write(chunk)
            return
        data = chunk.data
        length = len(data)
        digest = chunk.digest or digest_bytes(data)
        source = self.sources.find(digest, length) if self.sources is not None else None
        if source is None or not self._copy(source, length, digest):
            self._write(data)
        else:
            self.copied += length
            self._write_back()
        self.ranges.append(TensorRange(self.pos - length, length, digest))

    def result(self, path: Path) -> SavedFile:
        return SavedFile(path, self.hasher.hexdigest(), self.pos, tuple(self.ranges), self.copied)

    def _write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.hasher.update(data)
        self.pos += len(data)
        self._write_back()

    def _write_back(self) -> None:
        if self._stream.due(self.pos):
            self.f.flush()
            self._stream.written(self.pos)

    def _copy(self, source: tuple[int, int], length: int, digest: str) -> bool:
        """Copy ``length`` bytes from the source range to the current position, then read them
        back: True when they hash to ``digest`` (the position has moved past them)."""
        src_fd, src_offset = source
        self.f.flush()
        fd = self.f.fileno()
        done = 0
        try:
            while done < length:
                n = os.copy_file_range(
                    src_fd, fd, length - done, src_offset + done, self.pos + done
                )
                if n == 0:  # the source is shorter than recorded
                    return False
                done += n
        except OSError as err:
            if err.errno in _NO_COPY:
                self.sources = None  # not between these files: write the rest from memory
            return False
        before = self.hasher.copy()
        check = Hasher()
        if self._buffer is None:
            self._buffer = bytearray(_READ_CHUNK)
        view = memoryview(self._buffer)
        offset = self.pos
        while offset < self.pos + length:
            n = os.preadv(fd, [view[: min(_READ_CHUNK, self.pos + length - offset)]], offset)
            if n <= 0:
                break
            check.update(view[:n])
            self.hasher.update(view[:n])
            offset += n
        if offset != self.pos + length or check.hexdigest() != digest:
            self.hasher = before  # the bytes at this position are overwritten from memory
            return False
        self.pos += length
        self.f.seek(self.pos)
        return True
