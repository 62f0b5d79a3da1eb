"""The public planning API: what would run and why, without running anything."""

from __future__ import annotations

import torch

import graphbuild as gb
from examples import convnet
from graphbuild.api import ExportRequest, build_pipeline
from graphbuild.engine.plan import explain_plan, plan


def _request(model, samples, cache):
    return ExportRequest(model, samples, "unused", "m", options={}, cache=cache)


def _plan_and_explain(model, samples, cache):
    request = _request(model, samples, cache)
    pipeline = build_pipeline(request)
    kwargs = dict(context=request.context(), cache=cache, run_id=request.run_id())
    return plan(pipeline, model, samples, **kwargs), explain_plan(
        pipeline, model, samples, **kwargs
    )


def test_plan_runs_nothing_and_explain_names_the_changed_read(tmp_path):
    from tests.models import FakeQuantConvNet

    model = FakeQuantConvNet().eval()
    samples = convnet.build()[1]
    cache = gb.Cache(tmp_path / "cache")
    gb.export(model, samples, tmp_path / "out", "m", cache=cache)
    with torch.no_grad():
        model.conv1.weight.add_(0.1)
    report, explained = _plan_and_explain(model, samples, cache)
    assert report.statuses["capture"] == "hit"
    assert report.statuses["weight_digests"] == "dirty"
    digests = next(s for s in explained if s["name"] == "weight_digests")
    assert [c["read"] for c in digests["changes"]] == ["input.state"]
    assert "conv1.weight" in str(digests["changes"])
    assert cache.last_run("qnn:m", "weight_digests")["status"] == "ran"  # from the export only


def test_explain_shows_no_code_change_for_a_hit_after_a_format_switch(tmp_path):
    """Exported as onnx_qdq after onnx, the onnx plan's stages that hit hit onnx's own
    entries: the qdq run's stage code is not this stage's, so no code change is listed."""
    model, samples = convnet.build()
    cache = gb.Cache(tmp_path / "cache")
    gb.export(model, samples, tmp_path / "out", "m", options={"quantizer": "w8a8"}, cache=cache)
    qdq = dict(format="onnx_qdq", options={"quantizer": "w8a8"}, cache=cache)
    gb.export(model, samples, tmp_path / "qdq", "m", **qdq)
    request = ExportRequest(
        model, samples, "unused", "m", options={"quantizer": "w8a8"}, cache=cache
    )
    pipeline = build_pipeline(request)
    kwargs = dict(context=request.context(), cache=cache, run_id=request.run_id())
    explained = {s["name"]: s for s in explain_plan(pipeline, model, samples, **kwargs)}
    lower = explained["lower_markers"]
    assert lower["status"] == "hit"
    assert "earlier run's entry" in lower["reason"]
    hits = [s for s in explained.values() if s["status"] == "hit"]
    # was: code: <qdq's lower_markers> -> <onnx's> on a stage that hits
    assert not [(s["name"], c) for s in hits for c in s["changes"] if c["read"] == "code"]
