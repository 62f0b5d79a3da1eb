"""The Q/DQ forms QNN's HTP runs fully quantized (``targets/qnn/rewrites/qdq_forms.py``), checked on
the ONNX models themselves: what the forms look like, and that they change no number.

On a hand-built QDQ model holding its values (the ``onnx`` format's QDQ rebuilt from an
encodings file) and on a preset export (``onnx_qdq``, whose values ``bind`` fills later).
The HTP itself judges them in ``tests/test_htp_forms.py``.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import graphbuild as gb
from graphbuild.targets.qnn.rewrites.qdq_forms import apply_htp_forms

S16 = 0.01  # a 16-bit step that holds the test's values


# ---------------------------------------------------------------------------- a QDQ model


def _qdq(name: str, src: str, scale: float, zero: int, dtype, nodes, inits) -> str:
    inits += [
        numpy_helper.from_array(np.array(scale, np.float32), f"{name}_scale"),
        numpy_helper.from_array(np.array(zero, dtype), f"{name}_zero_point"),
    ]
    nodes += [
        helper.make_node(
            "QuantizeLinear", [src, f"{name}_scale", f"{name}_zero_point"], [f"{name}_q"]
        ),
        helper.make_node(
            "DequantizeLinear", [f"{name}_q", f"{name}_scale", f"{name}_zero_point"], [name]
        ),
    ]
    return name


def attention_like(pad_value: float = 0.0) -> onnx.ModelProto:
    """x -> linear (per-channel int8 weight) -> k (int16, symmetric) -> Reshape -> Transpose
    -> MatMul(x, kᵀ); x -> LayerNorm (float bias) -> Pad -> output."""
    rng = np.random.default_rng(0)
    nodes: list = []
    inits: list = []
    x = _qdq("xq", "x", S16, 32768, np.uint16, nodes, inits)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    ws = (np.abs(w).max(0) / 127).astype(np.float32)
    inits += [
        numpy_helper.from_array(np.round(w / ws).astype(np.int8), "w_q"),
        numpy_helper.from_array(ws, "w_scale"),
        numpy_helper.from_array(np.zeros(8, np.int8), "w_zero_point"),
    ]
    nodes.append(
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero_point"], ["w"], axis=1)
    )
    nodes.append(helper.make_node("MatMul", [x, "w"], ["k_raw"]))
    k = _qdq("k", "k_raw", 4 * S16, 0, np.int16, nodes, inits)
    inits.append(numpy_helper.from_array(np.array([1, 8, 8], np.int64), "shape"))
    nodes.append(helper.make_node("Reshape", [k, "shape"], ["k_view"]))
    nodes.append(helper.make_node("Transpose", ["k_view"], ["k_t"], perm=[0, 2, 1]))
    nodes.append(helper.make_node("MatMul", [x, "k_t"], ["scores_raw"]))
    _qdq("scores", "scores_raw", 40 * S16, 32768, np.uint16, nodes, inits)
    g = (rng.random(8) + 0.5).astype(np.float32)
    inits += [
        numpy_helper.from_array(np.round(g / (g.max() / 255)).astype(np.uint8), "g_q"),
        numpy_helper.from_array(np.array(g.max() / 255, np.float32), "g_scale"),
        numpy_helper.from_array(np.array(0, np.uint8), "g_zero_point"),
        numpy_helper.from_array((rng.standard_normal(8) * 0.1).astype(np.float32), "ln_bias"),
        numpy_helper.from_array(np.array([0, 0, 0, 0, 0, 1], np.int64), "pads"),
        numpy_helper.from_array(np.array(pad_value, np.float32), "pad_value"),
    ]
    nodes.append(helper.make_node("DequantizeLinear", ["g_q", "g_scale", "g_zero_point"], ["g"]))
    nodes.append(helper.make_node("LayerNormalization", [x, "g", "ln_bias"], ["ln_raw"]))
    ln = _qdq("ln", "ln_raw", 2 * S16, 32768, np.uint16, nodes, inits)
    nodes.append(helper.make_node("Pad", [ln, "pads", "pad_value"], ["padded"]))
    graph = helper.make_graph(
        nodes,
        "attention_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8])],
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 8, 8]),
            helper.make_tensor_value_info("padded", TensorProto.FLOAT, [1, 8, 9]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def nodes_of(model: onnx.ModelProto, op: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op]


def producer(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if name in n.output)


def init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))


X = np.random.default_rng(1).uniform(-2, 2, (1, 8, 8)).astype(np.float32)


def test_the_forms_change_no_number_but_the_layernorm_bias_rounding():
    model = attention_like()
    before, after = run(model, X), run(apply_htp_forms(model), X)
    np.testing.assert_array_equal(after[0], before[0])  # unsigned grids, requantizations
    # the int32 bias moves LayerNorm's output by less than its input step x gamma step
    assert np.abs(after[1] - before[1]).max() <= 2 * S16


def test_a_signed_activation_moves_to_the_unsigned_container_with_its_zero_point():
    formed = apply_htp_forms(attention_like())
    (k_quantize,) = [n for n in nodes_of(formed, "QuantizeLinear") if n.input[0] == "k_raw"]
    zero = init(formed, k_quantize.input[2])
    assert zero.dtype == np.uint16 and int(zero) == 32768
    signed = [
        n for n in nodes_of(formed, "QuantizeLinear") if init(formed, n.input[2]).dtype == np.int16
    ]
    (requantize,) = signed  # the requantization before the MatMul alone stays signed
    (dq,) = [n for n in formed.graph.node if requantize.output[0] in n.input]
    (scores,) = [n for n in nodes_of(formed, "MatMul") if n.output[0] == "scores_raw"]
    assert scores.input[1] == dq.output[0]


def test_a_16_bit_symmetric_second_matmul_input_is_requantized_to_int16_zero_point_0():
    formed = apply_htp_forms(attention_like())
    (scores,) = [n for n in nodes_of(formed, "MatMul") if n.output[0] == "scores_raw"]
    dq = producer(formed, scores.input[1])
    q = producer(formed, dq.input[0])
    assert dq.op_type == "DequantizeLinear" and q.op_type == "QuantizeLinear"
    assert init(formed, q.input[2]).dtype == np.int16 and int(init(formed, q.input[2])) == 0
    assert init(formed, q.input[1]) == np.float32(4 * S16)  # k's own scale
    assert producer(formed, q.input[0]).op_type == "DequantizeLinear"  # after the Transpose's


def test_without_the_int16_requantization_every_activation_is_unsigned_and_exact():
    """``matmul_int16_requantize=False``: the MatMul reads the Transpose's requantization
    (its input's encoding, unsigned) directly, and no number changes."""
    model = attention_like()
    formed = apply_htp_forms(model, matmul_int16_requantize=False)
    zeros = [init(formed, n.input[2]) for n in nodes_of(formed, "QuantizeLinear")]
    assert zeros and all(z.dtype == np.uint16 for z in zeros)
    (scores,) = [n for n in nodes_of(formed, "MatMul") if n.output[0] == "scores_raw"]
    q = producer(formed, producer(formed, scores.input[1]).input[0])
    assert q.op_type == "QuantizeLinear" and producer(formed, q.input[0]).op_type == "Transpose"
    np.testing.assert_array_equal(run(formed, X)[0], run(model, X)[0])


def test_an_asymmetric_16_bit_second_input_is_not_requantized():
    model = attention_like()
    for i in model.graph.initializer:
        if i.name == "k_zero_point":
            i.CopyFrom(numpy_helper.from_array(np.array(-5, np.int16), "k_zero_point"))
    formed = apply_htp_forms(model)
    zeros = [init(formed, n.input[2]) for n in nodes_of(formed, "QuantizeLinear")]
    assert all(z.dtype == np.uint16 for z in zeros)  # no int16 form: QNN refuses z != 0
    (k_quantize,) = [n for n in nodes_of(formed, "QuantizeLinear") if n.input[0] == "k_raw"]
    assert int(init(formed, k_quantize.input[2])) == 32768 - 5


def test_data_movement_outputs_are_requantized_with_their_inputs_encoding():
    formed = apply_htp_forms(attention_like())
    for op in ("Reshape", "Transpose", "Pad"):
        (node,) = nodes_of(formed, op)
        (source,) = [producer(formed, node.input[0])]
        readers = [n for n in formed.graph.node if node.output[0] in n.input]
        assert [r.op_type for r in readers] == ["QuantizeLinear"], op
        assert readers[0].input[1:] == source.input[1:], op  # the same initializers


def test_a_graph_output_moved_behind_its_requantization_keeps_its_name():
    formed = apply_htp_forms(attention_like())
    assert [o.name for o in formed.graph.output] == ["scores", "padded"]
    assert producer(formed, "padded").op_type == "DequantizeLinear"


def test_a_pad_with_a_value_off_the_grid_is_left_as_it_is():
    formed = apply_htp_forms(attention_like(pad_value=0.123))
    (pad,) = nodes_of(formed, "Pad")
    assert pad.output[0] == "padded"


def test_a_layernorm_bias_becomes_int32_behind_a_dequantize_with_the_product_scale():
    model = attention_like()
    formed = apply_htp_forms(model)
    (ln,) = nodes_of(formed, "LayerNormalization")
    dq = producer(formed, ln.input[2])
    assert dq.op_type == "DequantizeLinear" and len(dq.input) == 2
    values, scale = init(formed, dq.input[0]), init(formed, dq.input[1])
    assert values.dtype == np.int32
    assert scale == np.float32(S16) * init(model, "g_scale")
    np.testing.assert_array_equal(values, np.round(init(model, "ln_bias") / scale))
    assert "ln_bias" not in {i.name for i in formed.graph.initializer}


def test_the_forms_are_idempotent():
    once = apply_htp_forms(attention_like())
    twice = apply_htp_forms(once)
    assert [n.op_type for n in twice.graph.node] == [n.op_type for n in once.graph.node]
    assert [(i.name, i.data_type) for i in twice.graph.initializer] == [
        (i.name, i.data_type) for i in once.graph.initializer
    ]


# ---------------------------------------------------------------------------- a preset export


class KeysAndNorm(nn.Module):
    """A linear's output split into queries and keys, heads moved by view/transpose, an
    attention product (keys: the symmetric second MatMul input), a LayerNorm with a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.proj(x).split(16, dim=-1)
        q = q.view(1, 8, 2, 8).transpose(1, 2)
        k = k.view(1, 8, 2, 8).transpose(1, 2)
        scores = q @ k.transpose(-1, -2)
        return self.norm(scores.transpose(1, 2).reshape(1, 8, 16))


def export_keys(out, directory: str = "out", **options) -> gb.ExportArtifacts:
    torch.manual_seed(0)
    model = KeysAndNorm().eval()
    sample = (torch.randn(1, 8, 16),)
    calibration = [sample, (torch.randn(1, 8, 16),)]
    return gb.export(
        model,
        sample,
        out / directory,
        "keys",
        format="onnx_qdq",
        options=gb.QnnOnnxOptions(
            quantizer="w8a16", calibration=calibration, check_numerics=True, **options
        ),
        cache=out / "cache",
    )


@pytest.fixture(scope="module")
def forms_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("forms")


@pytest.fixture(scope="module")
def preset_export(forms_dir):
    return export_keys(forms_dir)


def test_a_preset_export_carries_the_forms(preset_export):
    model = onnx.load(preset_export.files["onnx"])
    quantizes = nodes_of(model, "QuantizeLinear")
    activations = [n for n in quantizes if not n.input[0].endswith("weight")]
    zero_types = {init(model, n.input[2]).dtype for n in activations}
    assert np.dtype(np.uint16) in zero_types
    signed = [n for n in activations if init(model, n.input[2]).dtype == np.int16]
    matmul_inputs = {n.input[1] for n in nodes_of(model, "MatMul")}
    assert signed and all(
        any(
            r.op_type == "DequantizeLinear" and r.output[0] in matmul_inputs
            for r in model.graph.node
            if q.output[0] in r.input
        )
        for q in signed
    )
    assert all(int(init(model, q.input[2])) == 0 for q in signed)
    for op in ("Transpose", "Reshape", "Split"):
        for node in nodes_of(model, op):
            source = producer(model, node.input[0])
            if init(model, source.input[1]).ndim:  # a per-channel weight's Transpose
                continue
            for out in node.output:
                readers = [n.op_type for n in model.graph.node if out in n.input]
                assert readers and set(readers) == {"QuantizeLinear"}, (op, out, readers)
    (ln,) = nodes_of(model, "LayerNormalization")
    bias = producer(model, ln.input[2])
    assert bias.op_type == "DequantizeLinear" and init(model, bias.input[0]).dtype == np.int32


def test_a_preset_export_with_the_forms_agrees_with_torch(preset_export):
    numerics = preset_export.report.extra["numerics"]
    assert numerics["forced"]["max_error_steps"] <= 2, numerics["forced"]
    (out,) = numerics["outputs"]
    assert out["forced_max_error_steps"] <= 2 and out["sqnr_db"] > 60, out


def test_a_preset_export_keeps_its_coverage_and_encodings(preset_export):
    coverage = preset_export.report.extra["coverage"]
    assert coverage["float"] == [] and coverage["extra"] == [], coverage["summary"]
    assert coverage["mismatched"] == [], coverage["mismatched"]


#: a preset's stages before lowering: the trace, where quantizers sit, the calibration passes
STRUCTURE_AND_CALIBRATION = ("capture", "place_quantizers", "calibrate", "to_onnx")


def test_turning_the_int16_requantization_off_relowers_and_leaves_every_activation_unsigned(
    preset_export, forms_dir
):
    """The option is part of the lowering's key: calibration and the structure before it stay
    hits; the model then has no signed activation and agrees with torch as closely."""
    off = export_keys(forms_dir, "out-off", matmul_int16_requantize=False)
    status = {s.name: s.status.value for s in off.report.stages}
    assert status["lower_markers"] == "ran"
    assert [name for name in STRUCTURE_AND_CALIBRATION if status[name] == "ran"] == []
    model = onnx.load(off.files["onnx"])
    activations = [
        n for n in nodes_of(model, "QuantizeLinear") if not n.input[0].endswith("weight")
    ]
    assert activations
    assert {init(model, n.input[2]).dtype for n in activations} == {np.dtype(np.uint16)}
    assert len(nodes_of(model, "QuantizeLinear")) < len(
        nodes_of(onnx.load(preset_export.files["onnx"]), "QuantizeLinear")
    )
    assert off.report.extra["numerics"]["forced"]["max_error_steps"] <= 2


def test_the_int16_requantization_is_on_by_default_for_the_archs_that_take_it() -> None:
    """Unset, ``matmul_int16_requantize`` follows the HTP targets: v73 to v81 take an int16
    second MatMul input, v68 and v69 refuse it, and one QDQ model serves every listed arch;
    an explicit value wins."""
    from graphbuild.targets.qnn.options import QnnOnnxOptions

    assert QnnOnnxOptions().to_context()["matmul_int16_requantize"] is True
    assert QnnOnnxOptions(htp_arch=["v75", "v81"]).requantizes_matmul_inputs() is True
    assert QnnOnnxOptions(htp_arch="v69").to_context()["matmul_int16_requantize"] is False
    assert QnnOnnxOptions(htp_arch=["v81", "v68"]).requantizes_matmul_inputs() is False
    assert QnnOnnxOptions(htp_arch="v68", matmul_int16_requantize=True).requantizes_matmul_inputs()
    assert not QnnOnnxOptions(matmul_int16_requantize=False).requantizes_matmul_inputs()


# ---------------------------------------------------------------------------- Add -> Relu


class BiasRelu(nn.Module):
    """Linears with a bias on 3-D activations (MatMul + Add in ONNX), each Add read by a Relu:
    AIMET's ``Add -> Relu`` supergroup leaves the Add's output unquantized."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def export_bias_relu(out, fmt: str, preset: str = "w8a16", **options) -> gb.ExportArtifacts:
    torch.manual_seed(0)
    sample = (torch.randn(1, 8, 32),)
    calibration = [sample, (torch.randn(1, 8, 32),)]
    return gb.export(
        BiasRelu().eval(),
        sample,
        out / f"{fmt}-{preset}",
        "mlp",
        format=fmt,
        options=gb.QnnOnnxOptions(quantizer=preset, calibration=calibration, **options),
        cache=out / "cache",
    )


def test_an_add_before_a_relu_is_unquantized_in_the_encodings_as_aimet_groups_them(tmp_path):
    art = export_bias_relu(tmp_path, "onnx")
    model = onnx.load(art.files["onnx"])
    (relu,) = nodes_of(model, "Relu")
    assert producer(model, relu.input[0]).op_type == "Add"
    doc = json.loads(art.files["encodings"].read_text())
    activations = {e["name"] for e in doc["activation_encodings"]}
    assert relu.output[0] in activations and relu.input[0] not in activations


def test_an_add_before_a_relu_is_quantized_with_the_relus_encoding_in_the_qdq_model(tmp_path):
    """QNN fuses no Add with its Relu: a float Add output would run the linear float; the
    Relu's own grid (it holds 0) gives the same numbers."""
    art = export_bias_relu(tmp_path, "onnx_qdq", check_numerics=True)
    model = onnx.load(art.files["onnx"])
    (relu,) = nodes_of(model, "Relu")
    dq = producer(model, relu.input[0])
    assert dq.op_type == "DequantizeLinear"
    q = producer(model, dq.input[0])
    assert q.op_type == "QuantizeLinear" and producer(model, q.input[0]).op_type == "Add"
    (after,) = [n for n in nodes_of(model, "QuantizeLinear") if n.input[0] == relu.output[0]]
    assert list(q.input[1:]) == list(after.input[1:])  # the very scale and zero point
    numerics = art.report.extra["numerics"]
    assert numerics["forced"]["max_error_steps"] <= 2, numerics["forced"]
