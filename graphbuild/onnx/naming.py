"""Fresh tensor and node names for graph rewrites."""

from __future__ import annotations

import onnx_ir as ir


def fresh_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``... whichever is not in ``taken``; records it."""
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


class Namer:
    """Hands out tensor and node names not yet used anywhere in ``graph`` (its subgraphs
    included). The names in use are collected once; a rewrite asks this for every name it
    adds, so each stays unique however many it adds."""

    def __init__(self, graph: ir.Graph):
        self.taken: set[str] = {v.name for v in (*graph.inputs, *graph.outputs) if v.name}
        self.taken.update(graph.initializers)
        for node in ir.traversal.RecursiveGraphIterator(graph):
            if node.name:
                self.taken.add(node.name)
            self.taken.update(
                v.name for v in (*node.inputs, *node.outputs) if v is not None and v.name
            )

    def fresh(self, base: str) -> str:
        return fresh_name(base, self.taken)
