"""Retuning a preset export: quantization is structure, then statistics, then values
(docs/design.md, invariant 13).

A preset change and a range method change recompute values only (no trace, no calibration
pass), a recalibration reruns the forward passes and nothing structural, a weight change
re-collects the statistics it affects; every export equals, byte for byte, an uncached one
and the one-stage PT2E pipeline the split replaced (``build_qnn_pipeline(one_stage_oracle=True)``,
generated here as the golden).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import graphbuild as gb
from examples import tiny_decoder
from graphbuild.engine.plan import explain_plan
from graphbuild.errors import ConfigError, ExportError, StageError
from graphbuild.frontend import statistics
from graphbuild.targets.qnn import build_qnn_pipeline

STRUCTURE = ("capture", "place_quantizers", "placement", "marker_graph", "to_onnx", "htp_view")


def one_stage(request):
    """The pipeline before the split: PT2E prepare, calibrate, convert and re-export as one
    ``quantize`` stage, then ``normalize``."""
    return build_qnn_pipeline(request, one_stage_oracle=True)


def export(model, samples, out, cache, *, fmt="onnx", factory=None, **options):
    art = gb.export(
        model,
        samples,
        out,
        "m",
        format=fmt,
        options=gb.QnnOnnxOptions(**options),
        cache=cache,
        pipeline_factory=factory,
    )
    return art


def files(art) -> dict[str, bytes]:
    return {k: Path(v).read_bytes() for k, v in art.files.items() if k != "lock"}


@contextlib.contextmanager
def no_trace_no_calibration(monkeypatch):
    """Within the block, tracing (torch.export, the ONNX exporter) and running calibration
    batches fail loudly."""

    def refuse(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} ran")

        return fail

    with monkeypatch.context() as patch:
        patch.setattr(torch.export, "export", refuse("torch.export.export"))
        patch.setattr(torch.onnx, "export", refuse("torch.onnx.export"))
        patch.setattr(statistics, "calibrate", refuse("a calibration pass"))
        yield


def no_trace(monkeypatch):
    for target, what in ((torch.export, "torch.export.export"), (torch.onnx, "torch.onnx.export")):
        monkeypatch.setattr(target, "export", lambda *a, _w=what, **k: pytest.fail(f"{_w} ran"))


class BatchNormNet(nn.Module):
    """Conv + BatchNorm (with and without a conv bias), ReLU, a linear head: PT2E folds each
    BatchNorm into its convolution, a value the split recomputes from the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(x, 1))


def batchnorm_net(seed: int = 0) -> tuple[nn.Module, tuple, list]:
    torch.manual_seed(seed)
    model = BatchNormNet()
    with torch.no_grad():  # running statistics that are not the identity
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(1, 3, 8, 8, generator=g),) for _ in range(3)]
    return model.eval(), (torch.randn(1, 3, 8, 8, generator=g),), batches


def decoder_calibration(seed: int) -> list:
    return tiny_decoder.calibration(3, seed)


# --------------------------------------------------------------------------- the retune loop


@pytest.fixture(scope="module")
def retuned(tmp_path_factory):
    """The tiny decoder (its -inf mask leaves quantizers float) exported with w8a16, then
    retuned step by step in one cache; each step also exported without a cache."""
    monkeypatch = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("retune")
    cache = gb.Cache(root / "cache")
    model, samples = tiny_decoder.build()
    first, second = decoder_calibration(1), decoder_calibration(2)
    steps = {
        "cold": dict(quantizer="w8a16", calibration=first),
        "preset": dict(quantizer="w8a8", calibration=first),
        "recalibration": dict(quantizer="w8a8", calibration=second),
        "histograms": dict(quantizer="w8a8", calibration=second, range_method="percentile"),
        "range": dict(quantizer="w8a8", calibration=second, range_method="mse"),
    }
    guards = {
        "preset": lambda: no_trace_no_calibration(monkeypatch),
        "range": lambda: no_trace_no_calibration(monkeypatch),
        "recalibration": lambda: _no_trace(monkeypatch),
        "histograms": lambda: _no_trace(monkeypatch),
    }
    out = SimpleNamespace(arts={}, files={})
    try:
        for name, options in steps.items():
            out.arts[f"{name}.explain"] = _explain(model, samples, cache, options)
            with guards.get(name, contextlib.nullcontext)():
                out.arts[name] = export(model, samples, root / "out", cache, **options)
            out.files[name] = files(out.arts[name])  # the next step rewrites root / "out"
            if name in UNCACHED:
                uncached = export(model, samples, root / name, False, **options)
                out.files[f"{name}.uncached"] = files(uncached)
    finally:
        monkeypatch.undo()
    return out


