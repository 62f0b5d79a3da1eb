"""Qualcomm's HTP backend (onnxruntime-qnn) judges the forms of ``qdq_forms`` and the rewrites
of ``htp_patterns``: a small model per pattern compiles with CPU fallback disabled, QNN takes
no op in float, and the HTP agrees with onnxruntime's CPU on the same file. Where the HTP
itself is at fault, a minimal reproduction states the defect as ``xfail(strict=True)``: the
day QNN computes it right, the test fails and the workaround can go.

Needs the ``htp`` extra (``pip install -e ".[htp]"``); skipped with the reason without it.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import graphbuild as gb
from tests import zoo
from tests.test_htp_patterns import LlamaStyleRMSNorm, NewGelu, PartialRotary
from tests.test_qdq_forms import BiasRelu

pytest.importorskip("onnxruntime_qnn", reason="the htp extra (onnxruntime-qnn) is not installed")

from graphbuild.targets.qnn import htp_runtime as hr  # noqa: E402

if not hr.availability().available:
    pytest.skip(hr.availability().reason, allow_module_level=True)

V81 = hr.HtpTarget.of("v81")


def export_and_check(build, shape, tmp_path, preset: str = "w8a16", **options) -> dict:
    """Export ``build()`` (seeded) with ``preset`` (and qnn ``options``) on ``shape``-d
    inputs, checked on the HTP."""
    torch.manual_seed(0)
    model = build()
    sample = (torch.randn(shape),)
    calibration = [sample] + [(torch.randn(shape),) for _ in range(2)]
    art = gb.export(
        model.eval(),
        sample,
        tmp_path / "out",
        "m",
        format="onnx_qdq",
        options=gb.QnnOnnxOptions(
            quantizer=preset, calibration=calibration, check_htp=True, **options
        ),
        cache=tmp_path / "cache",
    )
    (check,) = art.report.extra["htp"]["checks"]
    return check


def assert_fully_quantized(check: dict, sqnr_vs_cpu_db: float = 70) -> dict:
    """Compiled with no CPU fallback, every node on QNN, no op in float; the output, whose
    last op computes what the CPU does within 2 steps given the CPU's inputs (end to end,
    16-bit steps travel through the layers: the SQNR of the HTP against the CPU says it; with
    8-bit activations one step is that coarse, and the callers bound the steps instead)."""
    partition = check["partition"]
    assert check["compiled"], check["summary"]
    assert partition["cpu_nodes"] == [] and partition["qnn_nodes"] == partition["total_nodes"]
    assert partition["float_ops"] == [], partition["float_ops"]
    (out,) = check["outputs"]
    assert out["forced_max_diff_steps"] <= 2, out
    assert float(out["sqnr_htp_vs_cpu_db"]) >= sqnr_vs_cpu_db, out
    return out


# ---------------------------------------------------------------------------- models


class Attention(nn.Module):
    """A linear split into queries, keys and values, heads by view/transpose (data movement),
    keys the 16-bit second MatMul input (symmetric: AIMET's signed grid), a LayerNorm with a
    bias before and after."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)
        self.final = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).split(32, dim=-1)
        q, k, v = (t.view(1, 16, 4, 8).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(8))
        heads = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(1, 16, 32)
        return self.final(x + self.out(heads))


