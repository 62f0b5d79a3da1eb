"""One build's independent stages at once (``jobs``): the keys, outputs and report of a
sequential run, stages overlapping in time, within the declared memory budget."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch

from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.events import EventKind
from graphbuild.engine.pipeline import Pipeline
from graphbuild.errors import PipelineError, StageError
from tests.engine_helpers import DECODES, Box, Recorder, reset
from tests.process_memory import TreeRss, tree_rss

#: bytes each part stage declares, and what it is doing now (measured inside the stages)
PART_BYTES = 100
RUNNING = {"bytes": 0, "peak": 0}
LOCK = threading.Lock()


@pytest.fixture(autouse=True)
def _clean():
    reset()
    RUNNING.update(bytes=0, peak=0)
    yield
    reset()


def _source(model, samples, ctx):
    return Box(f"source {ctx['seed']}")


def _part(index):
    def part(inputs, samples, ctx):
        with LOCK:
            RUNNING["bytes"] += PART_BYTES
            RUNNING["peak"] = max(RUNNING["peak"], RUNNING["bytes"])
        try:
            time.sleep(0.3)  # releases the GIL, as torch kernels and child processes do
            if ctx["fail"] == index:
                raise ValueError(f"part {index} fails")
            return Box(f"{inputs[0].text} / part {index}")
        finally:
            with LOCK:
                RUNNING["bytes"] -= PART_BYTES

    return part


def _join(inputs, samples, ctx):
    return Box(" + ".join(b.text for b in inputs))


def _pipeline(parts: int = 4, memory: int | None = PART_BYTES, part=_part) -> Pipeline:
    """``source`` -> ``p1``..``pN`` (independent, each ``part(i)`` declaring ``memory``) ->
    ``join``."""
    p = Pipeline(name="parts")
    p.register_stage(_source, "source", reads=("ctx.seed",))
    names = []
    for i in range(1, parts + 1):
        ref = p.register_stage(part(i), f"p{i}", reads=("ctx.fail",)).depends_on("source")
        if memory:
            p.declare_cost(ref, memory=memory)
        names.append(ref.name)
    p.register_stage(_join, "join", reads=()).depends_on(*names)
    return p


def _run(p, cache, jobs=1, memory=None, **ctx):
    rec = Recorder()
    result = p.run(
        None,
        (),
        context={"seed": 1, "fail": 0, **ctx},
        cache=cache,
        listeners=[rec],
        jobs=jobs,
        memory=memory,
    )
    return result, rec


def _overlapping(timeline, names) -> int:
    """The most of ``names`` whose timeline spans overlap at one instant."""
    spans = [(e["start"], e["end"]) for e in timeline if e["stage"] in names]
    return max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)


def test_two_jobs_give_the_sequential_runs_keys_outputs_and_report(tmp_path):
    seq, _ = _run(_pipeline(), Cache(tmp_path / "seq"))
    par, _ = _run(_pipeline(), Cache(tmp_path / "par"), jobs=2)

    assert par.outputs["join"] == seq.outputs["join"]
    for a, b in zip(seq.report.stages, par.report.stages, strict=True):
        assert (a.name, a.status, a.key, a.digest) == (b.name, b.status, b.key, b.digest)
    assert par.report.ran == seq.report.ran == ["source", "p1", "p2", "p3", "p4", "join"]


def test_independent_stages_overlap_in_time_and_the_timeline_says_where(tmp_path):
    seq, _ = _run(_pipeline(memory=None), Cache(tmp_path / "seq"))
    par, rec = _run(_pipeline(memory=None), Cache(tmp_path / "par"), jobs=4)

    parts = {"p1", "p2", "p3", "p4"}
    assert _overlapping(seq.report.timeline, parts) == 1
    assert _overlapping(par.report.timeline, parts) == 4
    assert RUNNING["peak"] == 4 * PART_BYTES
    assert par.report.seconds < seq.report.seconds - 0.5  # 4 x 0.3 s in about 0.3 s
    workers = {e["worker"] for e in par.report.timeline if e["stage"] in parts}
    assert len(workers) == 4
    started = [e for e in rec.events if e.kind is EventKind.STARTED]
    assert all(e.worker for e in started)
    assert par.report.to_json()["timeline"] == par.report.timeline


def test_the_memory_budget_bounds_what_runs_at_once(tmp_path):
    result, _ = _run(_pipeline(), Cache(tmp_path / "c"), jobs=4, memory=2 * PART_BYTES + 50)

    assert RUNNING["peak"] == 2 * PART_BYTES  # measured inside the stages
    assert _overlapping(result.report.timeline, {"p1", "p2", "p3", "p4"}) == 2
    assert result.report.ran == ["source", "p1", "p2", "p3", "p4", "join"]


def test_a_stage_over_the_budget_runs_alone_rather_than_never(tmp_path):
    result, _ = _run(_pipeline(), Cache(tmp_path / "c"), jobs=4, memory=PART_BYTES // 2)

    assert RUNNING["peak"] == PART_BYTES
    assert result.report["join"].status == "ran"


def test_a_failed_stage_skips_its_dependents_and_reports_as_a_sequential_run(tmp_path):
    with pytest.raises(StageError) as seq:
        _run(_pipeline(), Cache(tmp_path / "seq"), fail=2)
    with pytest.raises(StageError) as par:
        _run(_pipeline(), Cache(tmp_path / "par"), jobs=3, fail=2)

    assert par.value.stage == seq.value.stage == "p2"
    assert par.value.report.statuses == seq.value.report.statuses
    assert par.value.report["join"].reason == "upstream 'p2' did not complete"


def test_a_hit_two_concurrent_stages_need_is_loaded_once(tmp_path):
    cache = Cache(tmp_path / "c")
    _run(_pipeline(), cache, jobs=4)
    DECODES.clear()

    result, rec = _run(_pipeline(), cache, jobs=4, fail=-1)  # every part reruns, source hits

    assert result.report["source"].status == "hit"
    assert rec.of(EventKind.LOADED) == ["source"]
    assert DECODES == ["source 1"]


def test_a_warm_run_with_jobs_is_all_hits(tmp_path):
    cache = Cache(tmp_path / "c")
    _run(_pipeline(), cache, jobs=2)
    result, _ = _run(_pipeline(), cache, jobs=2)

    assert result.report.ran == []
    assert len(result.report.hits) == 6
    assert result.outputs["p3"] == Box("source 1 / part 3")  # loaded after the run


def test_a_declared_cost_must_be_a_size_and_a_core_count():
    p = _pipeline(memory=None)
    with pytest.raises(PipelineError, match="memory >= 0"):
        p.declare_cost("p1", memory=-1)
    assert p.cost("p1").memory == 0 and p.cost("p1").cores == 1


def test_an_exclusive_stage_runs_with_nothing_beside_it(tmp_path):
    p = _pipeline(memory=None)
    p.declare_cost("p2", exclusive=True)

    result, _ = _run(p, Cache(tmp_path / "c"), jobs=4)

    timeline = {e["stage"]: (e["start"], e["end"]) for e in result.report.timeline}
    start, end = timeline["p2"]
    others = [s for s in ("p1", "p3", "p4") if timeline[s][0] < end and start < timeline[s][1]]
    assert others == []
    assert _overlapping(result.report.timeline, {"p1", "p3", "p4"}) >= 2


#: what each stage of the resident-memory test allocates and touches
HELD_BYTES = 96 * 2**20


#: how many holding stages hold their bytes now; each waits (up to a second) for all four,
#: so those that run at once hold at once however slowly a loaded machine starts them
HOLDING = threading.Condition()
HOLDERS = {"now": 0}


def _holding(index):
    def part(inputs, samples, ctx):
        held = bytearray(b"\x01") * HELD_BYTES  # written: every page resident
        with HOLDING:
            HOLDERS["now"] += 1
            HOLDING.notify_all()
            HOLDING.wait_for(lambda: HOLDERS["now"] >= 4, timeout=1.0)
        return Box(f"{inputs[0].text} / part {index} held {held[-1]}")

    return part


def _resident_growth(tmp_path, name, **resources) -> int:
    """Bytes the process's resident memory grew by at most while the pipeline ran."""
    gc.collect()
    HOLDERS["now"] = 0
    before = tree_rss(os.getpid())
    with TreeRss(interval=0.01) as measured:
        _run(_pipeline(memory=HELD_BYTES, part=_holding), Cache(tmp_path / name), **resources)
    return measured.peak - before


