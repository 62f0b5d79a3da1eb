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