class GeluBlock(nn.Module):
    """LayerNorm -> linear -> GPT-2's gelu_new on 16 rows: where the HTP's Tanh goes wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 64)
        self.act = NewGelu()
        self.proj = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(self.norm(x))))


class RMSBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = LlamaStyleRMSNorm(32)
        self.fc = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class RotaryBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.rotary = PartialRotary()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rotary(self.fc(x))


# ---------------------------------------------------------------------------- the forms


def test_attention_with_keys_on_a_signed_grid_runs_fully_quantized(tmp_path):
    assert_fully_quantized(export_and_check(Attention, (1, 16, 32), tmp_path))


def test_leaving_the_int16_requantization_out_costs_attention_steps_on_the_htp(tmp_path):
    """``matmul_int16_requantize = false`` (for AIMET's strict QDQ import): still fully
    quantized, but the HTP's 16x16 MatMuls keep about 8 bits of their uint16 second inputs
    (measured: 4 steps from ORT CPU with the requantization, 25 without; SQNR of the HTP
    against the CPU 79 dB and 62 dB)."""
    with_it = assert_fully_quantized(export_and_check(Attention, (1, 16, 32), tmp_path / "on"))
    check = export_and_check(
        Attention, (1, 16, 32), tmp_path / "off", matmul_int16_requantize=False
    )
    without = assert_fully_quantized(check, sqnr_vs_cpu_db=55)
    assert with_it["max_diff_steps"] <= 4
    assert without["max_diff_steps"] >= 4 * with_it["max_diff_steps"], (with_it, without)
    assert float(without["sqnr_htp_vs_cpu_db"]) <= float(with_it["sqnr_htp_vs_cpu_db"]) - 10


def test_attention_for_v69_compiles_by_default_without_the_int16_requantization(tmp_path):
    """v69 refuses a 16x16 MatMul with an int16 second input: with ``htp_arch = "v69"`` and
    the option unset, the export leaves the requantization out and compiles there."""
    check = export_and_check(Attention, (1, 16, 32), tmp_path, htp_arch="v69")
    assert check["htp_arch"] == "69", check["htp_arch"]
    assert_fully_quantized(check, sqnr_vs_cpu_db=50)


def test_gelu_with_tanh_after_a_layernorm_runs_right(tmp_path):
    assert_fully_quantized(export_and_check(GeluBlock, (1, 16, 32), tmp_path))


def test_an_rmsnorm_runs_quantized_as_one_op(tmp_path):
    assert_fully_quantized(export_and_check(RMSBlock, (1, 16, 32), tmp_path))


def test_a_full_rotary_split_runs_without_its_empty_half(tmp_path):
    check = export_and_check(RotaryBlock, (1, 2, 4, 8), tmp_path, "w8a8")
    assert assert_fully_quantized(check, sqnr_vs_cpu_db=30)["max_diff_steps"] <= 2


def test_a_linear_bias_add_before_a_relu_runs_fully_quantized(tmp_path):
    assert_fully_quantized(export_and_check(BiasRelu, (1, 8, 32), tmp_path))


def test_a_linear_bias_add_before_a_relu_runs_fully_quantized_at_8_bits(tmp_path):
    check = export_and_check(BiasRelu, (1, 8, 32), tmp_path, "w8a8")
    assert assert_fully_quantized(check, sqnr_vs_cpu_db=30)["max_diff_steps"] <= 2


@pytest.mark.parametrize("name", ["convbias", "poolhead"])
def test_computed_biases_and_whole_input_pools_run_fully_quantized(name, tmp_path):
    check = export_and_check(lambda: zoo.build(name)[0], zoo.IMAGE, tmp_path, "w8a8")
    assert assert_fully_quantized(check, sqnr_vs_cpu_db=30)["max_diff_steps"] <= 2


# ---------------------------------------------------------------------------- QNN's defects


def _qdq(name, src, scale, zero, dtype, nodes, inits):
    inits += [
        numpy_helper.from_array(np.array(scale, np.float32), f"{name}_s"),
        numpy_helper.from_array(np.array(zero, dtype), f"{name}_z"),
    ]
    nodes += [
        helper.make_node("QuantizeLinear", [src, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
        helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [name]),
    ]
    return name


def _model(nodes, inits, shapes: dict[str, list[int]], out: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "repro",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def layernorm_mul_then(op: str, shape: tuple[int, ...] = (1, 16, 128)) -> onnx.ModelProto:
    """x -> LayerNorm (int32 bias) -> Mul(constant) -> ``op`` on ``shape``, all uint16."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    width = shape[-1]
    x = _qdq("x_dq", "x", 8 / 65535, 32768, np.uint16, nodes, inits)
    gamma = (rng.random(width) * 0.5 + 0.75).astype(np.float32)
    g_scale = np.float32(gamma.max() / 255)
    beta = (rng.standard_normal(width) * 0.1).astype(np.float32)
    b_scale = np.float32(8 / 65535) * g_scale
    inits += [
        numpy_helper.from_array(np.round(gamma / g_scale).astype(np.uint8), "g_q"),
        numpy_helper.from_array(np.array(g_scale), "g_s"),
        numpy_helper.from_array(np.array(0, np.uint8), "g_z"),
        numpy_helper.from_array(np.round(beta / b_scale).astype(np.int32), "b_q"),
        numpy_helper.from_array(np.array(b_scale), "b_s"),
        numpy_helper.from_array(np.array(52000, np.uint16), "c_q"),
        numpy_helper.from_array(np.array(1 / 65535, np.float32), "c_s"),
        numpy_helper.from_array(np.array(0, np.uint16), "c_z"),
    ]
    nodes += [
        helper.make_node("DequantizeLinear", ["g_q", "g_s", "g_z"], ["g"]),
        helper.make_node("DequantizeLinear", ["b_q", "b_s"], ["b"]),
        helper.make_node("DequantizeLinear", ["c_q", "c_s", "c_z"], ["c"]),
        helper.make_node("LayerNormalization", [x, "g", "b"], ["ln"], epsilon=1e-5),
    ]
    y = _qdq("ln_dq", "ln", 10 / 65535, 32768, np.uint16, nodes, inits)
    nodes.append(helper.make_node("Mul", [y, "c"], ["m"]))
    m = _qdq("m_dq", "m", 8 / 65535, 32768, np.uint16, nodes, inits)
    nodes.append(helper.make_node(op, [m], ["t"]))
    _qdq("out", "t", 2 / 65535, 32768, np.uint16, nodes, inits)
    return _model(nodes, inits, {"x": list(shape)}, "out")


def linear_then_tanh(shape: tuple[int, ...] = (1, 16, 128)) -> onnx.ModelProto:
    """x -> MatMul (per-channel int8 weight) -> Tanh on ``shape``, activations uint16."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    width = shape[-1]
    x = _qdq("x_dq", "x", 8 / 65535, 32768, np.uint16, nodes, inits)
    w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    w_scale = (np.abs(w).max(0) / 127).astype(np.float32)
    inits += [
        numpy_helper.from_array(np.round(w / w_scale).astype(np.int8), "w_q"),
        numpy_helper.from_array(w_scale, "w_s"),
        numpy_helper.from_array(np.zeros(width, np.int8), "w_z"),
    ]
    nodes.append(helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"], axis=1))
    nodes.append(helper.make_node("MatMul", [x, "w"], ["y"]))
    y = _qdq("y_dq", "y", 8 / 65535, 32768, np.uint16, nodes, inits)
    nodes.append(helper.make_node("Tanh", [y], ["t"]))
    _qdq("out", "t", 2 / 65535, 32768, np.uint16, nodes, inits)
    return _model(nodes, inits, {"x": list(shape)}, "out")


def _htp_vs_cpu(model: onnx.ModelProto, feeds: dict, tmp_path) -> float:
    path = tmp_path / "repro.onnx"
    onnx.save(model, path)
    check = hr.check_model(path, feeds, V81, forced=False)
    assert check.compiled, check.refusal
    (out,) = check.outputs
    return out.max_diff_steps


def test_sigmoid_after_layernorm_and_mul_agrees_with_the_cpu(tmp_path):
    """The form the GELU rewrite leaves, in the reproduction below: right (a 16-bit LUT op
    lands within a few steps of the CPU)."""
    x = np.random.default_rng(1).uniform(-3, 3, (1, 16, 128)).astype(np.float32)
    assert _htp_vs_cpu(layernorm_mul_then("Sigmoid"), {"x": x}, tmp_path) <= 4


#: A 16-bit Tanh the HTP computes right lands 6-9 steps of its output grid from ORT CPU here
#: (its table); the defect below puts rows 60,000 steps off.
TANH_STEPS = 12

TANH_DEFECT = (
    "QNN HTP defect (QNN SDK 2.51 in onnxruntime-qnn 2.7.0, v68-v81): a 16-bit Tanh over "
    "exactly 16 rows ([1, ..., 1, 16, C]) returns rows of other positions (64,000 steps off ORT "
    "CPU); graphbuild writes GELU's tanh as a sigmoid (htp_patterns) and the coverage report "
    "names any other such Tanh (htp_defects)"
)


def _uniform(shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).uniform(-3, 3, shape).astype(np.float32)}


@pytest.mark.xfail(strict=True, reason=TANH_DEFECT)
def test_tanh_after_layernorm_and_mul_agrees_with_the_cpu(tmp_path):
    """The minimal reproduction (the coverage report points here)."""
    model = layernorm_mul_then("Tanh")
    assert _htp_vs_cpu(model, _uniform((1, 16, 128)), tmp_path) <= TANH_STEPS


@pytest.mark.xfail(strict=True, reason=TANH_DEFECT)
@pytest.mark.parametrize(
    ("build", "shape"),
    [
        pytest.param(linear_then_tanh, (1, 16, 128), id="after-a-linear"),
        pytest.param(lambda s: layernorm_mul_then("Tanh", s), (16, 128), id="16x128"),
    ],
)
def test_a_16_bit_tanh_over_16_rows_after_other_ops_agrees_with_the_cpu(build, shape, tmp_path):
    """Not LayerNorm's doing: a linear before the Tanh, or no leading axis, hits it too."""
    assert _htp_vs_cpu(build(shape), _uniform(shape), tmp_path) <= TANH_STEPS


@pytest.mark.parametrize(
    "shape", [(1, 15, 128), (1, 32, 128), (2, 16, 128)], ids=["15-rows", "32-rows", "2x16-rows"]
)
def test_a_16_bit_tanh_over_other_than_16_rows_agrees_with_the_cpu(shape, tmp_path):
    """Where the defect's pattern ends (the rule ``htp_defects`` names tensors by)."""
    model = layernorm_mul_then("Tanh", shape)
    assert _htp_vs_cpu(model, _uniform(shape), tmp_path) <= TANH_STEPS


class NormTanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(x) * 0.8)


