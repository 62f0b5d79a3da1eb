"""Quantizer values: scales and zero points read from a program, its state, or the model.

The marker graph carries none of them (docs/design.md, invariant 5); the quant map says where each
quantizer's values live (:class:`ValueRef`), and these functions read them: literal values
written into the graph itself (:func:`fixed_values`), a pre-quantized model's state
(:func:`qvalues_from`), or a PT2E-calibrated program (:func:`collect_qvalues`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from graphbuild.errors import ExportError
from graphbuild.frontend.recognizers import aten_name, get_arg, stored_tensor
from graphbuild.quant import lpbq
from graphbuild.quant.quantmap import QParams, QuantMap, QuantSpec, QuantValues, ValueRef

__all__ = [
    "VALUE_OPS",
    "collect_qvalues",
    "evaluate",
    "fixed_values",
    "lpbq_qparams",
    "qvalues_from",
]

#: The ATen ops (functional ``name.overload``) a ``computed`` value may use: pure arithmetic
#: on scales and offsets. Anything else is refused, so a quant map read from the cache can
#: make graphbuild call nothing but these (docs/design.md, invariant 7).
VALUE_OPS = frozenset(
    {
        "abs.default",
        "add.Scalar",
        "add.Tensor",
        "alias.default",
        "amax.default",
        "clamp.default",
        "clamp.Tensor",
        "clamp_max.default",
        "clamp_min.default",
        "clone.default",
        "detach.default",
        "div.Scalar",
        "div.Tensor",
        "expand.default",
        "full.default",
        "lift_fresh_copy.default",
        "maximum.default",
        "minimum.default",
        "mul.Scalar",
        "mul.Tensor",
        "neg.default",
        "reciprocal.default",
        "reshape.default",
        "round.default",
        "sub.Scalar",
        "sub.Tensor",
        "to.dtype",
        "view.default",
        "zeros_like.default",
        "_to_copy.default",
    }
)
_DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int32,
        torch.int64,
        torch.int8,
        torch.uint8,
    )
}


def _refs_in(expr: str) -> Iterator[ValueRef]:
    """The state and constant tensors a ``computed`` value reads."""
    for _, args, kwargs in json.loads(expr)["steps"]:
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, dict) and "ref" in arg:
                yield ValueRef(*arg["ref"])


def evaluate(expr: str, leaf: Callable[[ValueRef], torch.Tensor]) -> torch.Tensor:
    """The value of a ``computed`` :class:`ValueRef`: its steps run in order on CPU, the last
    one's result returned. ``leaf`` supplies the state and constant tensors it reads."""
    steps = json.loads(expr)["steps"]
    results: list[torch.Tensor] = []

    def decode(arg: Any) -> Any:
        if isinstance(arg, dict):
            if "step" in arg:
                return results[int(arg["step"])]
            if "ref" in arg:
                return leaf(ValueRef(*arg["ref"])).detach().cpu()
            if "dtype" in arg:
                return _DTYPES[arg["dtype"]]
            raise ExportError(f"computed quantizer value: unknown argument {arg!r}")
        if isinstance(arg, list):
            return [decode(a) for a in arg]
        return arg

    for op, args, kwargs in steps:
        if op not in VALUE_OPS:
            raise ExportError(f"computed quantizer value uses '{op}', which is not allowed")
        name, overload = op.split(".")
        fn = getattr(getattr(torch.ops.aten, name), overload)
        results.append(fn(*[decode(a) for a in args], **{k: decode(v) for k, v in kwargs.items()}))
    if not results:
        raise ExportError("computed quantizer value has no steps")
    return results[-1]


def _literal(ref: ValueRef, nodes: Mapping[str, Node]) -> torch.Tensor:
    node_name, _, index = ref.name.rpartition(":")
    node = nodes.get(node_name)
    value = get_arg(node, int(index)) if node is not None else None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ExportError(f"literal quantizer value '{ref.name}' not found in the program")
    dtype = torch.int64 if isinstance(value, int) else torch.float64
    if aten_name(node.target) == "full":  # a literal made into a tensor: keep its shape
        return torch.full(tuple(get_arg(node, 0)), value, dtype=dtype)
    return torch.tensor([value], dtype=dtype)


