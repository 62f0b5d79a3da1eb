"""What an llm export with a preset holds while it runs: one part's calibration recording and
one part's bound weights at a time, not every part's at once (an LLM's parts add up to the
model again, and the recording's past KV to more), and the same files as a run that keeps
everything."""

from __future__ import annotations

import gc
import hashlib
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from graphbuild.engine import scheduler
from graphbuild.engine.events import EventKind, StageEvent
from graphbuild.targets.qnn.llm import stages
from tests.llm_models import causal_lm, export_llm

pytest.importorskip("transformers", reason="builds transformers causal LMs (the dev extra)")

#: an embedding part, then two parts of two decoder layers (the LM head in the last)
GEOMETRY = dict(prompt_len=4, context_len=32, parts=3)
CALIBRATION = [torch.tensor([[5, 17, 33, 9, 100, 42, 7, 64, 3, 11, 12, 13]])]
PRESET = dict(GEOMETRY, quantizer="w8a16", calibration=CALIBRATION, calibration_steps=4)


class LiveAt:
    """Weak references to the tensors and arrays a stage function returned, per part; and,
    when stage ``at(i)`` starts, which earlier parts' ones are still alive."""

    def __init__(self, at: str) -> None:
        self.at = at
        self.refs: dict[int, list[weakref.ref]] = {}
        self.alive: dict[str, list[int]] = {}

    def track(self, index: int, objects: list[Any]) -> None:
        self.refs.setdefault(index, []).extend(weakref.ref(o) for o in objects)

    def __call__(self, event: StageEvent) -> None:
        if event.kind is not EventKind.STARTED or not event.stage.endswith(self.at):
            return
        gc.collect()
        self.alive[event.stage] = [
            i for i, refs in sorted(self.refs.items()) if any(r() is not None for r in refs)
        ]


def _export_one_stage_at_a_time(tmp_path: Path, live: LiveAt) -> None:
    """The preset export of a 4-layer Qwen2 watched by ``live``, one stage at a time: what is
    alive when each part starts is then fixed."""
    export_llm(
        causal_lm("qwen2", layers=4),
        tmp_path / "out",
        tmp_path / "c",
        PRESET,
        listeners=[live],
        jobs=1,
    )


def test_a_parts_calibration_recording_is_let_go_before_the_next_part_is_traced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = LiveAt(".prompt.capture")
    part_batches = stages.part_batches

    def tracked(index: int, kind: str, *args: Any) -> list:
        batches = part_batches(index, kind, *args)
        live.track(index, [t for batch in batches for t in batch])
        return batches

    monkeypatch.setattr(stages, "part_batches", tracked)
    _export_one_stage_at_a_time(tmp_path, live)
    assert sorted(live.refs) == [1, 2, 3]
    # part 1 is traced after the recording was sliced; each part's share then goes with it
    assert live.alive == {
        "p1.prompt.capture": [1, 2, 3],
        "p2.prompt.capture": [2, 3],
        "p3.prompt.capture": [3],
    }


def test_a_parts_bound_weights_are_let_go_before_the_part_after_next_is_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights a preset binds (fake-quantized copies, one part's worth of the model) go
    once the part's graphs are built; binding keeps the last part's for its token graph."""
    live = LiveAt(".prompt.bind")
    kv_graph = stages.kv_graph

    def tracked(index: int, kind: str, *args: Any) -> dict:
        graphs = kv_graph(index, kind, *args)
        computed = [
            a
            for bound in graphs.values()
            for a in bound.tensors.values()
            if isinstance(a, np.ndarray) and not a.flags.writeable and a.size >= 64
        ]
        live.track(index, computed)
        return graphs

    monkeypatch.setattr(stages, "kv_graph", tracked)
    _export_one_stage_at_a_time(tmp_path, live)
    assert sorted(live.refs) == [1, 2, 3]  # every part bound computed weights
    assert live.alive["p3.prompt.bind"] == [2]


def _digests(out: Path) -> dict[str, str]:
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*.onnx"))
    }


def test_the_files_are_those_of_a_run_that_keeps_every_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The placed graphs of the one-at-a-time run, which lets rematerialized outputs go and
    recomputes them to place them, are the bytes of a run that keeps every stage's output to
    its end."""
    model = causal_lm("qwen2", layers=4)
    export_llm(model, tmp_path / "seq", tmp_path / "c1", PRESET, jobs=1)
    with monkeypatch.context() as keeping:
        keeping.setattr(scheduler._Run, "let_go", lambda run, name: None)
        export_llm(model, tmp_path / "kept", tmp_path / "c2", PRESET, jobs=1)
    seq = _digests(tmp_path / "seq")
    assert len(seq) == 6 + 1  # prompt and token graphs of three parts, the position processor
    assert seq == _digests(tmp_path / "kept")


def test_placing_the_float_graphs_reads_no_copy_of_their_weights_back_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float part graph holds the model's own weights: placing it recomputes it from them,
    as the quantized part graphs are, rather than loading a copy of the part's weights from
    the cache, however large it is."""
    monkeypatch.setattr("graphbuild.engine.release.LARGE_BYTES", 1)
    events: list[StageEvent] = []
    model = causal_lm("llama", layers=4)
    export_llm(model, tmp_path / "out", tmp_path / "cache", GEOMETRY, listeners=[events.append])
    placed = [e for e in events if e.kind is EventKind.LOADED and e.stage.endswith(".float.graph")]
    assert placed, "the float graphs are placed from what the run let go"
    assert all(e.reason.startswith("recomputed") for e in placed), [e.reason for e in placed]


@pytest.mark.slow  # two cold exports of three parts: about 30 s on two cores
def test_two_jobs_that_let_outputs_go_place_the_one_at_a_time_runs_files(tmp_path: Path) -> None:
    """Parts built at once let their recordings and bound weights go as they settle too, and
    place the same bytes."""
    model = causal_lm("qwen2", layers=4)
    export_llm(model, tmp_path / "seq", tmp_path / "c1", PRESET, jobs=1)
    export_llm(model, tmp_path / "par", tmp_path / "c2", PRESET, jobs=2)
    seq = _digests(tmp_path / "seq")
    assert len(seq) == 6 + 1
    assert seq == _digests(tmp_path / "par")
