"""LPBQ: int4 weight blocks whose scales are 4-bit integers under a float scale per channel.

From three sources (the ``w4a16_lpbq`` preset, aimet-torch's ``GroupedBlockQuantizeDequantize``
and FastForward's blocked quantizers with the ``lpbq`` option), written as AIMET writes LPBQ in
encodings 1.0.0 and 2.0.0 and, for ``onnx_qdq``, in the QDQ form QNN's HTP takes; checked
against the torch model (numerics), AIMET's strict loader and QNN's HTP backend.
"""

from __future__ import annotations

import json
import logging
import tempfile

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import graphbuild as gb
from graphbuild.errors import ExportError, StageError
from graphbuild.quant.lpbq import compress
from graphbuild.targets.qnn.encodings import read_encodings
from tests.foreign_quantizers import (
    AimetGroupedBlockQuantizeDequantize,
    AimetQuantizeDequantize,
    FFQuantizer,
)

BLOCK = 64


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> gb.Cache:
    return gb.Cache(tmp_path_factory.mktemp("cache"))


class Mlp(nn.Module):
    """Three linear layers with SiLU between on a ``(1, 4, 128)`` input (each exports as
    ``MatMul`` of the ``Transpose`` of its weight, as a transformer's do): fc1 and fc2 without
    bias, as an LLM's projections, fc1 with two blocks per row, its first a quarter of the
    second's range, fc2 one, and fc3's 48 inputs make no block of 64."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(128, 64, bias=bias), nn.Linear(64, 48, bias=False)
        self.fc3 = nn.Linear(48, 8)
        with torch.no_grad():
            self.fc1.weight[:, :BLOCK] *= 0.25

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(nn.functional.silu(self.fc2(nn.functional.silu(self.fc1(x)))))


X = torch.randn(1, 4, 128)
CALIBRATION = [(torch.randn(1, 4, 128),) for _ in range(2)]


def preset_export(
    out, cache, fmt="onnx", version="1.0.0", model=None, **options
) -> gb.ExportArtifacts:
    options = {
        "quantizer": "w4a16_lpbq",
        "calibration": CALIBRATION,
        "check_numerics": True,
        "encodings_version": version,
        **options,
    }
    return gb.export(
        model or Mlp().eval(),
        (X,),
        out,
        "m",
        format=fmt,
        options=gb.QnnOnnxOptions(**options),
        cache=cache,
    )


def doc_of(art: gb.ExportArtifacts) -> dict:
    return json.loads(art.files["encodings"].read_text())


def params(doc: dict) -> dict[str, dict]:
    entries = doc.get("param_encodings") or doc.get("encodings")
    return {e["name"]: e for e in entries}


# The same quantized arithmetic in torch and in ORT: the weights' scales are AIMET's own bit
# for bit (asserted separately), but the float sums before the output quantizer follow each
# library's (and each CPU's) reduction order, so an output on a rounding tie may land one step
# over (seen on the CI machine, not on this one).
ROUNDING_TIE = 1.0


def assert_numerics(art: gb.ExportArtifacts, steps: float = 2.0) -> None:
    for out in art.report.extra["numerics"]["outputs"]:
        assert out["max_error_steps"] <= steps, out


# ------------------------------------------------------------------------------ the preset


def test_the_preset_writes_linear_weights_as_aimet_writes_lpbq_in_1_0_0(tmp_path, cache):
    art = preset_export(tmp_path, cache)
    assert_numerics(art)  # the file's Q/DQ, put back from the encodings alone, vs torch
    entries = params(doc_of(art))
    fc1 = entries["fc1.weight"]
    assert {k: fc1[k] for k in ("dtype", "enc_type", "bw", "compressed_bw", "is_sym")} == {
        "dtype": "INT",
        "enc_type": "LPBQ",
        "bw": 8,
        "compressed_bw": 4,
        "is_sym": True,
    }
    assert fc1["block_size"] == BLOCK and fc1["offset"] == [-128] * 64
    assert len(fc1["scale"]) == 64  # one float per output channel
    ints = np.asarray(fc1["per_block_int_scale"]).reshape(64, 2)  # channel-major
    assert (ints[:, 1] == 16).all()  # a channel's widest block is 2^4 times its float scale
    assert (ints[:, 0] <= 6).all() and (ints[:, 0] >= 1).all()  # a quarter of the range
    assert entries["fc2.weight"]["enc_type"] == "LPBQ"
    assert entries["fc3.weight"]["enc_type"] == "PER_CHANNEL"  # 48 inputs: no block of 64
    assert art.report.extra["coverage"]["mismatched"] == []


def test_the_preset_in_2_0_0_holds_both_scales_in_the_weights_layout(tmp_path, cache):
    model = Mlp().eval()
    art = preset_export(tmp_path, cache, version="2.0.0", model=model)
    assert_numerics(art)
    fc1 = params(doc_of(art))["fc1.weight"]
    assert set(fc1) == {
        "name",
        "output_dtype",
        "per_channel_float_scale",
        "per_block_int_scale",
        "axis",
        "block_size",
    }
    assert (fc1["output_dtype"], fc1["axis"], fc1["block_size"]) == ("int4", 1, BLOCK)
    assert np.asarray(fc1["per_channel_float_scale"]).shape == (64, 1)
    assert np.asarray(fc1["per_block_int_scale"]).shape == (64, 2)
    one = read_encodings(doc_of(preset_export(tmp_path / "v1", cache, model=model)))
    one = one["fc1.weight"]
    two = read_encodings(doc_of(art))["fc1.weight"]
    np.testing.assert_array_equal(one.scale, two.scale)  # the same effective block scales


def test_onnx_qdq_stores_the_weight_quantized_under_a_dequantized_scale(tmp_path, cache):
    """The form QNN's execution provider fuses into one LPBQ MatMul: the int4 weight, in
    MatMul's (in, out) layout (the exporter's Transpose folded), dequantized with a scale
    that a DequantizeLinear makes of uint8 block scales and the float channel scales."""
    art = preset_export(tmp_path, cache, fmt="onnx_qdq")
    assert_numerics(art)
    model = onnx.load(art.files["onnx"])
    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    lpbq = []
    for mm in matmuls:
        weight = producer.get(mm.input[1])
        if weight is None or weight.op_type != "DequantizeLinear":
            continue
        scale = producer.get(weight.input[1])
        if scale is None or scale.op_type != "DequantizeLinear":
            continue
        q, ints = inits[weight.input[0]], inits[scale.input[0]]
        lpbq.append((tuple(q.dims), q.data_type, tuple(ints.dims), ints.data_type))
        attrs = {a.name: a.i for a in weight.attribute}
        assert attrs == {"axis": 0, "block_size": BLOCK}
        assert [a.i for a in scale.attribute if a.name == "axis"] == [1]
    assert sorted(lpbq) == [
        ((64, 48), onnx.TensorProto.INT4, (1, 48), onnx.TensorProto.UINT8),
        ((128, 64), onnx.TensorProto.INT4, (2, 64), onnx.TensorProto.UINT8),
    ]
    assert not any(n.op_type == "Transpose" and n.input[0] in producer for n in matmuls)
    assert art.report.extra["coverage"]["summary"].startswith(
        f"{art.report.extra['coverage']['expected']}/"
    )
    assert art.report.extra["coverage"]["extra"] == []


def test_a_linear_layer_with_a_bias_keeps_per_channel_weights(tmp_path, cache):
    """QNN's HTP computes an LPBQ MatMul followed by its bias Add wrong (see
    presets/quantizer.py)."""
    art = preset_export(tmp_path, cache, model=Mlp(bias=True).eval())
    entries = params(doc_of(art))
    assert entries["fc1.weight"]["enc_type"] == "PER_CHANNEL"
    assert entries["fc2.weight"]["enc_type"] == "LPBQ"


def test_a_weights_only_change_rebinds_the_stored_lpbq_weight(tmp_path, cache):
    """The quantized weight is bound from state it names as its source: its digest keys bind."""
    model = AimetNet().eval()
    first = aimet_export(model, tmp_path / "a", cache, "onnx_qdq")
    with torch.no_grad():
        model.fc.weight.mul_(0.5)
    second = aimet_export(model, tmp_path / "b", cache, "onnx_qdq")
    assert second.report.statuses["bind"] == "ran"
    assert_numerics(second, ROUNDING_TIE)
    assert first.files["onnx"].read_bytes() != second.files["onnx"].read_bytes()


def _oracle(request):
    """PT2E prepare, calibrate and convert in one ``quantize`` stage, the LPBQ observer's own
    arithmetic: what the preset's split must write, byte for byte."""
    from graphbuild.targets.qnn import build_qnn_pipeline

    return build_qnn_pipeline(request, one_stage_oracle=True)


