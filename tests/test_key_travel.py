"""Keys that travel (docs/design.md, invariant 10): the same model, samples and options give the
same keys under another build of the same Python minor version and after installing an
extra; a program digests the same computed in the process or loaded from the cache; a fresh
process takes from the cache what it would otherwise parse again, and never a summary of a
file that has changed since.
"""

from __future__ import annotations

import collections
import importlib
import sys
import time
from pathlib import Path

import pytest
import torch

import graphbuild as gb
from examples import convnet, tiny_decoder
from graphbuild.api import build_pipeline
from graphbuild.engine import closure, source_memo, sources
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.codecs import decode, encode
from graphbuild.engine.pipeline import Pipeline
from graphbuild.engine.plan import stage_inputs
from graphbuild.frontend.programs import ProgramArtifact

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def qnn_inputs() -> dict:
    """What every stage's key covers (besides upstream outputs), for the plain-torch examples
    exported to both QNN formats, computed as a new process would."""
    closure.forget()
    out = {}
    for name, module in (("convnet", convnet), ("tiny_decoder", tiny_decoder)):
        model, samples = module.build()
        for fmt in ("onnx", "onnx_qdq"):
            options = gb.QnnOnnxOptions(quantizer="w8a16", calibration=module.calibration(2))
            request = gb.ExportRequest(model, samples, "unused", name, "qnn", fmt, options)
            pipeline = build_pipeline(request)
            out[f"{name} {fmt}"] = stage_inputs(pipeline, model, samples, context=request.context())
    return out


@pytest.fixture(autouse=True)
def _as_a_new_process():
    yield
    closure.forget()  # what a test made this process learn must not reach other tests


# --------------------------------------------------------------------------- the interpreter


def test_keys_depend_on_the_python_minor_version_not_on_its_build(monkeypatch):
    here = qnn_inputs()
    info = sys.version_info
    other = collections.namedtuple("version_info", "major minor micro releaselevel serial")(
        info.major, info.minor, info.micro + 7, "final", 0
    )
    monkeypatch.setattr(sys, "version_info", other)
    monkeypatch.setattr(
        sys, "version", f"{info.major}.{info.minor}.{info.micro + 7} (main, Jan  1 2020) [Clang 9]"
    )

    assert qnn_inputs() == here


# --------------------------------------------------------------------------- extras


