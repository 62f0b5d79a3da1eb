"""Which outputs a run may let go of as it goes.

A rematerialized stage's output (a calibration recording, weights bound into a graph) is large
and cheap to recompute, which is why the cache keeps its digest only. Held to the run's end,
an export in parts would hold every part's copy at once; so once the last stage of the run that
reads it has settled, the scheduler drops it, and a later read (placement,
``RunResult.outputs``) recomputes it and checks its digest. A stored output of at least
:data:`LARGE_BYTES` (an LLM part's context binary) is let go the same way when the run has a
cache, and a later read loads it back from the cache (rebuilding it if the cache lost it). A
run with ``jobs`` > 1 lets go as each stage settles, under the lock its bookkeeping is done
under: a stage's readers are its dependents, and none starts before it settled.
:class:`Readers` counts, for each stage, the stages of the run still to read its output.
"""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx

__all__ = ["LARGE_BYTES", "Readers"]

#: A stored output this large (encoded) is not held to the end of a run that has a cache: once
#: no stage of the run reads it, it is let go, and placing it reads it back from the cache.
LARGE_BYTES = 64 * 2**20


class Readers:
    """How many stages of one run still read each stage's output."""

    def __init__(self, graph: nx.DiGraph, order: Iterable[str]) -> None:
        members = set(order)
        self._graph = graph
        self._left = {n: sum(1 for d in graph.successors(n) if d in members) for n in members}

    def settled(self, name: str) -> list[str]:
        """Stage ``name`` settled: the stages (its upstream ones, then itself) whose output no
        stage left in the run reads."""
        done = []
        for dep in self._graph.predecessors(name):
            self._left[dep] -= 1
            if self._left[dep] == 0:
                done.append(dep)
        return [*done, name] if self._left[name] == 0 else done
