"""The graph view the HTP rules read, and walking it.

A :class:`GraphView` is a graph as the rules of :mod:`graphbuild.targets.qnn.rules.plan` see
it: ONNX op types, tensor names, and which tensors are float, constant or graph inputs. Two adapters
build views (``onnx_view`` from an exported model, ``aten_view`` from a torch graph);
:class:`ViewWalk` answers the questions the rules ask of one (who reads a tensor, which
constant stands behind it, what a scalar holds).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GraphView", "OpNode", "ViewWalk", "view_from_json", "view_to_json"]


@dataclass(frozen=True)
class OpNode:
    """One op of a view. ``inputs`` may hold ``None`` for an absent optional input.
    ``depthwise`` marks a grouped convolution (never part of a supergroup), ``groups`` its
    group count; ``source`` says where the op came from (aten op and module), ``origin``
    names the torch node it lowers, for reports."""

    name: str
    op_type: str
    inputs: tuple[str | None, ...]
    outputs: tuple[str, ...]
    depthwise: bool = False
    groups: int = 1
    cast_from_float: bool = False
    source: str = ""
    origin: str = ""


@dataclass
class GraphView:
    """A graph as the rules see it: ops in topological order and what is known of tensors."""

    ops: list[OpNode]
    inputs: list[str]
    outputs: list[str]
    floats: set[str]
    constants: set[str]
    #: a constant that is the transposed form of another (MatMul weights through Transpose)
    transposed: dict[str, str] = field(default_factory=dict)
    #: the values of scalar constants, where known (pattern matching reads ``1`` and ``2``)
    scalars: dict[str, float] = field(default_factory=dict)

    def producers(self) -> dict[str, OpNode]:
        return {t: op for op in self.ops for t in op.outputs}

    def consumers(self) -> dict[str, list[OpNode]]:
        users: dict[str, list[OpNode]] = defaultdict(list)
        for op in self.ops:
            for t in op.inputs:
                if t is not None:
                    users[t].append(op)
        return users


def view_to_json(view: GraphView) -> dict[str, Any]:
    """``view`` as a JSON document (:func:`view_from_json` reads it back): what a stage
    stores of a view, so the rules run again on new bit-widths without rebuilding it."""
    return {
        "ops": [
            [
                op.name,
                op.op_type,
                list(op.inputs),
                list(op.outputs),
                op.depthwise,
                op.groups,
                op.cast_from_float,
                op.source,
                op.origin,
            ]
            for op in view.ops
        ],
        "inputs": list(view.inputs),
        "outputs": list(view.outputs),
        "floats": sorted(view.floats),
        "constants": sorted(view.constants),
        "transposed": dict(view.transposed),
        "scalars": {k: float(v) for k, v in view.scalars.items()},
    }


def view_from_json(doc: Mapping[str, Any]) -> GraphView:
    """The view :func:`view_to_json` wrote."""
    ops = [
        OpNode(name, op_type, tuple(inputs), tuple(outputs), *rest)
        for name, op_type, inputs, outputs, *rest in doc["ops"]
    ]
    return GraphView(
        ops,
        list(doc["inputs"]),
        list(doc["outputs"]),
        set(doc["floats"]),
        set(doc["constants"]),
        dict(doc["transposed"]),
        dict(doc["scalars"]),
    )


class ViewWalk:
    """A view with its producers, consumers and op order at hand."""

    def __init__(self, view: GraphView) -> None:
        self.view = view
        self.producers = view.producers()
        self.consumers = view.consumers()
        self.order = {op.name: i for i, op in enumerate(view.ops)}

    def constant(self, tensor: str | None) -> str | None:
        """The constant behind ``tensor`` (itself, or what a Transpose of a constant reads)."""
        if tensor is None:
            return None
        if tensor in self.view.constants:
            return tensor
        return self.view.transposed.get(tensor)

    def scalar(self, tensor: str | None) -> float | None:
        """The value of a scalar constant (None where unknown)."""
        return self.view.scalars.get(tensor) if tensor is not None else None

    def single_consumer(self, tensor: str) -> OpNode | None:
        users = self.consumers.get(tensor, [])
        return users[0] if len(users) == 1 else None

    def output_ops(self, op: OpNode) -> list[OpNode]:
        """The distinct ops reading ``op``'s outputs, in graph order."""
        users = {u.name: u for t in op.outputs for u in self.consumers.get(t, [])}
        return sorted(users.values(), key=lambda u: self.order[u.name])
