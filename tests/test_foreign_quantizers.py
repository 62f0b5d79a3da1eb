"""Models tuned in FastForward or AIMET (aimet-torch QuantSim) export with their own encodings.

The quantizers are the stand-ins of ``tests/foreign_quantizers.py`` (same ops, same
arithmetic, same ``torch.export`` form as the libraries); the last tests of each part run the
real library when it is installed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import graphbuild as gb
from graphbuild.errors import ExportError, UnknownQuantizerError
from graphbuild.frontend.qvalues import evaluate
from graphbuild.targets.qnn.encodings import read_encodings
from tests.foreign_quantizers import AimetQuantizeDequantize, FFQuantizer

torch.manual_seed(0)  # the module's sample inputs


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Each test's random model is the same whichever tests ran before it."""
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> gb.Cache:
    return gb.Cache(tmp_path_factory.mktemp("cache"))


def export(model, sample, out, cache, fmt="onnx", version="2.0.0") -> gb.ExportArtifacts:
    options = gb.QnnOnnxOptions(encodings_version=version, check_numerics=True)
    return gb.export(model, sample, out, "m", format=fmt, options=options, cache=cache)


def assert_within_one_step(art: gb.ExportArtifacts) -> None:
    for out in art.report.extra["numerics"]["outputs"]:
        assert out["sqnr_db"] > 40, out
        if out["max_error_steps"] is not None:
            assert out["max_error_steps"] <= 1.0, out


def encodings(out) -> dict:
    return read_encodings(json.loads((out / "m.encodings").read_text()))


# ------------------------------------------------------------------------------ FastForward


def ff_range(t: torch.Tensor, bits: int, dim=None) -> tuple[torch.Tensor, torch.Tensor]:
    """FastForward-style asymmetric parameters: signed grid, ``offset = lo/scale + 2^(b-1)``
    (a float; the ops round it)."""
    lo = t.amin() if dim is None else t.amin(dim=dim)
    hi = t.amax() if dim is None else t.amax(dim=dim)
    lo, hi = torch.minimum(lo, torch.zeros(())), torch.maximum(hi, torch.zeros(()))
    scale = (hi - lo) / (2**bits - 1)
    return scale.reshape(-1), (lo / scale + 2 ** (bits - 1)).reshape(-1) + 0.3


