"""``bind``: give the data-less references of a lowered skeleton their current values.

Two kinds of references are filled (see :mod:`graphbuild.stages.onnx_export` and
:mod:`graphbuild.stages.lower`):

* location ``graphbuild:state``: the state tensor named like the initializer;
* location ``graphbuild:qparams``: scale, zero point, clip bound or int32-quantized tensor of
  the quantizer recorded in the initializer's ``metadata_props``.

Binding copies bytes at most (state is shared zero-copy when contiguous); the graph itself is
untouched, so retuned weights or scales never re-run the exporter (DESIGN.md, invariant 5).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx_ir import tensor_adapters

from graphbuild.errors import ExportError
from graphbuild.quantmap import QParams, QuantMap, QuantSpec, QuantValues
from graphbuild.stages.lower import QID_KEY, QPARAMS_LOCATION, ROLE_KEY, SOURCE_KEY, dtype_range
from graphbuild.stages.onnx_export import STATE_LOCATION

EXTERNAL_DATA_THRESHOLD = 2**31
"""Above this many tensor bytes :func:`save_model` writes external data (protobuf's limit)."""
_LOCATIONS = (STATE_LOCATION, QPARAMS_LOCATION)
_ALIGNMENT = 64
_META_PREFIX = "graphbuild."


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
    tensors are then streamed to the data file one by one (no >2 GiB proto is built). Each
    file is written to a temporary name and renamed into place. Returns the written paths.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if external_data is None:
        total = sum(a.nbytes for a in bound.tensors.values())
        external_data = total > EXTERNAL_DATA_THRESHOLD
    if not external_data:
        _write_atomic(path, [materialize(bound).SerializeToString(deterministic=True)])
        return [path]
    data_path = path.with_name(path.name + ".data")
    model = onnx.ModelProto()
    model.CopyFrom(bound.model)
    _write_atomic(data_path, _stream_tensors(bound, model, data_path.name))
    _write_atomic(path, [model.SerializeToString(deterministic=True)])
    return [path, data_path]


def fake_quantize(x: torch.Tensor, spec: QuantSpec, qparams: QParams) -> torch.Tensor:
    """``x`` fake-quantized by ``spec``, computed in float32 and returned in ``x.dtype``.

    torch's own ops for per-tensor and per-channel grids of up to 16 bits (what the quantized
    torch model runs); ``s * (clamp(round(x / s) + z, qmin, qmax) - z)`` otherwise.
    """
    xf = x.detach().float()
    scale = qparams.scale.detach().float()
    zero_point = qparams.zero_point.detach()
    if spec.block_size is None and spec.bits <= 16:
        if spec.axis is None:
            out = torch.fake_quantize_per_tensor_affine(
                xf, _scalar(spec, scale), _scalar(spec, zero_point).int(), spec.qmin, spec.qmax
            )
        else:
            out = torch.fake_quantize_per_channel_affine(
                xf, scale.reshape(-1), zero_point.reshape(-1).int(), spec.axis, spec.qmin, spec.qmax
            )
        return out.to(x.dtype)
    s = broadcast_qparam(scale, spec, tuple(x.shape))
    z = broadcast_qparam(zero_point.float(), spec, tuple(x.shape))
    return (s * (torch.clamp(torch.round(xf / s) + z, spec.qmin, spec.qmax) - z)).to(x.dtype)


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
        if init.data_location == onnx.TensorProto.EXTERNAL and _location(init) in _LOCATIONS:
            yield init
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_references(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from iter_references(sub)


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


def _write_atomic(path: Path, chunks: Iterator[bytes] | list[bytes]) -> None:
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
