"""docs/design.md's rerun table: after each kind of change, exactly these stages rerun."""

from __future__ import annotations

import copy

import pytest
import torch

import graphbuild as gb
from examples import convnet
from graphbuild.engine.scheduler import EventKind
from tests.models import BatchNormTrap, FakeQuantConvNet

SAMPLE = (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(3)),)
STRUCTURE = ("capture", "normalize", "to_onnx", "lower_markers")


def build(model, out, cache, fmt="onnx", events=None, **options):
    return gb.export(
        model,
        SAMPLE,
        out,
        "model",
        format=fmt,
        options=gb.QnnOnnxOptions(**options),
        cache=cache,
        listeners=[events.append] if events is not None else (),
    ).report


def hit(report, *stages):
    return all(report.statuses[s] in ("hit", "cutoff") for s in stages)


@pytest.fixture()
def warm(tmp_path):
    """A fake-quantized ConvNet exported once: the model, output dir and cache."""
    model = FakeQuantConvNet().eval()
    cache = gb.Cache(tmp_path / "cache")
    build(model, tmp_path / "out", cache)
    return model, tmp_path / "out", cache


def test_nothing_changed_reruns_nothing_and_loads_no_intermediate(warm):
    model, out, cache = warm
    events = []
    report = build(model, out, cache, events=events)
    assert set(report.statuses.values()) == {"hit"}
    loaded = {e.stage for e in events if e.kind is EventKind.LOADED}
    # the placed files are intact: nothing to read, nothing to write, but the coverage report
    # (a few lines of JSON the export prints and writes into the lock file)
    assert loaded <= {"coverage"}


def test_edited_output_file_is_restored_from_the_cache(warm):
    model, out, cache = warm
    onnx_path = out / "model.onnx"
    original = onnx_path.read_bytes()
    onnx_path.write_bytes(b"edited by hand")
    events = []
    report = build(model, out, cache, events=events)
    assert set(report.statuses.values()) == {"hit"}
    assert onnx_path.read_bytes() == original
    assert "bind" in {e.stage for e in events if e.kind is EventKind.LOADED}


def test_output_directory_moved_elsewhere_is_placed_again(warm, tmp_path):
    model, out, cache = warm
    report = build(model, tmp_path / "elsewhere", cache)
    assert set(report.statuses.values()) == {"hit"}
    for name in ("model.onnx", "model.encodings", "graphbuild.lock.json"):
        assert (tmp_path / "elsewhere" / name).read_bytes() == (out / name).read_bytes()


def test_check_fingerprints_recomputes_hits_and_accepts_matching_outputs(warm):
    model, out, cache = warm
    report = gb.export(model, SAMPLE, out, "model", cache=cache, check_fingerprints=True).report
    assert set(report.statuses.values()) == {"hit"}
    assert all("checked" in (s.reason or "") for s in report.stages)


def test_scales_only_rerun_values_stages_not_tracing(warm):
    model, out, cache = warm
    with torch.no_grad():
        model.a1_scale.mul_(1.5)
        model.conv2_w_scale.mul_(1.1)
    report = build(model, out, cache)
    assert hit(report, *STRUCTURE)
    assert report.statuses["qparams"] == "ran"
    assert report.statuses["bind"] == "ran"
    assert report.statuses["encodings"] == "ran"


def test_activation_scales_only_leave_the_bound_float_model_clean(warm):
    model, out, cache = warm
    with torch.no_grad():
        model.a2_scale.mul_(1.01)
    report = build(model, out, cache)
    assert hit(report, *STRUCTURE, "bind")  # weight_qparams reran: same weight scales
    assert report.statuses["encodings"] == "ran"


def test_weights_only_rerun_bind_not_tracing(warm):
    model, out, cache = warm
    with torch.no_grad():
        model.conv1.weight.add_(0.01)
    report = build(model, out, cache)
    assert hit(report, *STRUCTURE)
    assert report.statuses["bind"] == "ran"
    assert hit(report, "encodings")  # quantizer values unchanged: early cutoff


def test_encodings_version_reruns_encodings_only(warm):
    model, out, cache = warm
    report = build(model, out, cache, encodings_version="2.0.0")
    assert report.ran == ["encodings"]


def test_opset_reruns_to_onnx_and_after_keeps_capture_and_normalize(warm):
    model, out, cache = warm
    report = build(model, out, cache, opset=18)
    assert hit(report, "capture", "normalize", "qparams")
    assert report.statuses["to_onnx"] == "ran"
    assert "opset" in report["to_onnx"].reason


def test_io_names_rerun_to_onnx(warm):
    model, out, cache = warm
    report = build(model, out, cache, input_names=["image"], output_names=["logits"])
    assert hit(report, "capture", "normalize")
    assert report.statuses["to_onnx"] == "ran"


def test_onnx_to_onnx_qdq_reruns_format_stages_only(warm):
    model, out, cache = warm
    report = build(model, out, cache, fmt="onnx_qdq")
    assert hit(report, "capture", "normalize", "to_onnx", "qparams")
    assert report.statuses["lower_markers"] == "ran"
    assert report.statuses["bind"] == "ran"


