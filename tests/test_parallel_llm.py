"""An LLM export's parts built at once (``jobs``): the files, lock and stage runs of a
sequential export, byte for byte, within the memory budget its stages declare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphbuild.api import LOCK_FILE, ExportRequest, build_pipeline
from graphbuild.engine.codecs import encode, roundtrip
from graphbuild.engine.events import StageStatus
from graphbuild.targets.qnn.llm.costs import (
    context_bytes,
    generation_check_bytes,
    htp_check_bytes,
)
from graphbuild.targets.qnn.llm.stages import coverage_summary
from tests.llm_models import PROMPT, causal_lm, export_llm
from tests.test_llm_htp import needs_htp

pytest.importorskip("transformers", reason="builds transformers causal LMs (the dev extra)")

GEOMETRY = dict(prompt_len=4, context_len=32, parts=4)


def _export(model, out: Path, cache: Path, **kwargs):
    return export_llm(model, out, cache, GEOMETRY, **kwargs)


def _exclusive_stages(model, out: Path) -> set[str]:
    """The stages the LLM export's pipeline declares must run alone (the part captures...)."""
    request = ExportRequest(
        model, (torch.tensor([PROMPT]),), out, "lm", target="qnn", format="llm", options=GEOMETRY
    )
    pipeline = build_pipeline(request)
    return {name for name in pipeline.order() if pipeline.cost(name).exclusive}


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow  # two cold exports of four parts: about 100 s on two cores
def test_four_parts_with_two_jobs_give_the_sequential_files_lock_and_runs(tmp_path: Path) -> None:
    model = causal_lm("llama", layers=4)
    seq = _export(model, tmp_path / "seq", tmp_path / "cache-seq", jobs=1)
    par = _export(model, tmp_path / "par", tmp_path / "cache-par", jobs=2)

    seq_files, par_files = _files(tmp_path / "seq"), _files(tmp_path / "par")
    assert sorted(par_files) == sorted(seq_files)
    assert LOCK_FILE in par_files
    for name, data in seq_files.items():
        assert par_files[name] == data, f"{name} differs between -j 1 and -j 2"
    ran = [s.name for s in seq.report.stages if s.status is StageStatus.RAN]
    assert [s.name for s in par.report.stages if s.status is StageStatus.RAN] == ran
    captures = {f"p{i}.float.capture" for i in range(1, 5)}  # no preset: the float bundle
    assert captures <= set(ran)
    for a, b in zip(seq.report.stages, par.report.stages, strict=True):
        assert (a.name, a.key, a.digest) == (b.name, b.key, b.digest)
    exclusive = _exclusive_stages(model, tmp_path / "plan")
    assert captures <= exclusive
    spans = [(e["stage"], e["start"], e["end"]) for e in par.report.timeline]
    overlapping = [
        (a, b)
        for i, (a, a0, a1) in enumerate(spans)
        for b, b0, b1 in spans[i + 1 :]
        if a0 < b1 and b0 < a1
    ]
    assert any(a not in exclusive and b not in exclusive for a, b in overlapping)  # two at once
    assert not [(a, b) for a, b in overlapping if a in exclusive and b in exclusive]
    assert not [(a, b) for a, b in overlapping if a in exclusive or b in exclusive]  # alone


def test_the_coverage_summary_reads_alike_from_reports_built_here_or_read_from_the_cache():
    """The part graphs' coverage reports reach ``coverage`` fresh (built in this process) or
    decoded from the cache (a worker built them), where a dict's keys come back sorted."""
    fresh = {
        "expected": 2,
        "quantized": 1,
        "summary": "1/2 tensors",
        "float": [{"tensor": "add_1", "op": "Add", "reason": "the model has no quantizer here"}],
    }
    stored = roundtrip(fresh)
    assert list(stored["float"][0]) != list(fresh["float"][0])  # the cache's order

    def summary(report):
        return coverage_summary(("g",), (report,), None, None)

    assert summary(stored) == summary(fresh)
    assert encode(summary(stored)).digest == encode(summary(fresh)).digest


@pytest.mark.slow  # a cold export of four parts: about a minute on two cores
def test_a_budget_of_one_part_never_runs_two_parts_weights_at_once(tmp_path: Path) -> None:
    model = causal_lm("llama", layers=4)
    data = (torch.tensor([PROMPT]),)
    request = ExportRequest(
        model, data, tmp_path / "out", "lm", target="qnn", format="llm", options=GEOMETRY
    )
    pipeline = build_pipeline(request)
    costs = {name: pipeline.cost(name).memory for name in pipeline.order()}
    budget = max(m for name, m in costs.items() if name.startswith("p"))  # the largest part
    assert sum(1 for m in costs.values() if m) > 4 * 2  # every part graph's stages declare

    artifacts = _export(model, tmp_path / "out", tmp_path / "cache", jobs=4, memory=budget)

    spans = [(e["start"], e["end"], costs[e["stage"]]) for e in artifacts.report.timeline]
    for start, _, _ in spans:  # the declared memory running at each stage's start
        held = sum(m for s, e, m in spans if s <= start < e)
        assert held <= budget or sum(1 for s, e, m in spans if s <= start < e and m) == 1
    assert max(sum(1 for s, e, _ in spans if s <= t < e) for t, _, _ in spans) > 1  # not serial