def _files(art: gb.ExportArtifacts) -> dict[str, bytes]:
    return {k: v.read_bytes() for k, v in art.files.items() if k != "lock"}


@pytest.mark.parametrize(
    ("fmt", "overrides"),
    [("onnx", None), ("onnx_qdq", None), ("onnx", {"fc1": "w8"}), ("onnx_qdq", {"fc2": "float"})],
)
def test_the_preset_quantizes_in_the_split_as_the_one_stage_oracle_does(tmp_path, fmt, overrides):
    model = Mlp().eval()
    art = preset_export(tmp_path / "split", False, fmt, model=model, layer_overrides=overrides)
    golden = gb.export(
        model,
        (X,),
        tmp_path / "one",
        "m",
        format=fmt,
        options=gb.QnnOnnxOptions(
            quantizer="w4a16_lpbq",
            calibration=CALIBRATION,
            check_numerics=True,
            layer_overrides=overrides,
        ),
        cache=False,
        pipeline_factory=_oracle,
    )
    assert "place_quantizers" in art.report.statuses and "quantize" not in art.report.statuses
    assert "quantize" in golden.report.statuses
    assert _files(art) == _files(golden)
    assert art.report.extra["numerics"] == golden.report.extra["numerics"]


def test_a_change_to_the_lpbq_preset_reads_the_weight_blocks_but_traces_and_calibrates_nothing(
    tmp_path,
):
    cache = gb.Cache(tmp_path / "cache")
    model = Mlp().eval()
    preset_export(tmp_path / "out", cache, model=model, quantizer="w4a16")

    art = preset_export(tmp_path / "out", cache, model=model)

    statuses = art.report.statuses
    for stage in ("capture", "place_quantizers", "calibrate", "to_onnx"):
        assert statuses[stage] in ("hit", "cutoff"), (stage, statuses)
    assert statuses["weight_stats"] == statuses["qparams"] == "ran"  # + the blocks' ranges
    assert params(doc_of(art))["fc2.weight"]["enc_type"] == "LPBQ"

    again = preset_export(tmp_path / "out", cache, model=model, layer_overrides={"fc1": "w8"})

    for stage in ("capture", "place_quantizers", "weight_stats", "calibrate", "to_onnx"):
        assert again.report.statuses[stage] in ("hit", "cutoff"), (stage, again.report.statuses)
    assert params(doc_of(again))["fc1.weight"]["enc_type"] == "PER_CHANNEL"


