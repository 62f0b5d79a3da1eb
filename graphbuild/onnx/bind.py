"""``bind``: give the data-less references of a lowered skeleton their current values.

Two kinds of references are filled (see :mod:`graphbuild.onnx.skeleton` and
:mod:`graphbuild.onnx.lower`):

* location ``graphbuild:state``: the state tensor named like the initializer;
* location ``graphbuild:qparams``: scale, zero point, clip bound or int32-quantized tensor of
  the quantizer recorded in the initializer's ``metadata_props``.

Binding copies bytes at most (state is shared zero-copy when contiguous); the graph itself is
untouched, so retuned weights or scales never re-run the exporter (DESIGN.md, invariant 5).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx_ir import tensor_adapters

from graphbuild.errors import ExportError
from graphbuild.frontend.quantmap import QParams, QuantMap, QuantSpec, QuantValues
from graphbuild.onnx.lower import QID_KEY, QPARAMS_LOCATION, ROLE_KEY, SOURCE_KEY, dtype_range
from graphbuild.onnx.skeleton import STATE_LOCATION

EXTERNAL_DATA_THRESHOLD = 2**31
"""Above this many tensor bytes :func:`save_model` writes external data (protobuf's limit)."""
_LOCATIONS = (STATE_LOCATION, QPARAMS_LOCATION)
_ALIGNMENT = 64
_META_PREFIX = "graphbuild."
_MODEL_GRAPH = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number
_GRAPH_INITIALIZER = onnx.GraphProto.DESCRIPTOR.fields_by_name["initializer"].number
_TENSOR_RAW_DATA = onnx.TensorProto.DESCRIPTOR.fields_by_name["raw_data"].number
_PROTOBUF_LIMIT = 2**31 - 1
"""The largest message protobuf parses."""
_FQ_BLOCK = 1 << 18
"""Elements per block of :func:`_fake_quantize_blocked` (its passes stay in cache)."""
_FQ_MAX_INDEX = 2.0**62
"""``|x * inv_scale|`` below this keeps torch's int64 grid index defined."""
_FQ_MAX_GRID = 2**20
"""Grid bounds and zero points up to this keep ``q - z`` and ``qmin - z`` exact in float32."""


@dataclass(frozen=True)
class BoundModel:
    """A lowered skeleton (references still data-less) and the value of each reference."""

    model: onnx.ModelProto
    tensors: dict[str, np.ndarray]


def bind(
    skeleton: onnx.ModelProto,
    state: Mapping[str, torch.Tensor],
    qmap: QuantMap,
    qvalues: QuantValues,
    *,
    fake_quantize_weights: bool = True,
) -> BoundModel:
    """Compute the value of every data-less reference of ``skeleton``.

    With ``fake_quantize_weights``, a state tensor that a quantizer acts on (``spec.param``)
    is bound to its fake-quantized value, so the float graph computes what the quantized
    model computes.
    """
    weight_specs = {s.param: s for s in qmap if s.param is not None}
    references = list(iter_references(skeleton.graph))
    # a weight that float readers share has a quantized copy naming it as its source
    split = {_metadata(i).get(SOURCE_KEY) for i in references if _is_state(i)} - {None}
    tensors: dict[str, np.ndarray] = {}
    for init in references:
        if _location(init) == STATE_LOCATION:
            source = _metadata(init).get(SOURCE_KEY, init.name)
            quantized = fake_quantize_weights and (source != init.name or init.name not in split)
            spec = weight_specs.get(source) if quantized else None
            value = _state_value(source, state, spec, qvalues)
        else:
            value = _qparam_value(init, state, qmap, qvalues)
        tensors[init.name] = _as_numpy(init, value)
    return BoundModel(skeleton, tensors)


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


def fake_quantize(x: torch.Tensor, spec: QuantSpec, qparams: QParams) -> torch.Tensor:
    """``x`` fake-quantized by ``spec``, computed in float32 and returned in ``x.dtype``.

    Per-tensor and per-channel grids of up to 16 bits give what torch's own ops give (what
    the quantized torch model runs), bit for bit, from a faster evaluation of the same float32
    steps (:func:`_fake_quantize_blocked`); ``s * (clamp(round(x / s) + z, qmin, qmax) - z)``
    otherwise.
    """
    xf = x.detach().float()
    scale = qparams.scale.detach().float()
    zero_point = qparams.zero_point.detach()
    if spec.block_size is None and spec.bits <= 16:
        if spec.axis is None:
            scale, zero_point = _scalar(spec, scale), _scalar(spec, zero_point).int()
        else:
            scale, zero_point = scale.reshape(-1), zero_point.reshape(-1).int()
        owned = xf.data_ptr() != x.data_ptr()  # a float32 copy: may be overwritten
        out = _fake_quantize_blocked(xf, scale, zero_point, spec.axis, spec.qmin, spec.qmax, owned)
        if out is None:  # values torch's kernels give no defined result for, or bad shapes
            xf = x.detach().float()
            if spec.axis is None:
                out = torch.fake_quantize_per_tensor_affine(
                    xf, scale, zero_point, spec.qmin, spec.qmax
                )
            else:
                out = torch.fake_quantize_per_channel_affine(
                    xf, scale, zero_point, spec.axis, spec.qmin, spec.qmax
                )
        return out.to(x.dtype)
    s = broadcast_qparam(scale, spec, tuple(x.shape))
    z = broadcast_qparam(zero_point.float(), spec, tuple(x.shape))
    return (s * (torch.clamp(torch.round(xf / s) + z, spec.qmin, spec.qmax) - z)).to(x.dtype)


def _fake_quantize_blocked(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int | None,
    qmin: int,
    qmax: int,
    owned: bool,
) -> torch.Tensor | None:
    """``torch.fake_quantize_per_{tensor,channel}_affine(x, ...)``, bit for bit, or None.

    torch's CPU kernels compute ``q = int64(z + nearbyint(x * (1.0f / s)))`` in float32 and
    return ``float((clamp(q, qmin, qmax) - z) * s)`` along with a mask (the per-channel op in a
    second, scalar pass). The same float32 steps run here as vectorized in-place passes over
    cache-sized blocks, nothing else: ``t = x * inv_scale``, round half to even, then either
    ``clamp(t, qmin - z, qmax - z)`` (a uniform ``z``: ``t + z`` is exact wherever it is not
    saturated) and ``+ 0.0`` (torch's integer ``q - z`` has no -0.0), or ``t + z``, clamp
    and ``- z``; then ``* s``. Every product is correctly rounded, so the results are the same.
    None when that cannot be promised: a non-finite or huge ``x * inv_scale`` (torch's int64
    cast of it is undefined), huge grid bounds or zero point, arguments torch's op rejects, or
    a tensor off the CPU (other kernels).
    """
    if x.device.type != "cpu" or x.numel() == 0:
        return None
    if not -_FQ_MAX_GRID <= qmin <= qmax <= _FQ_MAX_GRID:
        return None
    if axis is None:
        outer, channels, inner = 1, 1, x.numel()
    else:
        if not 0 <= axis < x.dim():  # torch's op rejects the axis
            return None
        outer, channels = math.prod(x.shape[:axis]), x.shape[axis]
        inner = math.prod(x.shape[axis + 1 :])
    if scale.numel() != channels or zero_point.numel() != channels:
        return None
    z = zero_point.reshape(-1).long()
    z_min, z_max = (int(v) for v in torch.aminmax(z))
    if axis is not None and not qmin <= z_min <= z_max <= qmax:  # torch's op rejects it
        return None
    if max(-z_min, z_max) > _FQ_MAX_GRID:
        return None
    inv = (1.0 / scale).reshape(1, channels, 1)
    s = scale.reshape(1, channels, 1)
    zf = z.float().reshape(1, channels, 1)
    uniform = z_min == z_max
    src = x.contiguous()
    out = src if owned or src.data_ptr() != x.data_ptr() else torch.empty_like(src)
    src, out = src.view(outer, channels, inner), out.view(outer, channels, inner)
    # blocks of about _FQ_BLOCK elements, each contiguous: split inner, else channels, else outer
    inner_step = min(inner, _FQ_BLOCK)
    chan_step = max(1, min(channels, _FQ_BLOCK // inner_step))
    outer_step = max(1, _FQ_BLOCK // (inner_step * channels)) if chan_step == channels else 1
    ranges = []
    for o in range(0, outer, outer_step):
        for c in range(0, channels, chan_step):
            ch = slice(c, c + chan_step)
            for i in range(0, inner, inner_step):
                block = (slice(o, o + outer_step), ch, slice(i, i + inner_step))
                t = out[block]
                torch.mul(src[block], inv[:, ch], out=t)
                ranges.append(torch.stack(torch.aminmax(t)))
                t.round_()
                if uniform:
                    t.clamp_(qmin - z_min, qmax - z_min).add_(0.0)
                else:
                    t.add_(zf[:, ch]).clamp_(qmin, qmax).sub_(zf[:, ch])
                t.mul_(s[:, ch])
    if not bool((torch.stack(ranges).abs() < _FQ_MAX_INDEX).all()):  # NaN compares False
        return None
    return out.view(x.shape)


def broadcast_qparam(t: torch.Tensor, spec: QuantSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """Reshape a scale or zero point so it broadcasts against a tensor of ``shape``."""
    if spec.axis is None:
        return _scalar(spec, t)
    axis = spec.axis % len(shape)
    if spec.block_size is None:
        if t.numel() != shape[axis]:
            raise ExportError(
                f"quantizer {spec.qid}: {t.numel()} per-channel values for {shape[axis]} channels"
            )
        return t.reshape([shape[axis] if i == axis else 1 for i in range(len(shape))])
    blocked = list(shape)
    blocked[axis] = math.ceil(shape[axis] / spec.block_size)
    if t.numel() != math.prod(blocked):
        raise ExportError(
            f"quantizer {spec.qid}: blocked values of shape {tuple(t.shape)}, expected {blocked}"
        )
    full = t.reshape(blocked).repeat_interleave(spec.block_size, dim=axis)
    return full.narrow(axis, 0, shape[axis])


def iter_references(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every data-less graphbuild reference among the initializers, subgraphs included."""
    for init in graph.initializer:
        if _is_reference(init):
            yield init
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_references(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from iter_references(sub)


def _is_reference(init: onnx.TensorProto) -> bool:
    return init.data_location == onnx.TensorProto.EXTERNAL and _location(init) in _LOCATIONS


def _location(init: onnx.TensorProto) -> str | None:
    return next((e.value for e in init.external_data if e.key == "location"), None)


def _metadata(init: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in init.metadata_props}


def _scalar(spec: QuantSpec, t: torch.Tensor) -> torch.Tensor:
    if t.numel() != 1:
        raise ExportError(f"quantizer {spec.qid}: per-tensor value has {t.numel()} elements")
    return t.reshape(())


def _state_tensor(name: str, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    tensor = state.get(name)
    if tensor is None:
        raise ExportError(f"state tensor '{name}' is missing: the skeleton references it")
    return tensor.detach()


def _quant_values(qid: int, qvalues: QuantValues) -> QParams:
    if qid not in qvalues.values:
        raise ExportError(f"no scale/zero point for quantizer {qid}")
    return qvalues[qid]


def _state_value(
    name: str, state: Mapping[str, torch.Tensor], spec: QuantSpec | None, qvalues: QuantValues
) -> torch.Tensor:
    tensor = _state_tensor(name, state)
    if spec is None:
        return tensor
    return fake_quantize(tensor, spec, _quant_values(spec.qid, qvalues))


def _qparam_value(
    init: onnx.TensorProto, state: Mapping[str, torch.Tensor], qmap: QuantMap, qvalues: QuantValues
) -> torch.Tensor:
    meta = _metadata(init)
    qid, role = int(meta[QID_KEY]), meta[ROLE_KEY]
    spec, qp = qmap[qid], _quant_values(qid, qvalues)
    dims = tuple(init.dims)
    if role in ("scale", "zero_point"):
        value = qp.scale if role == "scale" else qp.zero_point
        if value.numel() != math.prod(dims):
            raise ExportError(
                f"quantizer {qid}: {role} has {value.numel()} values, '{init.name}' needs {dims}"
            )
        if role == "zero_point":
            _check_zero_point(init, spec, value)
        return value.detach().reshape(dims)
    if role in ("clip_min", "clip_max"):
        s = broadcast_qparam(qp.scale.detach().float(), spec, dims)
        z = broadcast_qparam(qp.zero_point.detach().float(), spec, dims)
        bound = spec.qmin if role == "clip_min" else spec.qmax
        return (s * (bound - z)).expand(dims)
    if role == "quantized":
        x = _state_tensor(meta[SOURCE_KEY], state).float()
        s = broadcast_qparam(qp.scale.detach().float(), spec, tuple(x.shape))
        z = broadcast_qparam(qp.zero_point.detach().float(), spec, tuple(x.shape))
        return torch.clamp(torch.round(x / s) + z, spec.qmin, spec.qmax)
    raise ExportError(f"initializer '{init.name}' has unknown graphbuild role '{role}'")


def _check_zero_point(init: onnx.TensorProto, spec: QuantSpec, value: torch.Tensor) -> None:
    low, high = dtype_range(ir.DataType(init.data_type))
    if value.numel() and (int(value.min()) < low or int(value.max()) > high):
        raise ExportError(
            f"quantizer {spec.qid}: zero point outside [{low}, {high}] of '{init.name}'"
        )


def _as_numpy(init: onnx.TensorProto, value: torch.Tensor) -> np.ndarray:
    """``value`` as a numpy array of the initializer's dtype and shape (zero-copy if it can)."""
    dtype = ir.DataType(init.data_type)
    dims = tuple(init.dims)
    if tuple(value.shape) != dims:
        raise ExportError(f"'{init.name}': tensor of shape {tuple(value.shape)}, expected {dims}")
    try:
        torch_dtype = tensor_adapters.to_torch_dtype(dtype)
    except TypeError:  # int4/uint4 have no torch dtype: go through int64
        return value.detach().cpu().long().numpy().astype(dtype.numpy())
    if value.dtype != torch_dtype:
        if _is_state(init):
            raise ExportError(
                f"state tensor '{init.name}' is {value.dtype}, expected {torch_dtype}"
            )
        value = value.to(torch_dtype)
    return _torch_to_numpy(value.detach().cpu().contiguous(), dtype)


def _is_state(init: onnx.TensorProto) -> bool:
    return _location(init) == STATE_LOCATION


def _torch_to_numpy(t: torch.Tensor, dtype: ir.DataType) -> np.ndarray:
    try:
        return t.numpy()
    except TypeError:  # bf16 and float8: reinterpret the bytes as the ml_dtypes type
        raw = torch.int16 if t.element_size() == 2 else torch.uint8
        return t.view(raw).numpy().view(dtype.numpy())


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
    kept = [e for e in init.metadata_props if not e.key.startswith(_META_PREFIX)]
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
        if _is_reference(init):
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