#: A 4-part ``w8a16`` export with each part's v73 context.
CONTEXTS = {**GEOMETRY, "contexts": True, "htp_arch": "v73", "quantizer": "w8a16"}


def _with_contexts(out: Path, model: dict | None = None, **extra):
    """The pipeline of a :data:`CONTEXTS` export of ``causal_lm(**model)`` (default: Llama, 4
    layers; ``extra``: more options)."""
    options = {**CONTEXTS, **extra}
    data = (torch.tensor([PROMPT]),)
    lm = causal_lm(**(model or {"family": "llama", "layers": 4}))
    request = ExportRequest(lm, data, out, "lm", target="qnn", format="llm", options=options)
    return build_pipeline(request)


def test_each_parts_context_preparation_declares_what_its_child_process_holds(tmp_path):
    """A part's HTP context is prepared in a child process holding several times the part's
    weights (measured: bench_llm's parts): the budget counts that, not the part's bytes."""
    pipeline = _with_contexts(tmp_path)
    for i in range(1, 5):
        graph = pipeline.cost(f"p{i}.prompt.bind").memory  # the part's weight bytes
        assert graph > 0
        assert pipeline.cost(f"p{i}.context.v73").memory == context_bytes(graph)
        assert context_bytes(graph) > 4 * graph


def test_a_parts_contexts_are_prepared_before_the_next_part_is_built(tmp_path):
    """One stage at a time, a part's contexts come right after its graphs, so the part's
    bound graphs can be let go before the next part binds its own."""
    order = _with_contexts(tmp_path).order()
    for i in range(1, 4):
        assert order.index(f"p{i}.context.v73") < order.index(f"p{i + 1}.prompt.bind")


@pytest.mark.parametrize(
    ("option", "stage", "declared", "times"),
    [
        ("check_htp", "check_htp_v73", htp_check_bytes, 4),
        ("check_numerics", "check_generation", generation_check_bytes, 3),
    ],
)
def test_a_check_declares_what_it_holds_for_every_parts_graphs(
    tmp_path, option, stage, declared, times
):
    """--check-htp runs every part's graphs on onnxruntime's CPU, then compiles each on QNN's
    HTP simulator (a context per graph), in this process; check_numerics runs the whole CPU
    bundle with onnxruntime-genai in a child process. Both generate with the model here as the
    reference, so each declares several times the model's weights (measured), and is not
    ``apart``: a budget does not start it beside a part's context preparation it would not
    fit with."""
    pipeline = _with_contexts(tmp_path, contexts=False, **{option: True})
    weights = sum(pipeline.cost(f"p{i}.prompt.bind").memory for i in range(1, 5))
    cost = pipeline.cost(stage)
    assert cost.memory == declared(weights)
    assert declared(weights) > times * weights
    assert not cost.apart and not cost.exclusive


WORKER = Path(__file__).parent / "llm_budget_worker.py"
#: Wide enough that a part's context preparation holds several times what this process adds
#: (each child about 450 MiB: the part's 23 to 31 MiB of weights, onnxruntime and QNN)
WIDE = {"family": "llama", "layers": 4, "hidden": 512, "intermediate": 2048, "vocab": 8192}


def _prepare_contexts(tmp_path: Path, name: str, memory: int | None) -> dict:
    """Four jobs prepare the :data:`CONTEXTS` export's four contexts, its part graphs in the
    cache, in a process of its own (``tests/llm_budget_worker.py``): the resident bytes that
    process and its children grew by at most (``growth``), and the most preparations that ran
    at once (``at_once``)."""
    args = [str(tmp_path / name), "4", str(memory or "none"), json.dumps(WIDE)]
    done = subprocess.run(
        [sys.executable, str(WORKER), *args, json.dumps(CONTEXTS)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    measured = json.loads(done.stdout.splitlines()[-1])
    assert sorted(s for s in measured["ran"] if ".context." in s) == [
        f"p{i}.context.v73" for i in range(1, 5)
    ]  # the graphs were hits: every part's preparation was ready at once
    return measured


@needs_htp
@pytest.mark.slow  # two processes each export four parts, then prepare their contexts: ~80 s
def test_a_budget_of_one_context_bounds_the_measured_memory_of_four_preparations(tmp_path):
    """Four parts' contexts, each prepared in a child process that holds hundreds of MiB: four
    jobs prepare them at once; a budget of one preparation's declared bytes keeps the measured
    peak of the process and its children within that budget (measured, load 2.5: 498 and 509
    MiB against a bound of 716, 1042 MiB twice without the budget)."""
    pipeline = _with_contexts(tmp_path / "plan", WIDE)
    budget = max(pipeline.cost(f"p{i}.context.v73").memory for i in range(1, 5))
    bound = budget + 64 * 2**20  # and a little of this process's own (a part's graphs)

    bounded = _prepare_contexts(tmp_path, "bounded", budget)
    unbounded = _prepare_contexts(tmp_path, "unbounded", None)

    assert bounded["at_once"] == 1 and unbounded["at_once"] > 1
    assert bounded["growth"] <= bound
    assert unbounded["growth"] > bound  # the sampling sees the preparations that run at once
