"""``bind``: give the data-less references of a lowered skeleton their current values.

Two kinds of references are filled (see :mod:`graphbuild.onnx.skeleton` and
:mod:`graphbuild.onnx.lower`):

* location ``graphbuild:state``: the state tensor named like the initializer;
* location ``graphbuild:qparams``: scale, zero point, clip bound or int32-quantized tensor of
  the quantizer recorded in the initializer's ``metadata_props``.

Binding copies bytes at most (state is shared zero-copy when contiguous); the graph itself is
untouched, so retuned weights or scales never re-run the exporter (docs/design.md, invariant 5).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx_ir import tensor_adapters

from graphbuild.engine.checking import checking, reused_mismatch
from graphbuild.engine.fingerprint import tensor_digest
from graphbuild.engine.parallel import parallel_map
from graphbuild.errors import ExportError
from graphbuild.hashing import digest_bytes, digest_json
from graphbuild.onnx.fakequant import broadcast_qparam, fake_quantize, rounded_quotient
from graphbuild.onnx.lower import (
    QID_KEY,
    QPARAMS_LOCATION,
    ROLE_KEY,
    SOURCE_KEY,
    WEIGHT_QID_KEY,
    dtype_range,
)
from graphbuild.onnx.lpbq import PERM_KEY
from graphbuild.onnx.skeleton import STATE_LOCATION
from graphbuild.quant.quantmap import QParams, QuantMap, QuantSpec, QuantValues

_LOCATIONS = (STATE_LOCATION, QPARAMS_LOCATION)
META_PREFIX = "graphbuild."


@dataclass(frozen=True)
class BoundModel:
    """A lowered skeleton (references still data-less) and the value of each reference.

    ``digests`` holds, where known, the xxh3-128 of each array's bytes (C order): the codec
    stores the arrays under them without hashing again, and placement copies a tensor's range
    from the previously placed file when its digest says it is unchanged."""

    model: onnx.ModelProto
    tensors: dict[str, np.ndarray]
    digests: dict[str, str] = field(default_factory=dict, compare=False)


def bind(
    skeleton: onnx.ModelProto,
    state: Mapping[str, torch.Tensor],
    qmap: QuantMap,
    qvalues: QuantValues,
    *,
    fake_quantize_weights: bool = True,
    state_digests: Mapping[str, str] | None = None,
) -> BoundModel:
    """Compute the value of every data-less reference of ``skeleton``.

    With ``fake_quantize_weights``, a state tensor that a quantizer acts on (``spec.param``)
    is bound to its fake-quantized value, so the float graph computes what the quantized
    model computes.

    ``state_digests`` (state name -> xxh3-128 of the tensor's bytes, as
    :func:`graphbuild.engine.fingerprint.tensor_digest` gives it) makes binding incremental:
    a computed tensor (a snapped weight, an integer-quantized one) whose inputs have the
    digests they had at an earlier ``bind`` in this process is taken from that call, neither
    recomputed nor hashed again (:class:`_Memo`); a state tensor bound as it is takes its
    digest from here. The rest is computed across the cores (torch's kernels and xxhash
    release the GIL) with the same kernels as one at a time, so the bytes are the same.
    """
    weight_specs = {s.param: s for s in qmap if s.param is not None}
    references = list(iter_references(skeleton.graph))
    # a weight that float readers share has a quantized copy naming it as its source
    split = {_metadata(i).get(SOURCE_KEY) for i in references if _is_state(i)} - {None}
    planner = _Planner(state, qmap, qvalues, state_digests)
    plans = []
    for init in references:
        if _location(init) == STATE_LOCATION:
            source = _metadata(init).get(SOURCE_KEY, init.name)
            quantized = fake_quantize_weights and (source != init.name or init.name not in split)
            spec = weight_specs.get(source) if quantized else None
            plans.append(planner.state_plan(init, source, spec))
        else:
            plans.append(planner.qparam_plan(init))
    # what this bind cannot reuse is let go before it computes: an export in parts binds one
    # part after another, and would otherwise hold the last part's weights beside these
    wanted = {p.key for p in plans if p.key is not None}
    memo = {k: v for k, v in _Memo.entries().items() if k in wanted}
    _Memo.keep(memo)
    check = checking()  # check mode: compute everything, and compare with what was reused
    done: dict[str, tuple[np.ndarray, str]] = {}
    todo = []
    for plan in plans:
        hit = memo.get(plan.key) if plan.key is not None else None
        if hit is not None and not check:
            done[plan.name] = hit
        else:
            todo.append(plan)
    big = sum(p.nbytes for p in todo) >= PARALLEL_BIND_BYTES
    evaluate = _evaluate_checked if check else _evaluate
    for plan, result in zip(todo, parallel_map(evaluate, todo, parallel=big), strict=True):
        done[plan.name] = result
        hit = memo.get(plan.key) if plan.key is not None else None
        if hit is not None and hit[1] != result[1]:
            raise reused_mismatch(
                f"bind: tensor '{plan.name}'",
                hit[1],
                result[1],
                "an earlier bind computed it from inputs with the same digests",
            )
    if any(p.key is not None for p in plans):
        _Memo.keep({p.key: done[p.name] for p in plans if p.key is not None})
    tensors = {p.name: done[p.name][0] for p in plans}
    digests = {p.name: done[p.name][1] for p in plans}
    return BoundModel(skeleton, tensors, digests)


#: Below this many bytes to compute, references are bound one after the other.
PARALLEL_BIND_BYTES = 8 << 20


@dataclass(frozen=True)
class _Plan:
    """How to compute one reference: ``compute`` gives its torch value; ``key`` (computed
    tensors with known inputs only) names the value by the digests of everything it is a
    function of; ``digest`` is its bytes' digest when known without hashing."""

    init: onnx.TensorProto
    compute: Callable[[], torch.Tensor]
    nbytes: int
    key: str | None = None
    digest: str | None = None

    @property
    def name(self) -> str:
        return self.init.name