@contextlib.contextmanager
def _no_trace(monkeypatch):
    with monkeypatch.context() as patch:
        no_trace(patch)
        yield


def _explain(model, samples, cache, options) -> dict:
    """``explain`` before the export of ``options``: what changed since the last run."""
    request = gb.ExportRequest(
        model, samples, "unused", "m", options=gb.QnnOnnxOptions(**options), cache=cache
    )
    from graphbuild.api import build_pipeline

    return {
        s["name"]: s
        for s in explain_plan(
            build_pipeline(request),
            model,
            samples,
            context=request.context(),
            cache=cache,
            run_id=request.run_id(),
        )
    }


def statuses(art) -> dict[str, str]:
    return dict(art.report.statuses)


def test_a_preset_change_recomputes_values_only(retuned):
    s = statuses(retuned.arts["preset"])
    assert {n: s[n] for n in (*STRUCTURE, "calibrate", "weight_stats")} == dict.fromkeys(
        (*STRUCTURE, "calibrate", "weight_stats"), "hit"
    )
    assert s["quant_map"] == s["qparams"] == "ran"
    assert retuned.arts["preset"].report["qparams"].reason == "ctx.quantizer: w8a16 -> w8a8"


def test_a_recalibration_reruns_the_forward_passes_and_nothing_structural(retuned):
    s = statuses(retuned.arts["recalibration"])
    assert s["calibrate"] == "ran" and s["qparams"] == "ran"
    assert "ctx.calibration" in retuned.arts["recalibration"].report["calibrate"].reason
    assert all(s[n] in ("hit", "cutoff") for n in (*STRUCTURE, "weight_stats"))
    # the same quantizers stay float: the marker graph is cut off, not rebuilt
    assert s["left_float"] == "ran" and s["marker_graph"] == "cutoff"


def test_histograms_are_collected_once_then_range_methods_are_values(retuned):
    s = statuses(retuned.arts["histograms"])
    assert s["calibrate"] == "ran"  # percentile needs histograms: one calibration pass
    assert (
        "ctx.statistics: minmax -> histogram"
        in retuned.arts["histograms"].report["calibrate"].reason
    )
    s = statuses(retuned.arts["range"])
    assert s["calibrate"] == "hit" and s["qparams"] == "ran"  # percentile -> mse: values
    assert all(s[n] == "hit" for n in STRUCTURE)


def test_explain_says_which_part_of_quantization_reran_and_why(retuned):
    preset = retuned.arts["preset.explain"]
    assert preset["place_quantizers"]["reason"] == "unchanged since the last run"
    assert preset["calibrate"]["reason"] == "unchanged since the last run"
    assert preset["qparams"]["changes"] == [
        {"read": "ctx.quantizer", "old": "w8a16", "new": "w8a8"}
    ]
    recalibration = retuned.arts["recalibration.explain"]
    assert recalibration["place_quantizers"]["reason"] == "unchanged since the last run"
    assert [c["read"] for c in recalibration["calibrate"]["changes"]] == ["ctx.calibration"]
    assert recalibration["qparams"]["status"] == "maybe"  # values follow the statistics


#: steps also exported without a cache (the preset sequence of tests/test_differential.py
#: compares presets, calibration and weights against uncached and one-stage exports)
UNCACHED = ("histograms", "range")


@pytest.mark.parametrize("step", UNCACHED)
def test_a_range_method_export_equals_an_uncached_one(retuned, step):
    assert retuned.files[step] == retuned.files[f"{step}.uncached"]


