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

import time
from collections.abc import Iterable
from typing import Any

import networkx as nx

from graphbuild.cache.manifest import bytes_stored
from graphbuild.engine.artifact_store import CorruptEntry
from graphbuild.engine.events import EventKind, StageEvent
from graphbuild.engine.status import StageStatus

__all__ = ["LARGE_BYTES", "Readers", "let_go", "read_back"]

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


def let_go(run: Any, name: str) -> None:
    """Stage ``name`` of ``run`` (a scheduler run) settled: drop the rematerialized and the
    large stored outputs no stage left in the run reads. A checked stage keeps its output."""
    for done in run.readers.settled(name):
        _release(run, done)


def _release(run: Any, name: str) -> None:
    st = run.states[name]
    settled = st.record.status in (StageStatus.RAN, StageStatus.HIT, StageStatus.CUTOFF)
    if not (st.has_value and settled and st.record.digest is not None):
        return
    if name in run.check:
        return  # a checked hit keeps the value its check recomputed
    if run.pipeline._stage(name).rematerialize:
        run.tokens.forget([st.value])  # the input guard holds what it took tokens of
        st.value, st.has_value, st.released = None, False, True
    elif _large_and_stored(run, name):
        run.tokens.forget([st.value])
        st.value, st.has_value, st.spilled = None, False, True


def _large_and_stored(run: Any, name: str) -> bool:
    """Stage ``name``'s output is at least :data:`LARGE_BYTES` and the cache holds it whole
    (or will, once the writer gets to it)."""
    st = run.states[name]
    if run.cache is None or st.record.key is None:
        return False
    if (st.record.bytes or 0) < LARGE_BYTES:
        return False
    return st.stored or (st.manifest is not None and bytes_stored(st.manifest["artifact"]))


def read_back(run: Any, name: str) -> Any:
    """A large stored output ``run`` let go, loaded from the cache for one read, once the
    cache writer has stored it; not kept. An entry the cache no longer gives (its write
    failed, it was evicted or damaged, it is another output) is rebuilt."""
    st = run.states[name]
    rec = st.record
    t0 = time.perf_counter()
    try:
        with run.unlocked():
            if run.writer is not None:
                run.writer.wait()
            manifest = run.cache.lookup(rec.key, count=False)
            if manifest is None or manifest["artifact"].get("digest") != rec.digest:
                raise CorruptEntry(f"{name}: the cache holds no entry of this output")
            value = run.cache.load(manifest)
    except CorruptEntry as err:
        st.spilled = st.stored = False
        run._execute(name, reason=f"let go during the run, then {err}; rebuilt")
        if rec.status == StageStatus.FAILED:
            raise run.failure from err
        return st.value
    why = "read back from the cache: a large output, let go once no stage read it"
    run.emit(StageEvent(EventKind.LOADED, name, rec.key, time.perf_counter() - t0, why))
    return value