class FFNet(nn.Module):
    """Linear -> ReLU -> Linear with FastForward quantizers: input and outputs per tensor
    (offset a parameter), weights per output channel (offset a zero buffer) or in blocks of
    ``block`` along the input channel."""

    def __init__(self, x: torch.Tensor, block: int | None = None):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 6), nn.Linear(6, 4)
        self.input_q = FFQuantizer(8, *ff_range(x, 8))
        self.w1_q, self.w2_q = (self._weight_q(fc.weight, block) for fc in (self.fc1, self.fc2))
        h = torch.relu(self.fc1(x))
        self.h_q = FFQuantizer(8, *ff_range(h, 8))
        self.out_q = FFQuantizer(8, *ff_range(self.fc2(h), 8))

    @staticmethod
    def _weight_q(w: torch.Tensor, block: int | None) -> FFQuantizer:
        rows, cols = w.shape
        if block is None:
            scale, tile = w.abs().amax(dim=1) / 127, [1, cols]
        else:
            scale, tile = w.reshape(rows, cols // block, block).abs().amax(dim=2) / 7, [1, block]
        offset = torch.zeros(scale.numel())
        bits = 8 if block is None else 4
        return FFQuantizer(bits, scale.reshape(-1), offset, tile, offset_is_buffer=True)

    def forward(self, x):
        w1, w2 = self.w1_q(self.fc1.weight), self.w2_q(self.fc2.weight)
        h = self.h_q(torch.relu(nn.functional.linear(self.input_q(x), w1, self.fc1.bias)))
        return self.out_q(nn.functional.linear(h, w2, self.fc2.bias))


FF_X = torch.randn(5, 8)


@pytest.mark.parametrize("fmt", ["onnx", "onnx_qdq"])
def test_fastforward_model_exports_with_its_own_scales_and_offsets(tmp_path, cache, fmt):
    model = FFNet(FF_X).eval()
    art = export(model, (FF_X,), tmp_path, cache, fmt)
    assert_within_one_step(art)
    assert "quantize" not in art.report.statuses
    read = encodings(tmp_path)
    for quantizer, tensor in ((model.input_q, "x"), (model.w1_q, "fc1.weight")):
        enc = read[tensor]
        np.testing.assert_array_equal(enc.scale, quantizer.scale.detach().numpy())
        expected_zp = -torch.round(quantizer.offset).to(torch.int64).numpy()
        np.testing.assert_array_equal(enc.zero_point, expected_zp)
        assert (enc.qmin, enc.qmax, enc.signed) == (-128, 127, True)
    assert read["fc1.weight"].axis == 0


def test_fastforward_zero_points_are_not_clamped_to_the_grid(tmp_path, cache):
    """FastForward never clamps ``round(offset)``; neither does graphbuild (1.0.0 says it)."""
    model = FFNet(FF_X).eval()
    with torch.no_grad():
        model.out_q.offset.fill_(-140.2)  # zero point 140: off the int8 grid
    art = export(model, (FF_X,), tmp_path, cache, version="1.0.0")
    assert_within_one_step(art)
    doc = json.loads((tmp_path / "m.encodings").read_text())
    scale = model.out_q.scale.item()
    (out,) = [e for e in doc["activation_encodings"] if e["scale"] == [scale]]
    assert out["offset"] == [-128 - 140]


def test_fastforward_blocked_weights_are_onnx_blocks(tmp_path, cache):
    model = FFNet(FF_X, block=2).eval()
    art = export(model, (FF_X,), tmp_path, cache)
    assert_within_one_step(art)
    enc = encodings(tmp_path)["fc1.weight"]
    assert (enc.bits, enc.block_size, enc.axis) == (4, 2, 1)
    assert enc.scale.shape == (6, 4)
    np.testing.assert_array_equal(enc.scale.reshape(-1), model.w1_q.scale.detach().numpy())


def test_fastforward_tiles_no_encoding_can_say_are_named(tmp_path, cache):
    model = FFNet(FF_X).eval()
    model.w1_q = FFQuantizer(8, torch.full((6,), 0.01), None, tile=[2, 4])  # 2-D tiles
    with pytest.raises(gb.StageError, match="tiles \\[2, 4\\].*neither per tensor"):
        export(model, (FF_X,), tmp_path, cache)


def test_retuning_a_fastforward_offset_reruns_values_only(tmp_path, cache):
    model = FFNet(FF_X).eval()
    export(model, (FF_X,), tmp_path, cache)
    with torch.no_grad():
        model.h_q.offset.sub_(3)
    report = export(model, (FF_X,), tmp_path, cache).report
    assert report.statuses["capture"] == "hit" and report.statuses["to_onnx"] == "hit"
    assert report.statuses["encodings"] == "ran"


def test_a_real_fastforward_model_exports(tmp_path, cache):
    ff = pytest.importorskip("fastforward", reason="Qualcomm's FastForward is not installed")
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    ff.quantize_model(model)
    config = ff.QuantizationConfig()
    config.add_rule(
        "**/[quantizer:parameter/weight]",
        ff.nn.LinearQuantizer,
        num_bits=8,
        symmetric=True,
        granularity=ff.PerChannel(),
    )
    config.add_rule(
        "**/[quantizer:activation/output]",
        ff.nn.LinearQuantizer,
        num_bits=8,
        symmetric=False,
        granularity=ff.PerTensor(),
    )
    config.add_rule(
        "0/[quantizer:activation/input]",
        ff.nn.LinearQuantizer,
        num_bits=8,
        symmetric=False,
        granularity=ff.PerTensor(),
    )
    config.initialize(model)
    with ff.range_setting.estimate_ranges(model, ff.range_setting.smoothed_minmax):
        model(FF_X)
    with ff.export_mode(True), ff.strict_quantization(False):
        art = export(model, (FF_X,), tmp_path, cache)
    assert_within_one_step(art)
    scale = model[0].weight_quantizer.scale.detach().numpy()
    np.testing.assert_array_equal(encodings(tmp_path)["0.weight"].scale, scale)


# ------------------------------------------------------------------------------------ AIMET


class AimetNet(nn.Module):
    """What aimet-torch's QuantizationSimModel makes of Conv -> ReLU -> Flatten -> Linear with
    htp_v81: uint16 input, ReLU and Linear outputs (the Conv output is fused), int8 symmetric
    per-output-channel weights."""

    def __init__(self, x: torch.Tensor):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 5)
        self.input_q = AimetQuantizeDequantize((), 16, symmetric=False)
        self.conv_w_q = AimetQuantizeDequantize((4, 1, 1, 1), 8, symmetric=True)
        self.relu_q = AimetQuantizeDequantize((), 16, symmetric=False)
        self.fc_w_q = AimetQuantizeDequantize((5, 1), 8, symmetric=True)
        self.out_q = AimetQuantizeDequantize((), 16, symmetric=False)
        with torch.no_grad():
            self._calibrate(x)

    def _calibrate(self, x: torch.Tensor) -> None:
        def minmax(q, t, dims=None):
            lo = t.amin() if dims is None else t.amin(dim=dims, keepdim=True)
            hi = t.amax() if dims is None else t.amax(dim=dims, keepdim=True)
            if q.symmetric:
                m = torch.maximum(lo.abs(), hi.abs())
                lo, hi = -m * 128 / 127, m  # AIMET's signed symmetric range
            q.set_range(torch.minimum(lo, torch.zeros(())), torch.maximum(hi, torch.zeros(())))

        minmax(self.input_q, x)
        minmax(self.conv_w_q, self.conv.weight, (1, 2, 3))
        minmax(self.fc_w_q, self.fc.weight, (1,))
        r = torch.relu(self.conv(x))
        minmax(self.relu_q, r)
        minmax(self.out_q, self.fc(torch.flatten(r, 1)))

    def forward(self, x):
        y = nn.functional.conv2d(self.input_q(x), self.conv_w_q(self.conv.weight), self.conv.bias)
        r = self.relu_q(torch.relu(y))
        return self.out_q(
            nn.functional.linear(torch.flatten(r, 1), self.fc_w_q(self.fc.weight), self.fc.bias)
        )


