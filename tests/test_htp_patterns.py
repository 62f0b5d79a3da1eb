"""Graph patterns QNN's HTP refuses or computes wrong, rewritten in aten before the preset
annotates (``targets/qnn/rewrites/patterns.py``): each rewrite keeps the function (the rewritten
module computes what the model computes) and leaves the form the HTP runs. The HTP judges the
forms in ``tests/test_htp_forms.py``.
"""

from __future__ import annotations

import math

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphbuild as gb
from graphbuild.targets.qnn.rewrites.aten import rewrite_for_htp

aten = torch.ops.aten


def rewritten(model: nn.Module, *sample: torch.Tensor) -> torch.fx.GraphModule:
    gm = torch.export.export(model.eval(), sample).module()
    return rewrite_for_htp(gm)


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def assert_same_function(model: nn.Module, gm: torch.fx.GraphModule, *sample: torch.Tensor):
    with torch.no_grad():
        torch.testing.assert_close(gm(*sample), model(*sample), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- GELU


class NewGelu(nn.Module):
    """GPT-2's ``gelu_new``, as transformers writes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


class TanhGelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


@pytest.mark.parametrize("model", [NewGelu(), TanhGelu()], ids=["written-out", "approximate"])
def test_gelu_with_tanh_becomes_x_times_sigmoid_of_twice_its_argument(model):
    x = torch.randn(2, 8, 16) * 3
    gm = rewritten(model, x)
    assert aten.tanh.default not in targets(gm) and aten.gelu.default not in targets(gm)
    assert targets(gm).count(aten.sigmoid.default) == 1
    assert_same_function(model, gm, x)


def test_a_tanh_that_is_no_gelu_stays_a_tanh():
    class Pooler(nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 0.5 + 1.0

    x = torch.randn(4, 8)
    gm = rewritten(Pooler(), x)
    assert aten.tanh.default in targets(gm)


def test_exact_gelu_is_left_as_it_is():
    x = torch.randn(4, 8)
    assert aten.gelu.default in targets(rewritten(nn.GELU(), x))


# ---------------------------------------------------------------------------- RMSNorm


class LlamaStyleRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: float32 upcast, pow, mean, rsqrt, weight first."""

    def __init__(self, dim: int = 16, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


class DivRMSNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)


@pytest.mark.parametrize(
    ("model", "weighted"),
    [(LlamaStyleRMSNorm(), True), (DivRMSNorm(), False)],
    ids=["llama", "div"],
)
def test_a_written_out_rmsnorm_becomes_one_rms_norm(model, weighted):
    x = torch.randn(1, 8, 16)
    gm = rewritten(model, x)
    ops = targets(gm)
    assert ops.count(aten.rms_norm.default) == 1
    assert not {aten.rsqrt.default, aten.sqrt.default, aten.mean.dim} & set(ops)
    (norm,) = [n for n in gm.graph.nodes if n.target is aten.rms_norm.default]
    assert (norm.args[2] is not None) == weighted
    assert_same_function(model, gm, x)


def test_a_mean_over_another_axis_is_no_rmsnorm():
    class NotRMS(nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)

    x = torch.randn(1, 8, 16)
    assert aten.rms_norm.default not in targets(rewritten(NotRMS(), x))


@pytest.mark.parametrize(
    ("opset", "op"), [(21, "SimplifiedLayerNormalization"), (23, "RMSNormalization")]
)
def test_an_rmsnorm_is_one_onnx_op_at_every_opset(opset, op, tmp_path):
    torch.manual_seed(0)
    model, x = LlamaStyleRMSNorm(), torch.randn(1, 8, 16)
    art = gb.export(
        model,
        (x,),
        tmp_path / "out",
        "rms",
        format="onnx_qdq",
        options=gb.QnnOnnxOptions(quantizer="w8a16", opset=opset, check_numerics=True),
        cache=tmp_path / "cache",
    )
    graph = onnx.load(art.files["onnx"]).graph
    compute = [
        n.op_type for n in graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear")
    ]
    assert compute == [op]
    (out,) = art.report.extra["numerics"]["outputs"]
    assert out["forced_max_error_steps"] <= 2 and out["sqnr_db"] > 60, out
    coverage = art.report.extra["coverage"]
    assert coverage["float"] == [] and coverage["quantized"] == coverage["expected"] == 3


# ---------------------------------------------------------------------------- zero size


class PartialRotary(nn.Module):
    """GPT-NeoX's rotary split with the rotary part the whole head: the pass-through part is
    empty and concatenated back."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        rot, rest = q[..., :8], q[..., 8:]
        return torch.cat((rot * 2.0, rest), dim=-1)


def test_a_zero_size_operand_leaves_the_cat():
    q = torch.randn(1, 2, 4, 8)
    gm = rewritten(PartialRotary(), q)
    empty = [
        n
        for n in gm.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() == 0
    ]
    assert empty == [] and aten.cat.default not in targets(gm)
    assert_same_function(PartialRotary(), gm, q)


# ---------------------------------------------------------------------------- computed bias


class ComputedBiases(nn.Module):
    """A zero bias made in forward, a learned scalar expanded to the channels, a bias scaled
    by a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.2)
        self.w2 = nn.Parameter(torch.randn(8, 8, 1, 1) * 0.2)
        self.shift = nn.Parameter(torch.tensor([0.3]))
        self.fc = nn.Linear(8, 4)
        self.gain = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.conv2d(x, self.w1, torch.zeros(8), padding=1)
        x = F.conv2d(x, self.w2, self.shift.expand(8))
        return F.linear(x.mean((2, 3)), self.fc.weight, self.fc.bias * self.gain)


def test_a_computed_bias_leaves_its_op():
    x = torch.randn(1, 3, 8, 8)
    model = ComputedBiases().eval()
    gm = rewritten(model, x)
    for n in gm.graph.nodes:
        if n.target in (aten.conv2d.default, aten.linear.default):
            bias = n.args[2] if len(n.args) > 2 else None
            assert bias is None or bias.op == "get_attr", n.format_node()
    assert aten.expand.default not in targets(gm)  # the zero bias is gone, the scalar added
    assert_same_function(model, gm, x)


# ---------------------------------------------------------------------------- pools


@pytest.mark.parametrize(
    "pool",
    [
        nn.AvgPool2d(7, ceil_mode=True),
        nn.AvgPool2d(4),
        nn.AvgPool2d(6, padding=2, count_include_pad=False),
    ],
    ids=["larger-ceil", "exact", "padded-not-counted"],
)
def test_an_average_pool_over_its_whole_input_is_a_mean(pool):
    x = torch.randn(1, 8, 4, 4)
    gm = rewritten(pool, x)
    assert aten.avg_pool2d.default not in targets(gm) and aten.mean.dim in targets(gm)
    assert_same_function(pool, gm, x)


@pytest.mark.parametrize(
    "pool",
    [
        nn.AvgPool2d(2),
        nn.AvgPool2d(4, padding=1),
        nn.AvgPool2d(4, padding=1, count_include_pad=False),
    ],
    ids=["several-windows", "padding-counted", "window-short-of-the-input"],
)
def test_other_average_pools_stay_pools(pool):
    x = torch.randn(1, 8, 4, 4)
    assert aten.avg_pool2d.default in targets(rewritten(pool, x))