def test_the_memory_budget_bounds_the_resident_memory_of_four_parts(tmp_path):
    """Four stages that each hold what they declare: four jobs hold about four at once, a
    budget of two parts' bytes keeps the process's measured peak to about two."""
    unbounded = _resident_growth(tmp_path, "unbounded", jobs=4)
    bounded = _resident_growth(tmp_path, "bounded", jobs=4, memory=2 * HELD_BYTES)

    assert unbounded > 3 * HELD_BYTES  # the sampling sees the stages' memory
    assert bounded <= 2 * HELD_BYTES + 32 * 2**20  # the budget, and a little of the engine's


def test_a_stage_whose_work_is_apart_runs_beside_one_that_runs_alone(tmp_path):
    """A tracing stage runs alone among the stages that work in this process; a stage whose
    work is in a child process (an HTP context preparation) runs beside it."""
    p = Pipeline(name="apart")
    p.register_stage(_source, "source", reads=("ctx.seed",))
    for i, kind in enumerate(("trace", "prepare", "near"), start=1):
        ref = p.register_stage(_part(i), kind, reads=("ctx.fail",)).depends_on("source")
        p.declare_cost(ref, exclusive=kind == "trace", apart=kind == "prepare")

    result, _ = _run(p, Cache(tmp_path / "c"), jobs=3)

    timeline = result.report.timeline
    assert _overlapping(timeline, {"trace", "prepare"}) == 2
    assert _overlapping(timeline, {"trace", "near"}) == 1


