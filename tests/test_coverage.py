"""The coverage report: what QNN HTP runs quantized that an export leaves float, and why."""

from __future__ import annotations

import json
import warnings

import onnx
import pytest
import torch
from torch import nn

import graphbuild as gb
from graphbuild.errors import CoverageError, StageError
from tests.models import FakeQuantConvNet


class WithLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        return self.fc(y)


class Vanishing(nn.Module):
    """Activations of ~1e-9: below any usable scale (a random-init network's dead layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x * 1e-9)


class InfMask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x + torch.full((4, 4), float("-inf")).triu(1), dim=-1)


class NormTanh(nn.Module):
    """LayerNorm -> Mul -> Tanh (or a Tanh of the input alone): the pattern of QNN's 16-bit
    Tanh defect (``tests/test_htp_forms.py`` reproduces it on the HTP)."""

    def __init__(self, width: int = 32, norm: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width) if norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(x) * 0.8 if self.norm is not None else x)


def export(model, sample, out, **options) -> gb.ExportArtifacts:
    torch.manual_seed(0)
    options = {"quantizer": "w8a8", "calibration": [sample], **options}
    return gb.export(
        model.eval(), sample, out, "model", options=gb.QnnOnnxOptions(**options), cache=False
    )


def test_a_fully_quantized_export_reports_every_tensor_covered(tmp_path):
    from examples import convnet

    model, sample = convnet.build()
    report = export(model, sample, tmp_path).report.extra["coverage"]
    assert report["quantized"] == report["expected"] == 7  # x, 3 weights, relu, relu_1, output
    assert report["float"] == report["mismatched"] == report["extra"] == []
    assert report["summary"] == "7/7 tensors quantized as QNN HTP runs them"


def test_an_lstm_is_named_as_an_unsupported_op_not_passed_through(tmp_path):
    sample = (torch.randn(1, 5, 8),)
    report = export(WithLSTM(), sample, tmp_path).report.extra["coverage"]
    lstm = [e for e in report["float"] if "lstm" in e["source"]]
    assert lstm and all(e["reason"] == "unsupported op aten.lstm.input" for e in lstm)
    assert {"lstm.weight_ih_l0", "lstm.weight_hh_l0"} <= {e["tensor"] for e in lstm}
    assert all("torch.nn.modules.rnn.LSTM" in e["source"] for e in lstm)
    assert "unsupported op aten.lstm.input" in report["summary"]


def test_an_infinite_mask_stays_float_with_its_reason(tmp_path):
    sample = (torch.randn(1, 4, 4),)
    art = export(InfMask(), sample, tmp_path, check_numerics=True)
    floats = {e["tensor"]: e["reason"] for e in art.report.extra["coverage"]["float"]}
    assert "add" in floats and "non-finite" in floats["add"]
    assert art.report.extra["numerics"]["outputs"][0]["sqnr_db"] > 40  # the softmax is quantized


def test_a_collapsed_activation_range_is_warned(tmp_path):
    sample = (torch.randn(1, 8),)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = export(Vanishing(), sample, tmp_path).report.extra["coverage"]
    (entry,) = report["degenerate"]
    assert entry["tensor"] == "mul" and abs(entry["max"]) < 1e-8
    assert "collapsed" in entry["why"] and "1 degenerate range" in report["summary"]
    assert any("'mul'" in str(w.message) and "collapsed" in str(w.message) for w in caught)


def test_a_16_bit_tanh_over_16_rows_is_named_as_a_known_qnn_htp_defect(tmp_path):
    """In the report, its summary line, a warning and the lock file: the tensor, why, and
    the test that reproduces the defect on the HTP."""
    sample = (torch.randn(1, 16, 32),)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = export(NormTanh(), sample, tmp_path, quantizer="w8a16").report.extra["coverage"]
    (entry,) = report["htp_defects"]
    assert (entry["tensor"], entry["op"], entry["shape"]) == ("output", "Tanh", [1, 16, 32])
    assert "16 rows" in entry["reason"] and "QNN HTP defect" in entry["reason"]
    assert entry["reproduction"].startswith(
        "tests/test_htp_forms.py::test_tanh_after_layernorm_and_mul_agrees_with_the_cpu"
    )
    assert "1 in a known QNN HTP defect's pattern (16-bit Tanh over 16 rows)" in report["summary"]
    assert report["float"] == [] and report["mismatched"] == []  # named, not a coverage gap
    assert any("'output'" in str(w.message) and "16 rows" in str(w.message) for w in caught)
    lock = json.loads((tmp_path / "graphbuild.lock.json").read_text())
    assert lock["reports"]["coverage"]["htp_defects"] == report["htp_defects"]
    from graphbuild.cli.export import _report_lines

    summary, warning = _report_lines({"coverage": report})
    assert summary == f"coverage   {report['summary']}"
    assert warning.startswith("warning    'output': QNN HTP defect")
    assert warning.endswith(f"reproduced by {entry['reproduction']}")


@pytest.mark.parametrize(
    ("shape", "preset", "norm"),
    [
        pytest.param((1, 32, 32), "w8a16", True, id="32-rows"),
        pytest.param((2, 16, 32), "w8a16", True, id="2x16-rows"),
        pytest.param((1, 16, 32), "w8a8", True, id="8-bit"),
        pytest.param((1, 16, 32), "w8a16", False, id="of-a-graph-input"),
    ],
)
def test_a_tanh_the_htp_computes_right_is_not_named(shape, preset, norm, tmp_path):
    sample = (torch.randn(*shape),)
    model = NormTanh(shape[-1], norm)
    report = export(model, sample, tmp_path, quantizer=preset).report.extra["coverage"]
    assert report["htp_defects"] == [] and "defect" not in report["summary"]


def test_a_pre_quantized_model_is_checked_by_name(tmp_path):
    art = gb.export(
        FakeQuantConvNet().eval(), (torch.randn(1, 3, 16, 16),), tmp_path, "m", cache=False
    )
    report = art.report.extra["coverage"]
    assert report["preset"] is None and report["expected"] > 0
    for entry in report["float"]:
        assert entry["reason"] == "the model has no quantizer here"


def test_a_weight_clipped_to_a_restricted_range_is_the_weight_in_the_qdq_report(tmp_path):
    """The QDQ model clips a weight quantized to [-127, 127] with Max/Min on its initializer
    before QuantizeLinear: onnxruntime folds those before QNN sees the graph, so they are not
    activations the HTP runs, and both formats report the same coverage."""
    reports = {}
    for fmt in ("onnx", "onnx_qdq"):
        art = gb.export(
            FakeQuantConvNet().eval(),
            (torch.randn(1, 3, 16, 16),),
            tmp_path / fmt,
            "m",
            format=fmt,
            cache=False,
        )
        reports[fmt] = art.report.extra["coverage"]
    qdq = reports["onnx_qdq"]
    assert qdq["float"] == [] and qdq["extra"] == [], qdq["summary"]
    assert (qdq["expected"], qdq["quantized"]) == (
        reports["onnx"]["expected"],
        reports["onnx"]["quantized"],
    )


def test_the_report_is_in_the_lock_file(tmp_path):
    from examples import convnet

    model, sample = convnet.build()
    art = export(model, sample, tmp_path)
    lock = json.loads((tmp_path / "graphbuild.lock.json").read_text())
    assert lock["reports"]["coverage"] == art.report.extra["coverage"]


def test_strict_coverage_fails_the_export_naming_the_float_tensors(tmp_path):
    sample = (torch.randn(1, 5, 8),)
    with pytest.raises(StageError) as err:
        export(WithLSTM(), sample, tmp_path, strict_coverage=True)
    assert err.value.stage == "coverage" and isinstance(err.value.cause, CoverageError)
    assert "lstm.weight_ih_l0 (unsupported op aten.lstm.input)" in str(err.value.cause)
    assert not (tmp_path / "model.onnx").exists()  # nothing placed


def test_strict_coverage_passes_a_complete_export(tmp_path):
    from examples import convnet

    model, sample = convnet.build()
    assert export(model, sample, tmp_path, strict_coverage=True).report.extra["coverage"]


LSTM_PROJECT = """
import torch
from torch import nn


class WithLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.lstm(x)[0])


def build():
    torch.manual_seed(0)
    return WithLSTM().eval(), (torch.randn(1, 5, 8),)
"""


def test_cli_strict_coverage_is_exit_1_and_the_summary_is_printed(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "lstm_model.py").write_text(LSTM_PROJECT)
    (tmp_path / "graphbuild.toml").write_text(
        'model = "lstm_model.py:build"\nmodel_name = "lstm"\n[quantization]\npreset = "w8a8"\n'
    )
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    env["GRAPHBUILD_CACHE_DIR"] = str(tmp_path / "cache")

    def run(*flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "graphbuild", "export", "--target", "qnn", *flags]
        return subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )

    lenient = run()
    assert lenient.returncode == 0, lenient.stderr[-2000:]
    assert "coverage   " in lenient.stdout and "unsupported op aten.lstm.input" in lenient.stdout
    strict = run("--strict-coverage")
    assert strict.returncode == 1
    assert "strict coverage" in strict.stderr and "lstm.weight_ih_l0" in strict.stderr


def test_the_report_gives_the_weights_size_as_the_device_stores_them(tmp_path):
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    sample = (torch.randn(2, 64),)
    weights = 64 * 32 + 32 * 8  # quantized at the preset's bits
    biases = 32 + 8  # float32 (biases stay float)
    sizes = {}
    for preset in ("w8a16", "w4a16"):
        art = gb.export(
            model,
            sample,
            tmp_path / preset,
            "model",
            options=gb.QnnOnnxOptions(quantizer=preset, calibration=[sample]),
            cache=False,
        )
        sizes[preset] = art.report.extra["coverage"]["weight_bytes"]

    assert sizes["w8a16"] == weights + 4 * biases
    assert sizes["w4a16"] == weights // 2 + 4 * biases


def test_the_graph_view_reads_back_from_its_json_as_it_was_built(tmp_path):
    """What the ``htp_view`` stage keeps: the view the HTP rules read, whole."""
    from examples import tiny_decoder
    from graphbuild.targets.qnn.rules.onnx_view import onnx_view
    from graphbuild.targets.qnn.rules.view import view_from_json, view_to_json

    model, sample = tiny_decoder.build(0)
    gb.export(
        model.eval(),
        sample,
        tmp_path,
        "model",
        target="qnn",
        format="onnx_qdq",
        options=gb.QnnOnnxOptions(quantizer="w8a16", calibration=[sample]),
        cache=False,
    )
    lowered = onnx.load(str(tmp_path / "model.onnx"))
    view = onnx_view(lowered)
    doc = json.loads(json.dumps(view_to_json(view)))
    assert view_from_json(doc) == view
    assert view.ops and view.floats and view.constants


def test_a_preset_change_reapplies_the_rules_to_the_kept_view(tmp_path):
    """w8a8 -> w8a16 on a Tanh over 16 rows: the view is a hit, the report (and its defect,
    which needs 16-bit activations) is recomputed."""
    sample = (torch.randn(1, 16, 32),)
    cache = tmp_path / "cache"

    def run(preset):
        torch.manual_seed(0)
        return gb.export(
            NormTanh().eval(),
            sample,
            tmp_path / "out",
            "model",
            options=gb.QnnOnnxOptions(quantizer=preset, calibration=[sample]),
            cache=cache,
        )

    first = run("w8a8")
    assert first.report.extra["coverage"]["htp_defects"] == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second = run("w8a16")
    assert second.report.statuses["htp_view"] == "hit"
    assert second.report.statuses["coverage"] == "ran"
    (entry,) = second.report.extra["coverage"]["htp_defects"]
    assert entry["tensor"] == "output"