def test_structure_change_reruns_from_capture(warm):
    model, out, cache = warm
    changed = copy.deepcopy(model)
    changed.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)  # module tree changes
    report = build(changed, out, cache)
    assert report.statuses["capture"] == "ran"
    assert "input.structure" in report["capture"].reason


def test_bit_width_change_reruns_from_normalize(warm):
    model, out, cache = warm
    changed = copy.deepcopy(model)
    for name in ("x", "a1", "a2", "out"):
        getattr(changed, f"{name}_zp").clamp_(0, 15)
    changed.act = lambda x, name: torch.fake_quantize_per_tensor_affine(  # 4-bit activations
        x, getattr(changed, f"{name}_scale"), getattr(changed, f"{name}_zp"), 0, 15
    )
    report = build(changed, out, cache)
    assert report.statuses["capture"] == "ran"
    assert report.statuses["normalize"] == "ran"


def test_preset_weights_change_recalibrates_but_does_not_retrace(tmp_path):
    model, samples = convnet.build()
    cache = gb.Cache(tmp_path / "cache")
    opts = {"quantizer": "w8a8", "calibration": convnet.calibration()}
    build(model, tmp_path / "out", cache, **opts)
    with torch.no_grad():
        model.conv1.weight.mul_(1.1)
    report = build(model, tmp_path / "out", cache, **opts)
    assert hit(report, "capture", "place_quantizers", "marker_graph", "to_onnx", "lower_markers")
    assert report.statuses["weight_stats"] == report.statuses["calibrate"] == "ran"
    assert report.statuses["bind"] == "ran"


@pytest.fixture()
def preset_warm(tmp_path):
    """The ConvNet quantized by the w8a16 preset, exported once."""
    model, _ = convnet.build()
    cache = gb.Cache(tmp_path / "cache")
    opts = {"quantizer": "w8a16", "calibration": convnet.calibration(4, seed=1)}
    build(model, tmp_path / "out", cache, **opts)
    return model, tmp_path / "out", cache, opts


PLACEMENT = ("capture", "place_quantizers", "marker_graph", "to_onnx")


def test_preset_change_reruns_the_values_not_the_placement_nor_calibration(preset_warm):
    model, out, cache, opts = preset_warm
    report = build(model, out, cache, **{**opts, "quantizer": "w8a8"})
    assert hit(report, *PLACEMENT, "weight_stats", "calibrate", "left_float")
    assert report.statuses["quant_map"] == report.statuses["qparams"] == "ran"


def test_recalibration_reruns_the_forward_passes_nothing_structural(preset_warm):
    model, out, cache, opts = preset_warm
    report = build(model, out, cache, **{**opts, "calibration": convnet.calibration(4, seed=2)})
    assert hit(report, *PLACEMENT, "weight_stats", "quant_map")
    assert report.statuses["calibrate"] == report.statuses["qparams"] == "ran"


def test_a_bit_width_override_reruns_the_values_not_the_placement_nor_calibration(preset_warm):
    model, out, cache, opts = preset_warm
    report = build(model, out, cache, **opts, layer_overrides={"conv2": "w4"})
    assert hit(report, *PLACEMENT, "weight_stats", "calibrate")
    assert report.statuses["left_float"] == "ran"  # the same quantizers float: cut off
    assert report.statuses["quant_map"] == report.statuses["qparams"] == "ran"


def test_a_float_override_re_exports_the_onnx_graph_but_traces_and_calibrates_nothing(
    preset_warm,
):
    model, out, cache, opts = preset_warm
    report = build(model, out, cache, **opts, layer_overrides={"fc": "float"})
    assert hit(report, "capture", "place_quantizers", "weight_stats", "calibrate")
    assert report.statuses["left_float"] == report.statuses["to_onnx"] == "ran"


def test_range_method_reruns_the_values_histograms_once(preset_warm):
    model, out, cache, opts = preset_warm
    report = build(model, out, cache, **opts, range_method="percentile")
    assert hit(report, *PLACEMENT, "weight_stats")
    assert report.statuses["calibrate"] == "ran"  # histograms, collected once
    report = build(model, out, cache, **opts, range_method="mse")
    assert hit(report, *PLACEMENT, "weight_stats", "calibrate")
    assert report.statuses["qparams"] == "ran"


def test_batchnorm_trap_rebinds_correctly_after_weight_change(tmp_path):
    torch.manual_seed(0)
    model = BatchNormTrap().eval()
    cache = gb.Cache(tmp_path / "cache")
    build(model, tmp_path / "out", cache, check_numerics=True)
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
        model.conv.bias.uniform_(-0.3, 0.3)
    events = []
    report = build(model, tmp_path / "out", cache, events=events, check_numerics=True)
    assert hit(report, *STRUCTURE)
    assert report.statuses["bind"] == "ran"
    numerics = gb.export(
        model,
        SAMPLE,
        tmp_path / "out",
        "model",
        options=gb.QnnOnnxOptions(check_numerics=True),
        cache=cache,
    ).report.extra["numerics"]
    for out in numerics["outputs"]:
        assert out["max_error_steps"] <= 2


def test_int32_bias_option_reruns_encodings_only(warm):
    model, out, cache = warm
    report = build(model, out, cache, encodings_version="2.0.0", int32_bias=False)
    assert report.ran == ["encodings"]