def test_a_stage_cannot_be_both_alone_and_apart():
    p = Pipeline(name="both")
    p.register_stage(_source, "source", reads=("ctx.seed",))

    with pytest.raises(PipelineError, match="exclusive and apart"):
        p.declare_cost("source", exclusive=True, apart=True)


#: weak references to the recordings ``_recording`` returned
RECORDINGS: list = []


def _recording(inputs, samples, ctx):
    value = torch.arange(1 << 16, dtype=torch.float32) * ctx["seed"]
    RECORDINGS.append(weakref.ref(value))
    return value


def _reading(index):
    def read(inputs, samples, ctx):
        time.sleep(0.1)  # the two readers run at once
        return Box(f"part {index}: {float(inputs[0].sum())}")

    return read


def _recording_pipeline(rematerialize: bool) -> Pipeline:
    """``record`` (large; ``rematerialize``: its digest cached) -> ``r1``, ``r2`` (read it at
    once) -> ``after`` (reads their outputs, not the recording)."""
    p = Pipeline(name="recording")
    p.register_stage(_recording, "record", reads=("ctx.seed",), rematerialize=rematerialize)
    for i in (1, 2):
        p.register_stage(_reading(i), f"r{i}", reads=()).depends_on("record")
    p.register_stage(_join, "after", reads=()).depends_on("r1", "r2")
    return p


def _recording_alive_when_after_starts(cache, jobs, rematerialize=True):
    RECORDINGS.clear()
    alive: list[bool] = []

    def listen(event):
        if event.stage == "after" and event.kind is EventKind.STARTED:
            gc.collect()
            alive.extend(r() is not None for r in RECORDINGS)

    result = _recording_pipeline(rematerialize).run(
        None, (), context={"seed": 3}, cache=cache, listeners=[listen], jobs=jobs
    )
    return alive, result


def test_two_jobs_let_go_of_a_rematerialized_output_no_stage_left_reads(tmp_path):
    """As a sequential run does: once its last reader settled, a rematerialized output is
    dropped before the run ends; a read after the run recomputes the same value, and the
    keys, digests and outputs are the sequential run's."""
    seq_alive, seq = _recording_alive_when_after_starts(Cache(tmp_path / "seq"), jobs=1)
    par_alive, par = _recording_alive_when_after_starts(Cache(tmp_path / "par"), jobs=2)

    assert seq_alive == [False]
    assert par_alive == [False]
    assert _overlapping(par.report.timeline, {"r1", "r2"}) == 2
    for a, b in zip(seq.report.stages, par.report.stages, strict=True):
        assert (a.name, a.status, a.key, a.digest) == (b.name, b.status, b.key, b.digest)
    assert par.outputs["after"] == seq.outputs["after"]
    assert bool((par.outputs["record"] == seq.outputs["record"]).all())


def test_two_jobs_let_go_of_a_large_stored_output_no_stage_left_reads(tmp_path, monkeypatch):
    """A stored output of at least ``release.LARGE_BYTES`` goes the same way, and is read back
    from the cache after the run."""
    monkeypatch.setattr("graphbuild.engine.release.LARGE_BYTES", 1 << 16)
    alive, result = _recording_alive_when_after_starts(Cache(tmp_path / "c"), 2, False)

    assert alive == [False]
    assert _overlapping(result.report.timeline, {"r1", "r2"}) == 2
    expected = torch.arange(1 << 16, dtype=torch.float32) * 3
    assert torch.equal(result.outputs["record"], expected)
    assert len(RECORDINGS) == 1  # read back, not recomputed
