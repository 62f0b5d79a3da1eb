"""Quantizer values: scales and zero points read from a program, its state, or the model.

The marker graph carries none of them (DESIGN.md, invariant 5); the quant map says where each
quantizer's values live (:class:`ValueRef`), and these functions read them: literal values
written into the graph itself (:func:`fixed_values`), a pre-quantized model's state
(:func:`qvalues_from`), or a PT2E-calibrated program (:func:`collect_qvalues`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from graphbuild.errors import ExportError
from graphbuild.frontend.quantmap import QParams, QuantMap, QuantSpec, QuantValues, ValueRef
from graphbuild.frontend.recognizers import aten_name, get_arg, stored_tensor

__all__ = [
    "collect_qvalues",
    "fixed_values",
    "qvalues_from",
]


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
    raise ExportError(f"unknown value kind '{ref.kind}' for '{ref.name}'")


def _qparams(spec: QuantSpec, resolve: Callable[[ValueRef], torch.Tensor]) -> QParams:
    if spec.scale is None:
        raise ExportError(f"quantizer {spec.qid} has no scale source")
    scale = resolve(spec.scale).to(torch.float32)
    if spec.zero_point is None:
        zero_point = torch.zeros(scale.shape, dtype=torch.int64)
    else:
        zero_point = resolve(spec.zero_point)
        if zero_point.is_floating_point():  # learnable fake-quant: rounded, clamped as ATen does
            zero_point = zero_point.round().clamp(spec.qmin, spec.qmax)
        zero_point = zero_point.to(torch.int64)
    if spec.block_size is None:
        scale, zero_point = scale.reshape(-1), zero_point.reshape(-1)
    return QParams(scale.clone(), zero_point.clone())


def _ref_key(ref: ValueRef) -> str:
    return f"{ref.kind}:{ref.name}"


def fixed_values(program: ExportedProgram, qmap: QuantMap) -> dict[str, torch.Tensor]:
    """The quantizer values written into the graph itself (literals, lifted constants), by
    ``kind:name``: part of the code, so a stage can carry them without the program."""
    nodes = {n.name: n for n in program.graph.nodes}
    refs = [r for s in qmap for r in (s.scale, s.zero_point) if r is not None]
    return {
        _ref_key(r): _resolve(r, program, nodes, None).clone() for r in refs if r.kind != "state"
    }


def qvalues_from(
    qmap: QuantMap, fixed: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]
) -> QuantValues:
    """Scales and zero points from the model's state (parameters and buffers, by name) and
    the values :func:`fixed_values` took from the graph."""

    def resolve(ref: ValueRef) -> torch.Tensor:
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