AIMET_X = torch.randn(2, 3, 8, 8)


@pytest.mark.parametrize("fmt", ["onnx", "onnx_qdq"])
def test_aimet_quantsim_model_exports_with_its_own_scales_and_offsets(tmp_path, cache, fmt):
    # random weights, seeded: end to end a 16-bit step can flip now and then (see
    # graphbuild/targets/qnn/reports/numerics.py), and the QDQ output's step is checked too
    torch.manual_seed(0)
    model = AimetNet(AIMET_X).eval()
    art = export(model, (AIMET_X,), tmp_path, cache, fmt, version="1.0.0")
    assert_within_one_step(art)
    doc = json.loads((tmp_path / "m.encodings").read_text())
    found = {e["name"]: e for s in ("activation_encodings", "param_encodings") for e in doc[s]}
    for q, tensor in ((model.input_q, "x"), (model.conv_w_q, "conv.weight")):
        entry = found[tensor]
        assert entry["scale"] == q.get_scale().detach().reshape(-1).tolist()
        offset = q.get_offset().detach().reshape(-1)
        if q.symmetric:  # QNN's offset is on the unsigned grid
            offset = offset + q.qmin
        assert entry["offset"] == offset.to(torch.int64).tolist()
        assert entry["bw"] == (16 if q is model.input_q else 8)
    assert found["conv.weight"]["enc_type"] == "PER_CHANNEL"
    assert found["relu"]["scale"] == model.relu_q.get_scale().detach().reshape(-1).tolist()


