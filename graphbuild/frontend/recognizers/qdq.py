"""``quantized_decomposed`` quantize/dequantize pairs, as PT2E's ``convert_pt2e`` leaves them."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from graphbuild.frontend.recognizers.helpers import (
    _Layout,
    _match_from,
    _same_arg,
    get_arg,
    op_parts,
)
from graphbuild.frontend.recognizers.registry import Match


class QDQPairRecognizer:
    """``quantize(x, ...)`` whose users are all ``dequantize(q, <same args>)`` nodes.

    The quantize and every dequantize become one marker (convert_pt2e may duplicate
    dequantize nodes per consumer). Overloads pair by name (``tensor`` with ``tensor``).
    """

    def __init__(self, namespace: str, quantize: str, dequantize: str, layout: _Layout):
        self.namespace, self.quantize, self.dequantize = namespace, quantize, dequantize
        self.layout = layout

    def __repr__(self) -> str:
        return f"QDQPairRecognizer({self.namespace}.{self.quantize}/{self.dequantize})"

    def match(self, node: Node, program: ExportedProgram) -> Match | None:
        parts = op_parts(node.target) if node.op == "call_function" else None
        if parts is None or parts[:2] != (self.namespace, self.quantize):
            return None
        dtype = get_arg(node, self.layout.dtype) if self.layout.dtype is not None else None
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            return None
        dequants = list(node.users)
        if not dequants or not all(self._pairs(node, dq, parts[2]) for dq in dequants):
            return None
        return _match_from(program, node, self.layout, (node, *dequants))

    def _pairs(self, q: Node, dq: Node, overload: str) -> bool:
        parts = op_parts(dq.target) if dq.op == "call_function" else None
        if parts != (self.namespace, self.dequantize, overload) or dq.args[0] is not q:
            return False
        if dq.kwargs.get("out_dtype") is not None:
            return False
        positions = self.layout.positions()
        return all(_same_arg(get_arg(q, i), get_arg(dq, i)) for i in positions)


class QDQGroupRecognizer(QDQPairRecognizer):
    """``quantize_per_channel_group(x, scales, zero_points, qmin, qmax, dtype, group_size)``
    whose users are all ``dequantize_per_channel_group`` with the same arguments: a 2-D
    tensor quantized in blocks of ``group_size`` along its last axis (one scale per row and
    block; torch's decomposed op multiplies by the scale's reciprocal)."""

    GROUP = 6

    def __init__(self) -> None:
        super().__init__(
            "quantized_decomposed",
            "quantize_per_channel_group",
            "dequantize_per_channel_group",
            _Layout(dtype=5),
        )

    def match(self, node: Node, program: ExportedProgram) -> Match | None:
        found = super().match(node, program)
        group = get_arg(node, self.GROUP)
        val = found.input.meta.get("val") if found is not None else None
        if found is None or not isinstance(group, int) or not isinstance(val, torch.Tensor):
            return None
        if val.dim() != 2 or group <= 1 or val.shape[-1] % group:
            return None
        return replace(found, axis=1, block_size=group)

    def _pairs(self, q: Node, dq: Node, overload: str) -> bool:
        return super()._pairs(q, dq, overload) and _same_arg(
            get_arg(q, self.GROUP), get_arg(dq, self.GROUP)
        )