def test_encodings_0_6_1_cannot_say_lpbq(tmp_path, cache):
    with pytest.raises(StageError, match="0.6.1 cannot express LPBQ; use 1.0.0 or 2.0.0"):
        preset_export(tmp_path, cache, version="0.6.1", check_numerics=False)


# ------------------------------------------------------------------------------ aimet-torch


class AimetNet(nn.Module):
    """A linear layer with aimet-torch's LPBQ weight quantizer (``set_grouped_blockwise_
    quantization_for_weights(bitwidth=4, decompressed_bw=8, block_size=64)``) and 16-bit
    input and output quantizers, ranges as compute_encodings would leave them."""

    def __init__(self, decompressed_bw: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(192, 16, bias=False)
        with torch.no_grad():
            self.fc.weight[:, BLOCK:] *= torch.linspace(0.1, 1.0, 16)[:, None]
        blocks = self.fc.weight.detach().reshape(16, 3, BLOCK)
        self.wq = AimetGroupedBlockQuantizeDequantize(
            (16, 3), 4, decompressed_bw, (1, BLOCK), (1, -1)
        )
        peak = blocks.abs().amax(-1)
        self.wq.set_range(-peak * 8 / 7, peak)
        self.iq = AimetQuantizeDequantize((), 16, False)
        self.iq.set_range(torch.tensor(-4.0), torch.tensor(4.0))
        self.oq = AimetQuantizeDequantize((), 16, False)
        self.oq.set_range(torch.tensor(-3.0), torch.tensor(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.oq(nn.functional.linear(self.iq(x), self.wq(self.fc.weight)))


AIMET_X = torch.randn(1, 4, 192)


def aimet_export(model, out, cache, fmt="onnx", version="1.0.0") -> gb.ExportArtifacts:
    options = gb.QnnOnnxOptions(check_numerics=True, encodings_version=version)
    return gb.export(model, (AIMET_X,), out, "m", format=fmt, options=options, cache=cache)


@pytest.mark.parametrize(("fmt", "version"), [("onnx", "1.0.0"), ("onnx_qdq", "2.0.0")])
def test_aimet_grouped_block_quantizer_exports_with_its_own_lpbq_scales(
    tmp_path, cache, fmt, version
):
    model = AimetNet().eval()
    art = aimet_export(model, tmp_path, cache, fmt, version)
    assert_numerics(art, ROUNDING_TIE)  # AIMET's own arithmetic
    assert "quantize" not in art.report.statuses
    enc = read_encodings(doc_of(art))["fc.weight"]
    lpbq, per_channel = model.wq.lpbq_scales()
    np.testing.assert_array_equal(enc.channel_scale, per_channel.detach().reshape(-1).numpy())
    ints = (lpbq / per_channel).round().to(torch.int64).numpy()
    np.testing.assert_array_equal(np.asarray(enc.block_int_scale).reshape(16, 3), ints)
    assert len(np.unique(ints)) > 4  # blocks of many widths
    assert (enc.block_scale_bits, enc.bits, enc.block_size) == (4, 4, BLOCK)


class AimetMatMulNet(nn.Module):
    """A weight ``(in, out)`` read by ``x @ W`` (a MatMul weight, no Transpose) with aimet's
    LPBQ quantizer blocked along its input axis 0 (``block_size (64, 1)``, ``block_grouping
    (-1, 1)``): channels along axis 1."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(128, 24) * 0.1)
        with torch.no_grad():
            self.w[:BLOCK] *= torch.linspace(0.1, 1.0, 24)
        self.wq = AimetGroupedBlockQuantizeDequantize((2, 24), 4, 8, (BLOCK, 1), (-1, 1))
        peak = self.w.detach().reshape(2, BLOCK, 24).abs().amax(1)
        self.wq.set_range(-peak * 8 / 7, peak)
        self.iq = AimetQuantizeDequantize((), 16, False)
        self.iq.set_range(torch.tensor(-4.0), torch.tensor(4.0))
        self.oq = AimetQuantizeDequantize((), 16, False)
        self.oq.set_range(torch.tensor(-3.0), torch.tensor(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.oq(self.iq(x) @ self.wq(self.w))


@pytest.mark.parametrize(("fmt", "version"), [("onnx", "1.0.0"), ("onnx_qdq", "2.0.0")])
def test_a_matmul_weight_blocked_along_axis_0_is_written_channel_major(
    tmp_path, cache, fmt, version
):
    """1.0.0 lists block scales channel-major whatever the weight's layout (AIMET transposes
    a MatMul weight's); reading them back lays them out along the weight's axes again."""
    model = AimetMatMulNet().eval()
    x = torch.randn(1, 4, 128)
    options = gb.QnnOnnxOptions(check_numerics=True, encodings_version=version)
    art = gb.export(model, (x,), tmp_path, "m", format=fmt, options=options, cache=cache)
    assert_numerics(art, ROUNDING_TIE)  # the file's own LPBQ, reinserted / as written, vs AIMET's
    entry = params(doc_of(art))["w"]
    lpbq, per_channel = model.wq.lpbq_scales()
    ints = (lpbq / per_channel).round().to(torch.int64)  # (blocks, channels)
    if version == "1.0.0":
        assert entry["per_block_int_scale"] == ints.T.reshape(-1).tolist()
    else:
        assert (entry["axis"], entry["per_block_int_scale"]) == (0, ints.tolist())


def test_lpbq_block_scales_wider_than_the_weight_need_encodings_1_0_0(tmp_path, cache):
    """2.0.0 has no field for the decompressed bit-width (AIMET: twice the weight's)."""
    model = AimetNet(decompressed_bw=10).eval()
    art = aimet_export(model, tmp_path / "v1", cache)
    assert params(doc_of(art))["fc.weight"]["bw"] == 10
    assert_numerics(art, ROUNDING_TIE)
    with pytest.raises(StageError, match="2.0.0 can only express LPBQ with block scales as wide"):
        aimet_export(model, tmp_path / "v2", cache, version="2.0.0")


# ------------------------------------------------------------------------------ FastForward


class FFBlocked(nn.Module):
    """A linear layer whose weight FastForward quantizes in int4 tiles of (1, 64), symmetric
    (no offset), as its blocked ``LinearQuantizer`` exports."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(128, 8, bias=False)
        scale = self.fc.weight.detach().reshape(8, 2, BLOCK).abs().amax(-1) / 7
        scale[:, 0] *= torch.linspace(0.2, 1.0, 8)
        self.wq = FFQuantizer(4, scale.reshape(-1), None, [1, BLOCK])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.wq(self.fc.weight))


def test_fastforward_blocked_int4_weights_become_lpbq_as_its_lpbq_processor_makes_them(
    tmp_path, cache
):
    """FastForward's ``V1SchemaHandler(lpbq_processor=LPBQProcessor(4, 8))`` (export/_lpbq.py):
    per channel ``dynamic = max(block scales) / 2^4``, ``ints = clamp(round(s / dynamic), 1,
    16)``, ``scale`` the dynamic scales, ``bw`` 8, ``compressed_bw`` 4, offsets -128."""
    model = FFBlocked().eval()
    x = torch.randn(2, 128)
    options = gb.QnnOnnxOptions(lpbq=True, check_numerics=True)
    art = gb.export(model, (x,), tmp_path / "lpbq", "m", options=options, cache=cache)
    entry = params(doc_of(art))["fc.weight"]
    scales = model.wq.scale.detach().reshape(8, 2)
    dynamic = scales.amax(dim=1, keepdim=True) / 16
    ints = torch.clamp(torch.round(scales / dynamic), 1, 16)
    assert entry["per_block_int_scale"] == ints.to(torch.int64).reshape(-1).tolist()
    assert entry["scale"] == dynamic.reshape(-1).tolist()
    assert (entry["bw"], entry["compressed_bw"], entry["offset"]) == (8, 4, [-128] * 8)
    plain = gb.export(model, (x,), tmp_path / "plain", "m", cache=cache)
    assert params(doc_of(plain))["fc.weight"]["enc_type"] == "PER_BLOCK"
    assert plain.report["quant_map"].status.value == "ran"  # ctx.lpbq is what it reads


# ------------------------------------------------------------------------------ the arithmetic


def test_compressing_lpbq_scales_again_gives_them_back():
    raw = torch.rand(32, 5) * 0.1 + 1e-3
    ints, channel, effective = compress(raw, 1, 4)
    again = compress(effective, 1, 4)
    torch.testing.assert_close(again[0], ints, rtol=0, atol=0)
    torch.testing.assert_close(again[1], channel, rtol=0, atol=0)
    assert ints.max(dim=1).values.eq(16).all() and ints.min() >= 1
    with pytest.raises(ExportError, match="one channel axis besides the block axis"):
        compress(torch.rand(3, 4, 5), 1, 4)


def test_compression_is_aimets():
    lpbq_utils = pytest.importorskip("aimet_onnx.lpbq_utils", reason="the interop extra")
    raw = (torch.rand(24, 6) * 0.1 + 1e-3).numpy()
    ints, channel, effective = compress(torch.from_numpy(raw), 1, 4)
    their_ints, their_scale = lpbq_utils.grouped_dynamic_quantize(raw, [1, -1], 4)
    np.testing.assert_array_equal(ints.numpy(), their_ints)
    np.testing.assert_allclose(channel.numpy(), their_scale.reshape(-1), rtol=1e-7)


# ------------------------------------------------------------------------------ consumers


def _aimet_sim(model: onnx.ModelProto):
    from aimet_onnx import QuantizationSimModel
    from aimet_onnx.quantsim import set_lpbq_for_params

    sim = QuantizationSimModel(
        model,
        param_type="int4",
        activation_type="int16",
        quant_scheme="min_max",
        config_file="htp_v81",
        path=tempfile.mkdtemp(prefix="gb_aimet_"),
    )
    set_lpbq_for_params(sim, bitwidth=4, block_size=BLOCK, op_types={"MatMul", "Gemm"})
    return sim


def assert_aimet_takes_it(art: gb.ExportArtifacts, version: str, tmp_path) -> None:
    """AIMET's strict load into an htp_v81 sim with LPBQ on its MatMul/Gemm weights, and
    AIMET's own export of what it loaded writes the same weight encodings."""
    pytest.importorskip("aimet_onnx", reason="the interop extra (aimet-onnx) is not installed")
    from aimet_onnx.quantsim import load_encodings_to_sim

    logging.getLogger("Quant").setLevel(logging.ERROR)
    sim = _aimet_sim(onnx.load(art.files["onnx"]))
    mismatches = load_encodings_to_sim(sim, str(art.files["encodings"]), strict=True)
    assert [m for m in mismatches if m.has_mismatch()] == []
    lpbq = [n for n, q in sim.qc_quantize_op_dict.items() if q._encoding_type().name == "LPBQ"]
    ours = params(doc_of(art))
    assert sorted(lpbq) == sorted(
        n for n, e in ours.items() if e.get("enc_type") == "LPBQ" or "per_block_int_scale" in e
    )
    sim.export(str(tmp_path), "aimet", encoding_version=version)
    theirs = params(json.loads((tmp_path / "aimet.encodings").read_text()))
    for name in lpbq:
        assert set(theirs[name]) == set(ours[name]), name
        for key, value in ours[name].items():
            np.testing.assert_allclose(
                np.asarray(theirs[name][key], dtype=float) if key != "name" else 0,
                np.asarray(value, dtype=float) if key != "name" else 0,
                rtol=1e-7,
                err_msg=f"{name}.{key}",
            ) if not isinstance(value, str) else None


@pytest.mark.parametrize("version", ["1.0.0", "2.0.0"])
def test_aimet_loads_the_lpbq_encodings_strictly(tmp_path, cache, version):
    art = preset_export(tmp_path / "out", cache, version=version, int32_bias=False)
    assert_aimet_takes_it(art, version, tmp_path)


@pytest.mark.parametrize("fmt", ["onnx_qdq", "onnx"])
def test_qnn_htp_holds_the_lpbq_weights_in_lpbq_blocks(tmp_path, cache, fmt):
    """``onnx``: the QDQ model a QNN tool rebuilds from the float model and its encodings."""
    pytest.importorskip("onnxruntime_qnn", reason="the htp extra (onnxruntime-qnn)")
    from graphbuild.targets.qnn import htp_runtime as hr

    if not hr.availability().available:
        pytest.skip(hr.availability().reason)
    art = preset_export(tmp_path, cache, fmt=fmt, check_htp=True)
    (check,) = art.report.extra["htp"]["checks"]
    assert check["compiled"], check["refusal"]
    partition = check["partition"]
    assert partition["cpu_nodes"] == [] and partition["qnn_nodes"] == partition["total_nodes"]
    assert len(partition["lpbq_tensors"]) == 2  # fc1 and fc2; fc3 is per channel
    assert "2 LPBQ weights" in check["summary"]
    (out,) = check["outputs"]
    # the README's bound for int4 weights: the HTP within the quantization noise the preset
    # makes, its output far closer to the CPU's than either is to the float model
    assert out["sqnr_htp_db"] == pytest.approx(float(out["sqnr_cpu_db"]), abs=0.5), out
    assert float(out["sqnr_htp_vs_cpu_db"]) >= float(out["sqnr_cpu_db"]) + 20, out


def test_a_layer_override_to_8_bit_weights_takes_the_layer_out_of_lpbq(tmp_path, cache):
    """LPBQ is int4 with 4-bit block scales: a ``w8`` override gives that layer int8 per-channel
    weights; the other layers stay LPBQ."""
    art = preset_export(tmp_path, cache, layer_overrides={"fc1": "w8"})
    assert_numerics(art)
    entries = params(doc_of(art))
    assert (entries["fc1.weight"]["enc_type"], entries["fc1.weight"]["bw"]) == ("PER_CHANNEL", 8)
    assert entries["fc2.weight"]["enc_type"] == "LPBQ"
    assert art.report.extra["coverage"]["mismatched"] == []