def _evaluate(plan: _Plan) -> tuple[np.ndarray, str]:
    array = _as_numpy(plan.init, plan.compute())
    digest = plan.digest or digest_bytes(array_bytes(array))
    if plan.key is not None:
        array.flags.writeable = False  # shared with later binds through the memo
    return array, digest


def _evaluate_checked(plan: _Plan) -> tuple[np.ndarray, str]:
    """:func:`_evaluate`, hashing the bytes even where their digest was given."""
    array, digest = _evaluate(replace(plan, digest=None))
    if plan.digest is not None and plan.digest != digest:
        raise reused_mismatch(
            f"bind: state tensor bound as '{plan.name}'",
            plan.digest,
            digest,
            "weight_digests hashed the tensor earlier in this run; it changed since",
        )
    return array, digest


def array_bytes(array: np.ndarray) -> memoryview:
    """An array's bytes in C order: a view when it is contiguous."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


class _Planner:
    """Looks up what each reference needs (errors name the reference, in the graph's order)
    and keys the computed ones."""

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        qmap: QuantMap,
        qvalues: QuantValues,
        state_digests: Mapping[str, str] | None,
    ):
        self.state, self.qmap, self.qvalues = state, qmap, qvalues
        self.state_digests = state_digests or {}
        self._qparam_digests: dict[int, str] = {}

    def state_plan(self, init: onnx.TensorProto, source: str, spec: QuantSpec | None) -> _Plan:
        tensor = _state_tensor(source, self.state)
        nbytes = tensor.numel() * 4
        known = self.state_digests.get(source)
        if spec is None:
            same_bytes = _torch_dtype(init) == tensor.dtype  # else _as_numpy converts or refuses
            return _Plan(init, lambda: tensor, 0, digest=known if same_bytes else None)
        qp = _quant_values(spec.qid, self.qvalues)
        key = self._key("fake_quantized", init, known, spec) if known else None
        return _Plan(init, lambda: fake_quantize(tensor, spec, qp), nbytes, key)

    def qparam_plan(self, init: onnx.TensorProto) -> _Plan:
        meta = _metadata(init)
        if meta.get(ROLE_KEY) != "quantized":
            return _Plan(init, lambda: _qparam_value(init, self.state, self.qmap, self.qvalues), 0)
        source = meta[SOURCE_KEY]
        tensor = _state_tensor(source, self.state)
        known = self.state_digests.get(source)
        spec = self.qmap[int(meta[QID_KEY])]
        key = self._key("quantized", init, known, spec) if known else None
        compute = lambda: _qparam_value(init, self.state, self.qmap, self.qvalues)  # noqa: E731
        return _Plan(init, compute, tensor.numel() * 4, key)

    def _key(self, kind: str, init: onnx.TensorProto, source: str, spec: QuantSpec) -> str:
        grid = [spec.bits, spec.signed, spec.qmin, spec.qmax, spec.axis, spec.block_size]
        values = self._qparams_digest(spec.qid)
        perm = _metadata(init).get(PERM_KEY)
        return digest_json([kind, init.data_type, list(init.dims), source, grid, values, perm])

    def _qparams_digest(self, qid: int) -> str:
        if qid not in self._qparam_digests:
            qp = _quant_values(qid, self.qvalues)
            self._qparam_digests[qid] = digest_json(
                [[str(t.dtype), list(t.shape), tensor_digest(t)] for t in (qp.scale, qp.zero_point)]
            )
        return self._qparam_digests[qid]


class _Memo:
    """The computed tensors of the last ``bind`` that knew its inputs' digests, by key.

    A key is a digest of every input of the computation (kind, dtype, dims, the state
    tensor's digest, the grid, the scale and zero point), so a hit is the value the
    computation would give; the arrays are read-only. One bind's worth is kept: what a bind
    does not use is let go."""

    _lock = threading.Lock()
    _entries: dict[str, tuple[np.ndarray, str]] = {}

    @classmethod
    def entries(cls) -> dict[str, tuple[np.ndarray, str]]:
        with cls._lock:
            return cls._entries

    @classmethod
    def keep(cls, entries: dict[str, tuple[np.ndarray, str]]) -> None:
        with cls._lock:
            cls._entries = entries

    @classmethod
    def clear(cls) -> None:
        cls.keep({})


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


def _qparam_value(
    init: onnx.TensorProto, state: Mapping[str, torch.Tensor], qmap: QuantMap, qvalues: QuantValues
) -> torch.Tensor:
    meta = _metadata(init)
    perm = meta.get(PERM_KEY)
    if perm is None:
        return _qparam_value_as_laid(init, meta, state, qmap, qvalues, tuple(init.dims))
    order = [int(a) for a in perm.split(",")]
    dims = tuple(init.dims)
    if sorted(order) != list(range(len(dims))):
        raise ExportError(f"'{init.name}': permutation {perm} does not fit dims {dims}")
    unpermuted = tuple(dims[order.index(i)] for i in range(len(dims)))
    value = _qparam_value_as_laid(init, meta, state, qmap, qvalues, unpermuted)
    return value.reshape(unpermuted).permute(order).contiguous()


def _qparam_value_as_laid(
    init: onnx.TensorProto,
    meta: Mapping[str, str],
    state: Mapping[str, torch.Tensor],
    qmap: QuantMap,
    qvalues: QuantValues,
    dims: tuple[int, ...],
) -> torch.Tensor:
    """The value of a qparams reference in the layout of the quantizer's tensor."""
    qid, role = int(meta[QID_KEY]), meta[ROLE_KEY]
    spec, qp = qmap[qid], _quant_values(qid, qvalues)
    if role in _LPBQ_ROLES:
        return _lpbq_value(init, spec, qp, role, dims)
    if role in ("scale", "zero_point"):
        value = qp.scale if role == "scale" else qp.zero_point
        if value.numel() != math.prod(dims):
            raise ExportError(
                f"quantizer {qid}: {role} has {value.numel()} values, '{init.name}' needs {dims}"
            )
        if role == "zero_point":
            value = _in_container(init, spec, value.detach())
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
        return torch.clamp(rounded_quotient(x, s, spec) + z, spec.qmin, spec.qmax)
    if role in ("bias", "bias_scale"):
        scale = _bias_scale(meta, qvalues, qp).reshape(dims if role == "bias_scale" else -1)
        if role == "bias_scale":
            return scale
        x = _state_tensor(meta[SOURCE_KEY], state).float()
        if scale.numel() not in (1, x.numel()):
            raise ExportError(
                f"'{init.name}': {scale.numel()} bias scales for a bias of {x.numel()} values"
            )
        q = torch.round(x / scale.reshape(-1) if scale.numel() > 1 else x / scale.reshape(()))
        return torch.clamp(q, -(2**31), 2**31 - 1).to(torch.int32)
    raise ExportError(f"initializer '{init.name}' has unknown graphbuild role '{role}'")


def _in_container(
    init: onnx.TensorProto, spec: QuantSpec, zero_point: torch.Tensor
) -> torch.Tensor:
    """The zero point as the initializer's container holds it: a signed grid in an unsigned
    container (or the other way round) is the same grid shifted by half the container."""
    dtype = ir.DataType(init.data_type)
    if dtype.is_signed() == spec.signed:
        return zero_point
    half = 2 ** (dtype.bitwidth - 1)
    return zero_point + half if spec.signed else zero_point - half


def _bias_scale(meta: Mapping[str, str], qvalues: QuantValues, x: QParams) -> torch.Tensor:
    """An int32 bias's scale: the input's (per-tensor) scale times the weight's, in float32."""
    if x.scale.numel() != 1:
        raise ExportError(f"quantizer {meta[QID_KEY]}: an int32 bias needs a per-tensor input")
    weight = _quant_values(int(meta[WEIGHT_QID_KEY]), qvalues)
    return x.scale.detach().float().reshape(()) * weight.scale.detach().float().reshape(-1)


_LPBQ_ROLES = ("block_int_scale", "channel_scale", "channel_zero_point")


def _lpbq_value(
    init: onnx.TensorProto, spec: QuantSpec, qp: QParams, role: str, dims: tuple[int, ...]
) -> torch.Tensor:
    """An LPBQ quantizer's integer block scales, per-channel float scales or the zero points
    of the latter (zeros)."""
    if role == "channel_zero_point":
        return torch.zeros(dims, dtype=torch.int64)
    value = qp.block_int_scale if role == "block_int_scale" else qp.channel_scale
    if value is None:
        raise ExportError(f"quantizer {spec.qid} has no LPBQ scales for '{init.name}'")
    if value.numel() != math.prod(dims):
        raise ExportError(
            f"quantizer {spec.qid}: {role} has {value.numel()} values, '{init.name}' needs {dims}"
        )
    return value.detach().reshape(dims)


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
    torch_dtype = _torch_dtype(init)
    if torch_dtype is None:  # int4/uint4 have no torch dtype: go through int64
        return value.detach().cpu().long().numpy().astype(dtype.numpy())
    if value.dtype != torch_dtype:
        if _is_state(init):
            raise ExportError(
                f"state tensor '{init.name}' is {value.dtype}, expected {torch_dtype}"
            )
        value = value.to(torch_dtype)
    return _torch_to_numpy(value.detach().cpu().contiguous(), dtype)


def _torch_dtype(init: onnx.TensorProto) -> torch.dtype | None:
    try:
        return tensor_adapters.to_torch_dtype(ir.DataType(init.data_type))
    except TypeError:
        return None


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
