"""Building aten nodes in a rewrite: each new node with its ``val`` meta computed on the
inputs' fake values (the rewritten graph is as annotated as the exporter's own), and the
small readers of a node's arguments and values the rewrites share."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

_SCALAR_PREFIX = "_qnn_scalar"


class _Emitter:
    """Creates nodes with their ``val`` meta computed on the inputs' fake values, so the
    rewritten graph is as annotated as the exporter's own."""

    def __init__(self, gm: GraphModule, fake_mode: Any) -> None:
        self.gm, self.graph, self.fake_mode = gm, gm.graph, fake_mode
        self.template: dict[str, Any] = {}
        self.count = sum(1 for n in gm.graph.nodes if str(n.target).startswith(_SCALAR_PREFIX))

    def like(self, node: Node) -> _Emitter:
        """Within the ``with`` block, new nodes carry ``node``'s module stack and trace."""
        self.template = {
            k: node.meta[k]
            for k in ("nn_module_stack", "stack_trace", "source_fn_stack")
            if k in node.meta
        }
        return self

    def __enter__(self) -> _Emitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.template = {}

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        node = self.graph.call_function(target, args, kwargs)
        node.meta.update(self.template)
        values = [_val(a) for a in args]
        kwvalues = {k: _val(v) for k, v in kwargs.items()}
        with self.fake_mode:
            node.meta["val"] = target(*values, **kwvalues)
        return node

    def constant(self, value: float, dtype: torch.dtype) -> Node:
        """A 0-d tensor constant (a get_attr of a new module attribute)."""
        name = f"{_SCALAR_PREFIX}_{self.count}"
        self.count += 1
        tensor = torch.tensor(value, dtype=dtype)
        setattr(self.gm, name, tensor)
        node = self.graph.create_node("get_attr", name)  # a plain tensor attribute
        node.meta.update(self.template)
        node.meta["val"] = self.fake_mode.from_tensor(tensor, static_shapes=True)
        return node

    def tensor(self, value: torch.Tensor) -> Node:
        """A tensor constant of ``value`` (a get_attr of a new module attribute)."""
        name = f"{_SCALAR_PREFIX}_{self.count}"
        self.count += 1
        tensor = value.detach().clone().contiguous()
        setattr(self.gm, name, tensor)
        node = self.graph.create_node("get_attr", name)
        node.meta.update(self.template)
        node.meta["val"] = self.fake_mode.from_tensor(tensor, static_shapes=True)
        return node


def _val(arg: Any) -> Any:
    if isinstance(arg, Node):
        return arg.meta["val"]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_val(a) for a in arg)
    return arg


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _float_val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) and val.is_floating_point() else None
