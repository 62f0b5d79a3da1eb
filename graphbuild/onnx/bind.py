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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx_ir import tensor_adapters

from graphbuild.errors import ExportError
from graphbuild.frontend.quantmap import QParams, QuantMap, QuantSpec, QuantValues
from graphbuild.onnx.fakequant import broadcast_qparam, fake_quantize
from graphbuild.onnx.lower import QID_KEY, QPARAMS_LOCATION, ROLE_KEY, SOURCE_KEY, dtype_range
from graphbuild.onnx.skeleton import STATE_LOCATION

_LOCATIONS = (STATE_LOCATION, QPARAMS_LOCATION)
META_PREFIX = "graphbuild."


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


def iter_references(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every data-less graphbuild reference among the initializers, subgraphs included."""
    for init in graph.initializer:
        if is_reference(init):
            yield init
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_references(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from iter_references(sub)


def is_reference(init: onnx.TensorProto) -> bool:
    return init.data_location == onnx.TensorProto.EXTERNAL and _location(init) in _LOCATIONS


def _location(init: onnx.TensorProto) -> str | None:
    return next((e.value for e in init.external_data if e.key == "location"), None)


def _metadata(init: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in init.metadata_props}


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


def __getattr__(name: str) -> object:
    # the writer and the kernel moved to their own modules; the old import paths still work
    if name in ("materialize", "save_model", "EXTERNAL_DATA_THRESHOLD"):
        from graphbuild.onnx import save

        return getattr(save, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