def test_the_coverage_report_names_the_tanh_the_htp_computes_wrong(tmp_path):
    """An export in the defect's pattern: compiled fully quantized, and the HTP's output is
    tens of thousands of steps off while the coverage report names the Tanh and the
    reproduction (the day QNN computes it right, this fails and the rule can go)."""
    check = export_and_check(NormTanh, (1, 16, 32), tmp_path)
    assert check["compiled"] and check["partition"]["float_ops"] == []
    (out,) = check["outputs"]
    assert out["max_diff_steps"] > 10_000, out
    report = json.loads((tmp_path / "out" / "graphbuild.lock.json").read_text())["reports"]
    (entry,) = report["coverage"]["htp_defects"]
    assert entry["op"] == "Tanh" and entry["shape"] == [1, 16, 32]
    assert "test_tanh_after_layernorm_and_mul_agrees_with_the_cpu" in entry["reproduction"]


def matmul_16x16(second: str) -> onnx.ModelProto:
    """x (uint16) @ y (``uint16`` with zero point 32768, or ``int16`` with 0: one grid)."""
    nodes, inits = [], []
    x = _qdq("x_dq", "x", 2 / 65535, 32768, np.uint16, nodes, inits)
    signed = second == "int16"
    y = _qdq(
        "y_dq",
        "y",
        1 / 32767,
        0 if signed else 32768,
        np.int16 if signed else np.uint16,
        nodes,
        inits,
    )
    nodes.append(helper.make_node("MatMul", [x, y], ["m"]))
    _qdq("out", "m", 8 / 65535, 32768, np.uint16, nodes, inits)
    return _model(nodes, inits, {"x": [1, 4, 16, 8], "y": [1, 4, 8, 16]}, "out")