def _resolve(
    ref: ValueRef,
    program: ExportedProgram,
    nodes: Mapping[str, Node],
    state: Mapping[str, torch.Tensor] | None,
) -> torch.Tensor:
    if ref.kind == "literal":
        return _literal(ref, nodes)
    if ref.kind in ("state", "constant"):
        return stored_tensor(program, ref, state).detach()
    if ref.kind == "computed" and ref.expr is not None:
        return evaluate(ref.expr, lambda leaf: _resolve(leaf, program, nodes, state))
    raise ExportError(f"unknown value kind '{ref.kind}' for '{ref.name}'")


def _qparams(spec: QuantSpec, resolve: Callable[[ValueRef], torch.Tensor]) -> QParams:
    if spec.scale is None:
        raise ExportError(f"quantizer {spec.qid} has no scale source")
    scale = resolve(spec.scale).to(torch.float32)
    if spec.zero_point is None:
        zero_point = torch.zeros(scale.shape, dtype=torch.int64)
    else:
        zero_point = resolve(spec.zero_point)
        if zero_point.is_floating_point():
            zero_point = zero_point.round()
            if spec.zero_point.kind != "computed":  # learnable fake-quant: clamped as ATen does
                zero_point = zero_point.clamp(spec.qmin, spec.qmax)
        zero_point = zero_point.to(torch.int64)
    if spec.block_size is None:
        scale, zero_point = scale.reshape(-1), zero_point.reshape(-1)
    if spec.block_scale_bits is not None:
        return lpbq_qparams(spec, scale, zero_point)
    return QParams(scale.clone(), zero_point.clone())


def lpbq_qparams(spec: QuantSpec, scale: torch.Tensor, zero_point: torch.Tensor) -> QParams:
    """An LPBQ quantizer's values: its block scales compressed (:func:`lpbq.compress`; a
    model's own LPBQ scales come back unchanged), zero points 0 (LPBQ is symmetric)."""
    if bool((zero_point != 0).any()):
        raise ExportError(
            f"quantizer {spec.qid} ({spec.op} at {spec.node}) is LPBQ, which is symmetric, "
            f"but has non-zero zero points"
        )
    if spec.axis is None:
        raise ExportError(f"quantizer {spec.qid} is LPBQ but has no block axis")
    ints, channel, effective = lpbq.compress(scale, spec.axis, int(spec.block_scale_bits))
    zeros = torch.zeros(effective.shape, dtype=torch.int64)
    return QParams(effective, zeros, channel, ints)


def _ref_key(ref: ValueRef) -> str:
    return f"{ref.kind}:{ref.name}"


def fixed_values(program: ExportedProgram, qmap: QuantMap) -> dict[str, torch.Tensor]:
    """The quantizer values written into the graph itself (literals, lifted constants), by
    ``kind:name``: part of the code, so a stage can carry them without the program."""
    nodes = {n.name: n for n in program.graph.nodes}
    refs = [r for s in qmap for r in (s.scale, s.zero_point) if r is not None]
    leaves = [r for r in refs if r.kind != "computed"]
    leaves += [leaf for r in refs if r.kind == "computed" and r.expr for leaf in _refs_in(r.expr)]
    return {
        _ref_key(r): _resolve(r, program, nodes, None).clone() for r in leaves if r.kind != "state"
    }


def qvalues_from(
    qmap: QuantMap, fixed: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]
) -> QuantValues:
    """Scales and zero points from the model's state (parameters and buffers, by name) and
    the values :func:`fixed_values` took from the graph."""

    def resolve(ref: ValueRef) -> torch.Tensor:
        if ref.kind == "computed" and ref.expr is not None:
            return evaluate(ref.expr, resolve)
        if ref.kind != "state":
            return fixed[_ref_key(ref)]
        if ref.name not in state:
            raise ExportError(
                f"the model has no parameter or buffer '{ref.name}' holding a quantizer value"
            )
        return state[ref.name].detach()

    return QuantValues({s.qid: _qparams(s, resolve) for s in qmap})


def collect_qvalues(
    program: ExportedProgram,
    qmap: QuantMap,
    state: Mapping[str, torch.Tensor] | None = None,
) -> QuantValues:
    """Scales (float32) and zero points (int64) of every quantizer in ``qmap``.

    ``program`` is the program *before* normalization (literals live in its nodes). ``state``,
    when given, supplies parameters and buffers instead of ``program.state_dict``.
    """
    nodes = {n.name: n for n in program.graph.nodes}
    return QuantValues(
        {s.qid: _qparams(s, lambda ref: _resolve(ref, program, nodes, state)) for s in qmap}
    )
