"""The README's Python examples, run as written (a custom stage, a custom target/format)."""

from __future__ import annotations

import copy

import onnx

import graphbuild as gb
from examples import convnet
from graphbuild.onnx.bind import BoundModel
from graphbuild.targets.qnn import build_qnn_pipeline


def add_metadata(inputs, samples, context):
    (bound,) = inputs
    model = copy.deepcopy(bound.model)
    entry = model.metadata_props.add()
    entry.key, entry.value = "exported_by", context["model_name"]
    return BoundModel(model, bound.tensors)


def factory(request):
    p = build_qnn_pipeline(request, fmt="onnx")
    p.insert_stage_after("bind", add_metadata, "add_metadata", reads=("ctx.model_name",))
    p.products = ["add_metadata", "encodings"]
    return p


def test_custom_stage_after_bind_is_placed_and_cached(tmp_path):
    model, samples = convnet.build()
    options = gb.QnnOnnxOptions(quantizer="w8a8", calibration=convnet.calibration())
    cache = gb.Cache(tmp_path / "cache")
    art = gb.export(
        model,
        samples,
        tmp_path / "out",
        "convnet",
        options=options,
        pipeline_factory=factory,
        cache=cache,
    )
    props = {p.key: p.value for p in onnx.load(art.files["onnx"]).metadata_props}
    assert props["exported_by"] == "convnet"
    again = gb.export(
        model,
        samples,
        tmp_path / "out",
        "convnet",
        options=options,
        pipeline_factory=factory,
        cache=cache,
    )
    assert set(again.report.statuses.values()) == {"hit"}


def test_custom_target_format_through_the_registry(tmp_path):
    model, samples = convnet.build()
    registry = gb.build_default_registry()
    registry.register("qnn", "onnx_meta", factory)
    art = gb.export(
        model,
        samples,
        tmp_path,
        "m",
        format="onnx_meta",
        registry=registry,
        options=gb.QnnOnnxOptions(quantizer="w8a8", calibration=convnet.calibration()),
        cache=False,
    )
    assert art.files["onnx"].exists() and "add_metadata" in art.report.statuses