MATMUL_FEEDS = {
    "x": np.random.default_rng(2).uniform(-1, 1, (1, 4, 16, 8)).astype(np.float32),
    "y": np.random.default_rng(3).uniform(-1, 1, (1, 4, 8, 16)).astype(np.float32),
}


def test_an_int16_second_matmul_input_is_several_times_closer_to_the_cpu_than_uint16(tmp_path):
    """The HTP's 16x16 MatMul is not exact either way (12-30 output steps from ORT CPU with
    unit-range inputs, 1 with small ones), but with a uint16 second input it keeps about 8 bits
    of it (120-160 steps): why ``qdq_forms`` requantizes that input to int16."""
    signed = _htp_vs_cpu(matmul_16x16("int16"), MATMUL_FEEDS, tmp_path)
    unsigned = _htp_vs_cpu(matmul_16x16("uint16"), MATMUL_FEEDS, tmp_path)
    assert unsigned >= 4 * signed, (signed, unsigned)


def softmax_16(spread: float, data: float | None = None) -> tuple[onnx.ModelProto, dict]:
    """A 16-bit Softmax whose input grid spans +-``spread``, fed values in +-``data``."""
    nodes, inits = [], []
    x = _qdq("x_dq", "x", 2 * spread / 65535, 32768, np.uint16, nodes, inits)
    nodes.append(helper.make_node("Softmax", [x], ["p"], axis=-1))
    _qdq("out", "p", 1 / 65535, 0, np.uint16, nodes, inits)
    values = np.random.default_rng(4).uniform(-1, 1, (1, 4, 16, 17)) * (data or spread)
    feeds = {"x": values.astype(np.float32)}
    return _model(nodes, inits, {"x": [1, 4, 16, 17]}, "out"), feeds


def test_a_softmax_on_the_htps_minimum_input_step_agrees_with_the_cpu(tmp_path):
    """The same small scores as below, on the grid the preset gives a Softmax's input."""
    from graphbuild.targets.qnn.rules.plan import SOFTMAX_MIN_INPUT_SCALE

    model, feeds = softmax_16(SOFTMAX_MIN_INPUT_SCALE * 65535 / 2, data=0.06)
    assert _htp_vs_cpu(model, feeds, tmp_path) <= 3


@pytest.mark.xfail(
    strict=True,
    reason="QNN HTP: a 16-bit Softmax lands 10-40 steps of its output grid from ORT CPU, and "
    "~2,000 from an input grid finer than about 2^-18.5 (+-0.06: a random-init ViT's attention "
    "scores); the preset keeps a Softmax's input step at 2^-17 or more (rules/plan.py)",
)
@pytest.mark.parametrize("spread", [0.06, 4.0])
def test_a_16_bit_softmax_agrees_with_the_cpu(spread, tmp_path):
    model, feeds = softmax_16(spread)
    assert _htp_vs_cpu(model, feeds, tmp_path) <= 4