def test_aimet_min_max_parameters_leave_the_onnx_model(tmp_path, cache):
    import onnx

    export(AimetNet(AIMET_X).eval(), (AIMET_X,), tmp_path, cache)
    model = onnx.load(tmp_path / "m.onnx")
    assert {t.name for t in model.graph.initializer} == {
        "conv.weight",
        "conv.bias",
        "fc.weight",
        "fc.bias",
    }
    ops = {n.op_type for n in model.graph.node}
    assert ops <= {"Conv", "Relu", "Reshape", "Gemm", "Constant", "Concat", "Flatten"}


def test_retuning_an_aimet_range_reruns_values_only(tmp_path, cache):
    model = AimetNet(AIMET_X).eval()
    export(model, (AIMET_X,), tmp_path, cache)
    before = encodings(tmp_path)["x"].scale.copy()
    with torch.no_grad():
        model.input_q.max.mul_(1.5)
    report = export(model, (AIMET_X,), tmp_path, cache).report
    assert report.statuses["capture"] == "hit" and report.statuses["to_onnx"] == "hit"
    after = encodings(tmp_path)["x"].scale
    np.testing.assert_array_equal(after, model.input_q.get_scale().detach().reshape(-1).numpy())
    assert not np.array_equal(before, after)


class PerElementAimet(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 6))
        self.q = AimetQuantizeDequantize((5, 6), 8, symmetric=True)  # one scale per element

    def forward(self, x):
        return x @ self.q(self.w).T


def test_an_aimet_quantizer_of_another_granularity_is_named_not_passed_through(tmp_path, cache):
    with pytest.raises(gb.StageError, match="AIMET quantizer at node .*scales of shape \\[5, 6\\]"):
        export(PerElementAimet(), (torch.randn(2, 6),), tmp_path, cache)


def test_a_computed_value_may_only_use_arithmetic_ops():
    expr = json.dumps({"steps": [["exp.default", [1.0], {}]]})
    with pytest.raises(ExportError, match="'exp.default', which is not allowed"):
        evaluate(expr, lambda ref: torch.zeros(()))


def test_a_real_aimet_torch_quantsim_exports(tmp_path, cache):
    aimet_torch = pytest.importorskip("aimet_torch", reason="aimet-torch is not installed")
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 5)).eval()
    sim = aimet_torch.QuantizationSimModel(
        model, AIMET_X, default_param_bw=8, default_output_bw=16, config_file="htp_v81"
    )
    sim.compute_encodings(lambda m: m(AIMET_X))
    art = export(sim.model, (AIMET_X,), tmp_path, cache, version="1.0.0")
    assert_within_one_step(art)
    weight_q = sim.model[0].param_quantizers["weight"]
    doc = json.loads((tmp_path / "m.encodings").read_text())
    (entry,) = [e for e in doc["param_encodings"] if e["name"] == "0.weight"]
    assert entry["scale"] == weight_q.get_scale().detach().reshape(-1).tolist()


def test_unknown_quantizer_error_is_what_a_stage_reports():
    assert issubclass(UnknownQuantizerError, ExportError)


def test_the_fastforward_stand_in_has_fastforwards_op_schemas():
    """Copied from what ``torch.library.custom_op`` infers for FastForward's own functions
    (``_quantizer_impl.py``); the real library, when installed, must give the same."""
    q = torch.ops.fastforward.quantize_by_tile.default._schema
    dq = torch.ops.fastforward.dequantize_by_tile.default._schema
    assert str(q) == (
        "fastforward::quantize_by_tile(Tensor data, Tensor scale, SymInt[] tile_size, "
        "float num_bits, ScalarType? output_dtype, Tensor? offset=None) -> Tensor"
    )
    assert str(dq) == (
        "fastforward::dequantize_by_tile(Tensor data, Tensor scale, SymInt[] tile_size, "
        "Tensor? offset=None, ScalarType? output_dtype=None) -> Tensor"
    )
