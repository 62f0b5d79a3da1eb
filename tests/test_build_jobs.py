"""``[build] jobs`` / ``memory``, ``-j``, and what a build with jobs shows: its running stages,
their workers, and the timeline in ``--json``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

import graphbuild as gb
from graphbuild.cli.progress import Progress
from graphbuild.config import load_config
from graphbuild.engine import concurrent
from graphbuild.engine.codecs import FileArtifact
from graphbuild.engine.concurrent import build_resources, default_jobs
from graphbuild.engine.events import EventKind, StageEvent
from graphbuild.engine.pipeline import Pipeline
from graphbuild.errors import ConfigError
from tests.test_cli import environment, invoke, invoke_json, write_config


def _config(tmp_path: Path, build: str):
    (tmp_path / "graphbuild.toml").write_text(f'model = "m.py:b"\n[build]\n{build}\n')
    return load_config(cwd=tmp_path)


def test_the_build_table_sets_jobs_and_a_memory_budget(tmp_path):
    cfg = _config(tmp_path, 'jobs = 3\nmemory = "2GiB"')
    assert (cfg.build_jobs, cfg.build_memory) == (3, 2 * 2**30)
    auto = _config(tmp_path, 'jobs = "auto"\nmemory = "auto"')
    assert (auto.build_jobs, auto.build_memory) == (0, None)
    unset = _config(tmp_path, "")
    assert (unset.build_jobs, unset.build_memory) == (None, None)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        ("jobs = 0", r"'build.jobs' must be a positive integer or \"auto\", got 0"),
        ('memory = "lots"', r"'build.memory' must be a size"),
        ("threads = 2", r"unknown key 'threads' in \[build\]"),
    ],
)
def test_bad_build_keys_are_refused_naming_the_key(tmp_path, build, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, build)


def test_only_a_pipeline_that_declares_its_stages_safe_runs_them_at_once():
    assert build_resources(4, None, parallel_safe=False) == (1, None)
    assert build_resources(4, 1000, parallel_safe=True) == (4, 1000)
    jobs, memory = build_resources(0, None, parallel_safe=True)  # auto
    assert jobs == default_jobs()
    assert memory is None if jobs == 1 else memory > 0


def test_by_default_a_safe_pipeline_gets_what_the_machines_cores_and_memory_allow(monkeypatch):
    monkeypatch.setattr(concurrent, "default_jobs", lambda: 3)
    monkeypatch.setattr(concurrent, "default_memory", lambda: 5000)
    assert build_resources(None, None, parallel_safe=True) == (3, 5000)
    assert build_resources(None, 1000, parallel_safe=True) == (3, 1000)  # [build] memory
    assert build_resources(1, None, parallel_safe=True) == (1, None)  # -j 1: one at a time
    assert build_resources(None, None, parallel_safe=False) == (1, None)


def _weights(model, samples, ctx):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _note(name):
    def note(inputs, samples, ctx):
        time.sleep(0.3)  # releases the GIL, as torch kernels do
        total = sum(float(v.double().sum()) for v in inputs[0].values())
        return FileArtifact(f"{name}.txt", f"{name} {total:.6f}\n".encode())

    note.__name__ = name
    return note


def _two_notes(parallel_safe: bool) -> Pipeline:
    """weights -> ``a``, ``b``: two independent stages, each a file."""
    p = Pipeline(name="notes")
    p.register_stage(_weights, "weights", reads=("input.state",))
    for name in ("a", "b"):
        p.register_stage(_note(name), name, reads=()).depends_on("weights")
    p.products = ["a", "b"]
    p.output_files = frozenset({"a.txt", "b.txt"})
    p.parallel_safe = parallel_safe
    return p


def _overlap(tmp_path: Path, name: str, parallel_safe: bool = True, **kw) -> bool:
    """Whether stages ``a`` and ``b`` of a cold export of :func:`_two_notes` overlapped."""
    torch.manual_seed(0)
    request = gb.ExportRequest(
        model=torch.nn.Linear(4, 2),
        data=(),
        output_directory=tmp_path / name,
        model_name="net",
        target="note",
        format="file",
        cache=tmp_path / f"cache-{name}",
        **kw,
    )
    art = gb.export_with_pipeline(request, _two_notes(parallel_safe))
    (a0, a1), (b0, b1) = (
        next((e["start"], e["end"]) for e in art.report.timeline if e["stage"] == s)
        for s in ("a", "b")
    )
    return a0 < b1 and b0 < a1


def test_an_export_given_no_jobs_builds_a_safe_pipelines_stages_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(concurrent, "default_jobs", lambda: 2)  # whatever this machine has
    assert _overlap(tmp_path, "default")
    assert not _overlap(tmp_path, "one", jobs=1)
    assert not _overlap(tmp_path, "unsafe", parallel_safe=False)


def test_progress_names_each_running_stage_and_its_worker():
    console = Console(record=True, width=120, force_terminal=False)
    progress = Progress(console)
    with progress:
        progress(StageEvent(EventKind.STARTED, "p1.prompt.capture", worker="7/0"))
        progress(StageEvent(EventKind.STARTED, "p2.prompt.capture", worker="7/1"))
        assert progress._running == {"p1.prompt.capture": "7/0", "p2.prompt.capture": "7/1"}
        assert progress._running_lines().count("running…") == 2
        progress(StageEvent(EventKind.RAN, "p2.prompt.capture", seconds=1.5, worker="7/1"))
    assert progress._running == {"p1.prompt.capture": "7/0"}
    assert "p2.prompt.capture ran        1.50 s  on 7/1" in console.export_text()


def test_jobs_on_the_command_line_are_checked(tmp_path):
    write_config(tmp_path / "project")
    with environment(tmp_path / "project", tmp_path / "cache"):
        out = invoke("export", "-j", "none", code=2)
    assert "--jobs must be a positive count or 'auto'" in out.stderr


def test_the_json_report_has_the_timeline_of_every_stage(tmp_path):
    write_config(tmp_path / "project")
    with environment(tmp_path / "project", tmp_path / "cache"):
        doc = invoke_json("export", "-j", "2")
    names = [s["name"] for s in doc["stages"]]
    assert sorted(e["stage"] for e in doc["timeline"]) == sorted(names)
    for entry in doc["timeline"]:
        assert set(entry) == {"stage", "worker", "start", "end", "status"}
        assert 0 <= entry["start"] <= entry["end"]
