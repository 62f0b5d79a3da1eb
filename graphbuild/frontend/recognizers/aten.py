"""ATen's fake-quant ops: the single-node forms and their decomposed ``cachemask`` forms."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from graphbuild.frontend.recognizers.helpers import _Layout, _match_from, op_parts
from graphbuild.frontend.recognizers.registry import Match


class FakeQuantRecognizer:
    """A single fake-quant node ``op(x, scale, zero_point, ...) -> Tensor``."""

    def __init__(self, namespace: str, name: str, overloads: Iterable[str], layout: _Layout):
        self.namespace, self.name = namespace, name
        self.overloads = frozenset(overloads)
        self.layout = layout

    def __repr__(self) -> str:
        return f"FakeQuantRecognizer({self.namespace}.{self.name})"

    def _accepts(self, node: Node) -> bool:
        parts = op_parts(node.target) if node.op == "call_function" else None
        return (
            parts is not None
            and parts == (self.namespace, self.name, parts[2])
            and (parts[2] in self.overloads)
        )

    def match(self, node: Node, program: ExportedProgram) -> Match | None:
        if not self._accepts(node):
            return None
        return _match_from(program, node, self.layout, (node,))


class CachemaskRecognizer(FakeQuantRecognizer):
    """The decomposed fake-quant form ``op(x, ...) -> (out, mask)`` read through getitem.

    ``run_decompositions`` produces it. Output 0 is the quantizer's output; the mask must be
    unused. The tensor-qparams variant takes a ``fake_quant_enabled`` tensor, accepted only
    when it is a constant ``full(..., 1)`` (a switch held in a buffer would make what the graph
    computes depend on that buffer's value).
    """

    def __repr__(self) -> str:
        return f"CachemaskRecognizer({self.namespace}.{self.name})"

    def match(self, node: Node, program: ExportedProgram) -> Match | None:
        if not self._accepts(node):
            return None
        getitems = list(node.users)
        for user in getitems:
            if user.target is not operator.getitem or user.args[1] not in (0, 1):
                return None
            if user.args[1] == 1 and user.users:
                return None
        enabled = self.layout.enabled
        if enabled is not None and not _is_constant_one(node.args[enabled]):
            return None
        return _match_from(program, node, self.layout, (node, *getitems))


def _is_constant_one(arg: Any) -> bool:
    """Whether ``arg`` is ``aten.full(shape, 1)`` (erased later if nothing else uses it)."""
    return isinstance(arg, Node) and arg.target is torch.ops.aten.full.default and arg.args[1] == 1
