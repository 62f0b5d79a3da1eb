"""``export_with_pipeline(request, pipeline)``: the user's own pipeline object, built and
edited before the export, is what runs and what places the files; a wrong argument is an
``ArgumentTypeError`` that says what goes where, before anything runs or is written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphbuild as gb
from graphbuild.engine.codecs import FileArtifact
from graphbuild.engine.pipeline import Pipeline
from graphbuild.errors import ArgumentTypeError


def _weights(model, samples, ctx):  # a root stage gets the pipeline input itself
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _note(inputs, samples, ctx):
    total = sum(float(v.double().sum()) for v in inputs[0].values())
    return FileArtifact(f"{ctx['model_name']}.txt", f"sum {total:.6f}\n".encode())


def _shout(inputs, samples, ctx):
    (note,) = inputs
    return FileArtifact(note.name, note.data.upper())


def note_pipeline(model_name: str) -> Pipeline:
    """weights (input.state) -> note: a text file placed as ``<model_name>.txt``."""
    p = Pipeline(name="note")
    w = p.register_stage(_weights, "weights", reads=("input.state",))
    p.register_stage(_note, "note", reads=("ctx.model_name",)).depends_on(w)
    p.products = ["note"]
    p.output_files = frozenset({f"{model_name}.txt"})
    return p


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _request(tmp_path, **kw) -> gb.ExportRequest:
    return gb.ExportRequest(
        model=_model(),
        data=(),
        output_directory=tmp_path / "out",
        model_name="net",
        target="note",
        format="file",
        cache=tmp_path / "cache",
        **kw,
    )


def test_the_pipeline_given_is_the_one_that_runs_and_places_the_files(tmp_path):
    model = _model()
    total = sum(float(v.double().sum()) for v in model.state_dict().values())
    pipeline = note_pipeline("net")
    pipeline.insert_stage_after(
        "note", _shout, "shout", reads=()
    )  # edited by the user before export
    pipeline.products = ["shout"]

    art = gb.export_with_pipeline(_request(tmp_path), pipeline)

    assert art.pipeline_name == "note"
    assert art.files["txt"].read_text() == f"SUM {total:.6f}\n"
    assert art.report.statuses == {"weights": "ran", "note": "ran", "shout": "ran"}
    again = gb.export_with_pipeline(_request(tmp_path), pipeline)
    assert set(again.report.statuses.values()) == {"hit"}


def test_without_a_pipeline_the_requests_factory_builds_it(tmp_path):
    request = _request(tmp_path, pipeline_factory=lambda r: note_pipeline(r.model_name))

    art = gb.export_with_pipeline(request)

    assert art.files["txt"].read_text().startswith("sum ")


def test_a_factory_given_as_the_pipeline_is_refused_with_where_it_goes(tmp_path):
    with pytest.raises(ArgumentTypeError, match=r"pipeline must be a graphbuild Pipeline.*"
                       r"pipeline_factory"):  # fmt: skip
        gb.export_with_pipeline(_request(tmp_path), lambda r: note_pipeline(r.model_name))
    assert not (tmp_path / "out").exists()


def test_the_arguments_in_the_wrong_order_are_refused(tmp_path):
    with pytest.raises(ArgumentTypeError, match=r"ExportRequest first.*pipeline goes second"):
        gb.export_with_pipeline(note_pipeline("net"), _request(tmp_path))
    assert not (tmp_path / "out").exists()


def test_a_pipeline_and_a_factory_together_are_refused(tmp_path):
    request = _request(tmp_path, pipeline_factory=lambda r: note_pipeline(r.model_name))

    with pytest.raises(ArgumentTypeError, match="both a pipeline and the request's"):
        gb.export_with_pipeline(request, note_pipeline("net"))
    assert not (tmp_path / "out").exists()


def test_the_pipeline_given_decides_what_the_inputs_may_be(tmp_path):
    """A built-in target's pipeline traces the model on its sample inputs, so it refuses
    data=None; a pipeline of your own that reads no samples takes it."""
    request = gb.ExportRequest(
        model=_model(), data=None, output_directory=tmp_path / "out", model_name="net",
        cache=False,
    )  # fmt: skip

    with pytest.raises(ArgumentTypeError, match="sample inputs"):
        gb.export_with_pipeline(request)
    art = gb.export_with_pipeline(request, note_pipeline("net"))

    assert art.files["txt"].read_text().startswith("sum ")


def test_an_export_returns_the_reports_its_pipeline_declares(tmp_path):
    """No stage name is a report by convention: ``pipeline.reports`` names them all."""

    def check_numerics(inputs, samples, ctx):
        return {"summary": "checked"}

    pipeline = note_pipeline("net")
    pipeline.register_stage(check_numerics, "check_numerics", reads=()).depends_on("weights")
    undeclared = gb.export_with_pipeline(_request(tmp_path), pipeline)
    pipeline.reports["numerics"] = "check_numerics"
    declared = gb.export_with_pipeline(_request(tmp_path), pipeline)

    assert "numerics" not in undeclared.report.extra
    assert declared.report.extra["numerics"] == {"summary": "checked"}