def test_range_methods_change_the_activation_encodings_not_the_weights(retuned):
    import json

    docs = {
        step: json.loads(retuned.files[step]["encodings"])
        for step in ("recalibration", "histograms", "range")
    }

    def section(doc, name):
        return {e["name"]: (e["scale"], e["offset"]) for e in doc[name]}

    weights = {step: section(doc, "param_encodings") for step, doc in docs.items()}
    assert weights["recalibration"] == weights["histograms"] == weights["range"]
    acts = {step: section(doc, "activation_encodings") for step, doc in docs.items()}
    assert acts["recalibration"] != acts["histograms"] != acts["range"]
    assert docs["range"]["quantizer_args"]["quant_scheme"] == "tf_enhanced"
    assert docs["histograms"]["quantizer_args"]["quant_scheme"] == "percentile"
    assert docs["recalibration"]["quantizer_args"]["quant_scheme"] == "min_max"


# --------------------------------------------------------------------------- the golden


@pytest.mark.parametrize(
    ("which", "preset", "fmt"),
    [
        ("decoder", "w8a16", "onnx"),
        pytest.param("decoder", "w4a16", "onnx_qdq", marks=pytest.mark.slow),
        ("batchnorm", "w8a8", "onnx_qdq"),
        pytest.param("batchnorm", "w4a16", "onnx", marks=pytest.mark.slow),
    ],
)
def test_the_split_writes_what_the_one_stage_pipeline_writes(tmp_path, which, preset, fmt):
    if which == "decoder":
        model, samples = tiny_decoder.build()
        batches = decoder_calibration(1)
    else:
        model, samples, batches = batchnorm_net()
    options = dict(quantizer=preset, calibration=batches, check_numerics=True)
    split = export(model, samples, tmp_path / "split", False, fmt=fmt, **options)
    golden = export(model, samples, tmp_path / "one", False, fmt=fmt, factory=one_stage, **options)
    assert "place_quantizers" in split.report.statuses
    assert "quantize" in golden.report.statuses
    assert files(split) == files(golden)
    assert split.report.extra["numerics"] == golden.report.extra["numerics"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["onnx", "onnx_qdq"])
@pytest.mark.parametrize("preset", ["w8a8", "w8a16", "w4a16"])
@pytest.mark.parametrize("name", ["resnet", "mobilenetv3", "bert", "gpt2", "llama", "vit"])
def test_the_zoo_splits_to_what_the_one_stage_pipeline_writes(tmp_path, name, preset, fmt):
    pytest.importorskip("transformers", reason="the zoo's transformer models need it")
    from tests import zoo

    model, samples = zoo.build(name)
    options = dict(quantizer=preset, calibration=zoo.calibration(name, 2))
    split = export(model, samples, tmp_path / "split", False, fmt=fmt, **options)
    golden = export(model, samples, tmp_path / "one", False, fmt=fmt, factory=one_stage, **options)
    assert files(split) == files(golden)


def test_a_weight_change_refolds_and_recollects_statistics_but_keeps_the_placement(
    tmp_path, monkeypatch
):
    model, samples, batches = batchnorm_net()
    options = dict(quantizer="w8a16", calibration=batches)
    cache = gb.Cache(tmp_path / "cache")
    export(model, samples, tmp_path / "out", cache, **options)
    with torch.no_grad():
        model.bn2.running_var.mul_(1.5)  # a folded weight changes, no model weight read as is
    with monkeypatch.context() as patch:
        no_trace(patch)
        art = export(model, samples, tmp_path / "out", cache, **options)
    s = statuses(art)
    assert all(s[n] in ("hit", "cutoff") for n in STRUCTURE), s
    assert s["fold_weights"] == s["weight_stats"] == s["calibrate"] == "ran"
    assert s["bind"] == "ran"
    golden = export(model, samples, tmp_path / "one", False, factory=one_stage, **options)
    assert files(art) == files(golden)


# --------------------------------------------------------------------------- calibration that cannot calibrate


def test_an_empty_calibration_set_is_refused():
    with pytest.raises(ConfigError, match="calibration is empty"):
        gb.QnnOnnxOptions(quantizer="w8a8", calibration=[])
    with pytest.raises(ConfigError, match="calibration is empty"):
        gb.QnnOnnxOptions(quantizer="w8a8", calibration=iter([])).to_context()


def test_an_empty_calibration_set_is_refused_by_the_executorch_target_too():
    from graphbuild.targets.executorch.options import ExecuTorchOptions

    with pytest.raises(ConfigError, match="calibration is empty"):
        ExecuTorchOptions(recipe="int8_static", calibration=[])