def _extra_distributions() -> set[str]:
    """Every distribution an optional extra of graphbuild installs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for requirements in project["optional-dependencies"].values():
        for requirement in requirements:
            name = requirement.split(";")[0].strip()
            for stop in "<>=!~[ ":
                name = name.split(stop)[0]
            names.add(name)
    return names


def test_installing_an_extra_reruns_no_stage(tmp_path, monkeypatch):
    before = qnn_inputs()
    site = tmp_path / "site-packages"  # every extra, at a version nobody has installed
    for name in _extra_distributions():
        info = site / f"{name.replace('-', '_')}-999.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 999.0\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()

    after = qnn_inputs()

    assert sources.library_version("redis") == "redis 999.0"  # the new versions are seen
    assert after == before


# --------------------------------------------------------------------------- round trips


class Rotate(torch.nn.Module):
    """A rotary-style half swap: slices whose views start inside their storage."""

    def forward(self, x):
        return torch.cat([x[..., 4:], x[..., :4]], -1) * 2


def test_a_program_digests_the_same_computed_or_loaded():
    program = torch.export.export(Rotate(), (torch.randn(2, 8),))
    computed = encode(ProgramArtifact(program))
    parts = {p.digest: bytes(p.data) for p in computed.all_parts()}
    loaded = decode(computed.describe(), lambda digest, size: parts[digest])

    assert encode(loaded).digest == computed.digest


@pytest.mark.slow  # 15 s; test_differential forces stages over loaded upstreams by default
def test_the_llama_s_lock_after_forcing_marker_graph_equals_a_clean_export_s(tmp_path):
    pytest.importorskip("transformers", reason="the Llama example needs transformers")
    from examples import tiny_llama

    model, samples = tiny_llama.build(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    options = gb.QnnOnnxOptions(quantizer="w8a16", calibration=tiny_llama.calibration(1))
    cache = gb.Cache(tmp_path / "cache")
    clean = gb.export(model, samples, tmp_path / "clean", "llama", options=options, cache=cache)

    forced = gb.export(
        model, samples, tmp_path / "forced", "llama", options=options, cache=cache,
        force=["marker_graph"],
    )  # fmt: skip

    assert forced.report.statuses["marker_graph"] == "ran"
    assert forced.report.statuses["to_onnx"] == "cutoff"
    assert forced.lock == clean.lock


# --------------------------------------------------------------------------- a new process


def _weights(inputs, samples, context):
    import gb_travel_stage

    return gb_travel_stage.total(inputs)


def stage_pipeline() -> Pipeline:
    p = Pipeline(name="travel")
    p.register_stage(_weights, "weights", reads=("input.state",))
    return p


@pytest.fixture
def stage_module(tmp_path, monkeypatch):
    """A stage whose code lives in a file of its own, reaching a helper module."""
    (tmp_path / "gb_travel_stage.py").write_text(
        "from gb_travel_helper import scale\n\n\n"
        "def total(model):\n    return float(sum(t.sum() for t in model.state_dict().values()))"
        " * scale()\n"
    )
    helper = tmp_path / "gb_travel_helper.py"
    helper.write_text("def scale():\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    yield helper
    for name in ("gb_travel_stage", "gb_travel_helper"):
        sys.modules.pop(name, None)


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """The modules whose files a closure parses (rather than reads from the cache)."""
    seen: list[str] = []
    real = closure._parse_module
    monkeypatch.setattr(
        closure,
        "_parse_module",
        lambda source, path, name: seen.append(name) or real(source, path, name),
    )
    return seen


def settled_environment() -> None:
    """Wait until no ``sys.path`` directory was modified in the last seconds: until then its
    mtime cannot vouch for what is installed, and library versions are not kept."""
    deadline = time.monotonic() + 10
    while source_memo.environment_stamp() is None and time.monotonic() < deadline:
        time.sleep(0.2)


def test_a_new_process_reads_what_it_would_parse_from_the_cache(tmp_path, parses, monkeypatch):
    settled_environment()
    closure.forget()  # the first process
    model, samples = convnet.build()
    options = gb.QnnOnnxOptions(quantizer="w8a16", calibration=convnet.calibration(1))
    cache = gb.Cache(tmp_path / "cache")
    cold = gb.export(model, samples, tmp_path / "out", "net", options=options, cache=cache)
    closure.forget()  # a new process
    parses.clear()
    read_versions: list[str] = []
    real = sources._read_version
    monkeypatch.setattr(
        sources, "_read_version", lambda top: read_versions.append(top) or real(top)
    )
    code_digests: list[str] = []  # a file's code digest is kept like its summary
    digest = sources.source_code_digest
    monkeypatch.setattr(
        sources,
        "source_code_digest",
        lambda source, path="": code_digests.append(path) or digest(source, path),
    )

    warm = gb.export(model, samples, tmp_path / "out", "net", options=options, cache=cache)

    assert set(warm.report.statuses.values()) == {"hit"}
    assert warm.lock == cold.lock
    assert parses == [] and read_versions == []
    assert code_digests == []


def test_a_file_edited_since_is_parsed_again_and_its_stage_reruns(tmp_path, stage_module, parses):
    closure.forget()
    cache = Cache(tmp_path / "cache")
    model = torch.nn.Linear(2, 2)
    first = stage_pipeline().run(model, cache=cache)
    closure.forget()
    stage_module.write_text("def scale():\n    return 2.0\n")  # same size, same second
    for name in ("gb_travel_stage", "gb_travel_helper"):
        sys.modules.pop(name, None)
    parses.clear()

    second = stage_pipeline().run(model, cache=cache)

    assert second.report.statuses == {"weights": "ran"}
    assert second.outputs["weights"] == pytest.approx(2 * first.outputs["weights"])
    assert parses == ["gb_travel_helper"]


def test_a_damaged_summary_in_the_cache_is_parsed_again(tmp_path, stage_module, parses):
    closure.forget()
    cache = Cache(tmp_path / "cache")
    model = torch.nn.Linear(2, 2)
    stage_pipeline().run(model, cache=cache)
    index = cache.stores.index
    records = list(index.keys("memo:"))
    for key in records:
        record = index.get_json(key)
        if record["kind"] == "module":
            record["value"]["uses"] = {}  # forgets what the file uses; its digest says so
            index.set_json(key, record)
    closure.forget()
    parses.clear()

    again = stage_pipeline().run(model, cache=cache)

    assert again.report.statuses == {"weights": "hit"}
    assert "gb_travel_helper" in parses and "gb_travel_stage" in parses