def test_a_calibration_batch_holding_nan_is_refused_naming_it(tmp_path):
    model, samples, batches = batchnorm_net()
    batches[1][0][0, 0, 0, 0] = float("nan")
    with pytest.raises(StageError) as err:
        export(model, samples, tmp_path / "out", False, quantizer="w8a8", calibration=batches)
    assert err.value.stage == "calibrate"
    assert "calibration batch 1 holds NaN" in str(err.value)


def test_a_calibration_batch_of_another_shape_than_traced_is_refused_naming_it(tmp_path):
    model, samples, batches = batchnorm_net()
    batches[2] = (torch.randn(1, 3, 16, 16),)
    with pytest.raises(StageError) as err:
        export(model, samples, tmp_path / "out", False, quantizer="w8a8", calibration=batches)
    assert err.value.stage == "calibrate"
    assert "calibration batch 2: input 0 has shape [1, 3, 16, 16]" in str(err.value)
    assert "traced for [1, 3, 8, 8]" in str(err.value)


class MakesNaN(nn.Module):
    """Finite inputs, a NaN inside: the log of a negative number."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.log(x - 10.0))


def test_a_tensor_calibration_makes_nan_is_refused_naming_it(tmp_path):
    torch.manual_seed(0)
    model = MakesNaN().eval()
    with pytest.raises(StageError) as err:
        export(model, (torch.rand(1, 4),), tmp_path / "out", False, quantizer="w8a8")
    assert err.value.stage == "calibrate"
    assert "calibration produced NaN, first at 'log'" in str(err.value)


def test_the_one_stage_quantize_refuses_nan_too():
    from graphbuild.frontend.capture import capture_program
    from graphbuild.frontend.quantize import quantize
    from graphbuild.targets.qnn.presets.quantizer import QnnQuantizer

    torch.manual_seed(0)
    model = MakesNaN().eval()
    program = capture_program(model, (torch.rand(1, 4),)).program
    state = dict(model.state_dict())
    with pytest.raises(ExportError, match="calibration saw NaN at 'log'"):
        quantize(
            program, state, QnnQuantizer("w8a8"), [(torch.rand(1, 4),)], (), drop_non_finite=True
        )


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"range_method": "kl"}, "unknown range_method 'kl'"),
        ({"range_method": "percentile", "range_percentile": 30}, "from 50 to 100"),
        ({"range_method": "moving_average", "range_averaging": 0}, "above 0"),
    ],
)
def test_a_bad_range_setting_is_a_config_error_naming_it(options, message):
    with pytest.raises(ConfigError, match=message):
        gb.QnnOnnxOptions(quantizer="w8a8", **options)


def test_an_unused_range_parameter_changes_no_key():
    a = gb.QnnOnnxOptions(quantizer="w8a8", range_percentile=99.0).to_context()
    b = gb.QnnOnnxOptions(quantizer="w8a8", range_percentile=90.0).to_context()
    assert a["range"] == b["range"] == {"method": "minmax"}
    assert a["statistics"] == "minmax"
    c = gb.QnnOnnxOptions(quantizer="w8a8", range_method="mse").to_context()
    assert c["statistics"] == "histogram"
    # the placement is the same for every built-in preset
    d = gb.QnnOnnxOptions(quantizer="w4a16").to_context()
    assert a["quantizer_placement"] == d["quantizer_placement"]


# --------------------------------------------------------------------------- reloading


def test_a_reloaded_program_is_decoded_once_per_process_and_afresh_after_an_edit():
    from graphbuild.engine.codecs import decode, encode
    from graphbuild.frontend.capture import capture_program

    model, samples, _ = batchnorm_net()
    encoded = encode(capture_program(model, samples))
    parts = {p.digest: bytes(p.data) for p in encoded.all_parts()}

    def load():
        return decode(encoded.describe(), lambda digest, size: parts[digest])

    first, second = load(), load()
    assert second is first  # a recalibration does not pay torch's deserializer again
    node = next(iter(first.program.graph.nodes))
    node.meta["edited"] = True  # a stage that edits its input in place (an error)
    third = load()
    assert third is not first and "edited" not in next(iter(third.program.graph.nodes)).meta
