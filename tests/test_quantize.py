"""The quantize stage and the QNN preset quantizer, on a tiny ConvNet and a tiny decoder."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchao.quantization.pt2e.observer import MinMaxObserver
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
)

import graphbuild as gb
from graphbuild.errors import ConfigError, ExportError
from graphbuild.frontend.quantize import quantize, quantize_program
from graphbuild.targets.qnn.presets.quantizer import PRESETS, QnnQuantizer

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed

Q_TENSOR, DQ_TENSOR = qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default
Q_CHANNEL, DQ_CHANNEL = qd.quantize_per_channel.default, qd.dequantize_per_channel.default

WEIGHT_GRID = {"w8a8": (-128, 127), "w8a16": (-128, 127), "w4a16": (-8, 7), "w4a16_lpbq": (-8, 7)}
ACT_GRID = {
    "w8a8": (0, 255, torch.uint8),
    "w8a16": (0, 65535, torch.uint16),
    "w4a16": (0, 65535, torch.uint16),
    "w4a16_lpbq": (0, 65535, torch.uint16),
}
SDPA = aten.scaled_dot_product_attention.default
SOFTMAX = {aten.softmax.int, aten._softmax.default}
WEIGHTED = {aten.conv1d.default, aten.conv2d.default, aten.linear.default}


# ---------------------------------------------------------------------------------------------
# Models


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    """Rotary attention with grouped KV heads; a finite additive causal mask."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = (
            v[:, :, None]
            .expand(b, self.kv_heads, groups, t, self.head_dim)
            .reshape(b, -1, t, self.head_dim)
        )
        scores = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5
        mask = torch.full((t, t), -30.0).triu(1)
        attn = torch.softmax(scores + mask, dim=-1)
        return self.o((attn @ v).transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads)
        self.gate = nn.Linear(dim, 2 * dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    """Decoder-only transformer with tied embeddings and a non-persistent rotary buffer."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(2))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        head_dim = dim // heads
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(torch.arange(ids.shape[1], dtype=torch.float32), self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


class OpZoo(nn.Module):
    """Every other supported op: conv1d, gelu, sigmoid, tanh, bmm, scaled_dot_product_attention."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.conv(x))
        z = torch.sigmoid(y) * torch.tanh(y)
        return F.scaled_dot_product_attention(z, z, torch.bmm(z, z.transpose(1, 2)))


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers


def _build(name: str) -> tuple[nn.Module, tuple, list]:
    torch.manual_seed(0)
    if name == "convnet":
        batches = [(torch.randn(1, 3, 16, 16),) for _ in range(4)]
        return ConvNet().eval(), batches[0], batches
    batches = [(torch.randint(0, 64, (1, 8)),) for _ in range(4)]
    return Decoder().eval(), batches[0], batches


@pytest.fixture(scope="module")
def cases() -> dict:
    built = {}
    for name in ("convnet", "decoder"):
        model, sample, batches = _build(name)
        built[name] = (model, torch.export.export(model, sample), sample, batches)
    return built


@pytest.fixture(scope="module")
def quantized(cases: dict) -> dict:
    """(model name, preset) -> quantized program, computed once for the module."""
    out = {}
    for name, (model, program, sample, batches) in cases.items():
        for preset in PRESETS:
            out[name, preset] = quantize_program(
                program, model.state_dict(), preset, batches, sample
            )
    return out


def _sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    noise = (reference - actual).pow(2).mean()
    return float(10 * torch.log10(reference.pow(2).mean() / noise))


def _calls(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.op == "call_function"]


def _is_float(node: object) -> bool:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _quantizers_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The quantize ops that read ``node`` directly."""
    return [u for u in node.users if u.target in (Q_TENSOR, Q_CHANNEL)]


def _source(dq: torch.fx.Node) -> torch.fx.Node:
    """The tensor a dequantize op's quantize reads."""
    return dq.args[0].args[0]


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", ["convnet", "decoder"])
def test_each_preset_quantizes_both_models(quantized: dict, name: str, preset: str) -> None:
    targets = {n.target for n in _calls(quantized[name, preset])}
    assert {Q_TENSOR, DQ_TENSOR, Q_CHANNEL, DQ_CHANNEL} <= targets


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", ["convnet", "decoder"])
def test_weights_are_per_channel_on_the_preset_grid(
    quantized: dict, name: str, preset: str
) -> None:
    """``w4a16_lpbq``: but a bias-free linear weight with blocks of 64 inputs (LPBQ)."""
    program = quantized[name, preset]
    params = program.graph_signature.inputs_to_parameters
    weighted = [n for n in _calls(program) if n.target in WEIGHTED]
    assert weighted
    for node in weighted:
        dq = node.args[1]
        if dq.target is qd.dequantize_per_channel_group.default:
            assert preset == "w4a16_lpbq" and node.target is aten.linear.default
            assert tuple(dq.args[3:7]) == (-8, 7, torch.int8, 64)
            assert (len(node.args) < 3 or node.args[2] is None) and dq.args[0].args[0].meta[
                "val"
            ].shape[1] % 64 == 0
            continue
        assert dq.target is DQ_CHANNEL and dq.args[0].target is Q_CHANNEL
        weight = dq.args[0].args[0]
        assert weight.name in params and params[weight.name].endswith("weight")
        assert tuple(dq.args[3:7]) == (0, *WEIGHT_GRID[preset], torch.int8)
        assert tuple(dq.args[0].args[3:7]) == (0, *WEIGHT_GRID[preset], torch.int8)
        bias = node.args[2] if len(node.args) > 2 else None
        assert bias is None or bias.name in params  # biases stay float


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", ["convnet", "decoder"])
def test_activations_are_per_tensor_on_the_preset_grid(
    quantized: dict, name: str, preset: str
) -> None:
    """Unsigned and asymmetric, or signed on the full grid where HTP wants them symmetric."""
    qmin, qmax, dtype = ACT_GRID[preset]
    bits = qmax.bit_length()
    signed = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1, {8: torch.int8, 16: torch.int16}[bits])
    quantizers = [n for n in _calls(quantized[name, preset]) if n.target is Q_TENSOR]
    assert len(quantizers) >= 4
    for node in quantizers:
        assert tuple(node.args[3:6]) in ((qmin, qmax, dtype), signed), node.format_node()


@pytest.mark.parametrize("preset", PRESETS)
def test_conv_relu_is_one_supergroup_quantized_after_the_relu(quantized: dict, preset: str) -> None:
    program = quantized["convnet", preset]
    for conv in (n for n in _calls(program) if n.target is aten.conv2d.default):
        (relu,) = conv.users
        assert relu.target is aten.relu.default and not _quantizers_of(conv)
        assert len(_quantizers_of(relu)) == 1


@pytest.mark.parametrize("preset", PRESETS)
def test_a_tensor_read_by_several_ops_has_one_quantizer(quantized: dict, preset: str) -> None:
    program = quantized["decoder", preset]
    sources = [n for n in _calls(program) if _quantizers_of(n)]
    for node in sources:  # nothing reads the unquantized value, one quantizer per tensor
        assert list(node.users) == _quantizers_of(node) and len(node.users) == 1
    readers = [sum(len(dq.users) for dq in _quantizers_of(n)[0].users) for n in sources]
    assert any(r > 1 for r in readers)  # the residual stream, an RMSNorm's output


def test_attention_key_is_symmetric_16_bit_with_16_bit_activations(quantized: dict) -> None:
    """HTP runs an activation MatMul with a 16-bit second input only if it is symmetric."""
    program = quantized["decoder", "w8a16"]
    matmuls = [n for n in _calls(program) if n.target is aten.matmul.default]
    assert len(matmuls) == 4  # q kᵀ and p v in each of two blocks
    for matmul in matmuls:
        source = matmul.args[1]
        while source.target is not DQ_TENSOR:  # through transpose / expand / reshape
            source = source.args[0]
        assert tuple(source.args[2:6]) == (0, -32768, 32767, torch.int16)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_softmax_input_step_is_at_least_the_htps_minimum(quantized: dict, preset: str) -> None:
    """The HTP's Softmax computes garbage from a finer input grid (rules/plan.py)."""
    from graphbuild.targets.qnn.rules.plan import SOFTMAX_MIN_INPUT_SCALE

    softmaxes = [n for n in _calls(quantized["decoder", preset]) if n.target in SOFTMAX]
    for node in softmaxes:
        source = node.args[0]
        while source.target is not DQ_TENSOR:
            source = source.args[0]
        assert source.args[1] >= SOFTMAX_MIN_INPUT_SCALE * (1 - 1e-6), source.args[1]


def test_a_narrow_range_widens_about_its_middle_to_the_minimum_step() -> None:
    from graphbuild.targets.qnn.presets.observers import quantization_spec

    def observer():  # as PT2E builds it from the spec
        spec = quantization_spec(16, symmetric=False, min_scale=2.0**-17)
        return spec.observer_or_fake_quant_ctr(
            dtype=spec.dtype,
            quant_min=spec.quant_min,
            quant_max=spec.quant_max,
            qscheme=spec.qscheme,
        )

    narrow = observer()
    narrow(torch.tensor([-0.01, 0.03]))
    scale, zero_point = narrow.calculate_qparams()
    assert float(scale) == pytest.approx(2.0**-17)
    low, high = float(scale) * (0 - int(zero_point)), float(scale) * (65535 - int(zero_point))
    assert low <= -0.01 and high >= 0.03
    assert (low + high) / 2 == pytest.approx(0.01, abs=2.0**-16)
    wide = observer()
    wide(torch.tensor([-3.0, 5.0]))
    assert float(wide.calculate_qparams()[0]) == pytest.approx(8.0 / 65535)


@pytest.mark.parametrize("preset", PRESETS)
def test_softmax_output_is_pinned_to_the_unit_range(quantized: dict, preset: str) -> None:
    qmin, qmax, _ = ACT_GRID[preset]
    softmaxes = [n for n in _calls(quantized["decoder", preset]) if n.target in SOFTMAX]
    assert softmaxes
    for node in softmaxes:
        (q,) = _quantizers_of(node)
        assert q.args[1] == pytest.approx(1.0 / qmax) and q.args[2] == 0


def test_integer_token_ids_are_not_quantized(quantized: dict) -> None:
    embedding = next(
        n for n in _calls(quantized["decoder", "w8a8"]) if n.target is aten.embedding.default
    )
    assert embedding.args[1].op == "placeholder"


@pytest.mark.parametrize(
    ("name", "preset", "floor"),
    [
        ("convnet", "w8a8", 25.0),
        ("convnet", "w8a16", 33.0),
        ("convnet", "w4a16", 12.0),
        ("decoder", "w8a8", 20.0),
        ("decoder", "w8a16", 30.0),
        ("decoder", "w4a16", 12.0),
    ],
)
def test_quantized_outputs_track_the_float_model(
    cases: dict, quantized: dict, name: str, preset: str, floor: float
) -> None:
    model = cases[name][0]
    torch.manual_seed(1)
    probe = (torch.randn(1, 3, 16, 16),) if name == "convnet" else (torch.randint(0, 64, (1, 8)),)
    with torch.no_grad():
        assert _sqnr(model(*probe), quantized[name, preset].module()(*probe)) > floor


def test_a16_beats_a8_with_the_same_weights(cases: dict, quantized: dict) -> None:
    model, _, sample, _ = cases["convnet"]
    with torch.no_grad():
        reference = model(*sample)
        a8 = _sqnr(reference, quantized["convnet", "w8a8"].module()(*sample))
        a16 = _sqnr(reference, quantized["convnet", "w8a16"].module()(*sample))
    assert a16 > a8 + 3.0


def test_op_zoo_is_fully_covered(tmp_path) -> None:
    """conv1d, gelu, sigmoid, tanh, bmm and scaled_dot_product_attention, spelled out for HTP:
    every tensor QNN HTP quantizes carries its quantizer."""
    torch.manual_seed(0)
    model, sample = OpZoo().eval(), (torch.randn(2, 4, 6),)
    art = gb.export(
        model,
        sample,
        tmp_path,
        "zoo",
        options=gb.QnnOnnxOptions(quantizer="w8a16", calibration=[sample], check_numerics=True),
        cache=False,
    )
    coverage = art.report.extra["coverage"]
    assert coverage["float"] == coverage["mismatched"] == coverage["extra"] == []
    assert coverage["expected"] >= 10


def test_in_place_relu_and_add_are_quantized_like_their_out_of_place_forms(tmp_path) -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.conv(x)
            out += x
            return self.relu(out)

    torch.manual_seed(0)
    sample = (torch.randn(1, 4, 8, 8),)
    art = gb.export(
        Residual().eval(),
        sample,
        tmp_path,
        "residual",
        options=gb.QnnOnnxOptions(quantizer="w8a8", calibration=[sample]),
        cache=False,
    )
    coverage = art.report.extra["coverage"]
    assert coverage["float"] == [] and coverage["expected"] == 4  # x, weight, conv, relu
    doc = json.loads((tmp_path / "residual.encodings").read_text())
    assert {e["name"] for e in doc["activation_encodings"]} == {"x", "conv2d", "output"}


class LinearOnlyInt8(Quantizer):
    """A minimal user quantizer: signed per-tensor int8 around every linear."""

    def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        spec = QuantizationSpec(
            dtype=torch.int8,
            observer_or_fake_quant_ctr=MinMaxObserver,
            quant_min=-128,
            quant_max=127,
            qscheme=torch.per_tensor_symmetric,
        )
        for node in model.graph.nodes:
            if node.target is aten.linear.default:
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={node.args[0]: spec, node.args[1]: spec},
                    output_qspec=spec,
                    _annotated=True,
                )
        return model

    def validate(self, model: torch.fx.GraphModule) -> None:
        pass


def test_custom_torchao_quantizer_is_accepted(cases: dict) -> None:
    model, program, sample, batches = cases["convnet"]
    quantized = quantize_program(program, model.state_dict(), LinearOnlyInt8(), batches, sample)
    quantizers = [n for n in _calls(quantized) if n.target is Q_TENSOR]
    assert len(quantizers) == 3  # input, weight and output of the one linear
    assert all(n.args[5] == torch.int8 for n in quantizers)
    assert not any(n.target is Q_CHANNEL for n in _calls(quantized))


def test_unknown_preset_raises_config_error_naming_the_presets(cases: dict) -> None:
    model, program, sample, batches = cases["convnet"]
    with pytest.raises(ConfigError, match="w8a8, w8a16, w4a16"):
        quantize_program(program, model.state_dict(), "w2a2", batches, sample)
    with pytest.raises(ConfigError):
        QnnQuantizer("int8")


def test_non_quantizer_object_raises_config_error(cases: dict) -> None:
    model, program, sample, batches = cases["convnet"]
    with pytest.raises(ConfigError, match="preset name"):
        quantize_program(program, model.state_dict(), object(), batches, sample)


def _placeholder(value: torch.Tensor) -> torch.Tensor:
    dummy = torch.zeros(1, dtype=value.dtype).expand(value.shape)
    return nn.Parameter(dummy, requires_grad=False) if isinstance(value, nn.Parameter) else dummy


def _structure_only(program: torch.export.ExportedProgram, share_ties: bool):
    """A copy of ``program`` whose state and constants are zero-stride placeholders."""
    memo: dict[int, torch.Tensor] = {}

    def dummy(value: torch.Tensor) -> torch.Tensor:
        key = id(value) if share_ties else len(memo)
        return memo.setdefault(key, _placeholder(value))

    empty = copy.copy(program)
    empty._state_dict = {k: dummy(v) for k, v in program.state_dict.items()}
    empty._constants = {k: dummy(v) for k, v in program.constants.items()}
    return empty


@pytest.mark.parametrize(
    "share_ties", [True, False], ids=["tied-once-in-state", "tied-under-both-names"]
)
def test_real_state_loads_into_a_placeholder_program(cases: dict, share_ties: bool) -> None:
    model, program, sample, batches = cases["decoder"]
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # ties once
    if not share_ties:
        state = {**model.state_dict(), "inv_freq": model.inv_freq}  # ties under both names
    empty = _structure_only(program, share_ties)
    quantized = quantize_program(empty, state, "w8a16", batches, sample)
    with torch.no_grad():
        assert _sqnr(model(*sample), quantized.module()(*sample)) > 30.0


def test_missing_state_for_a_placeholder_raises(cases: dict) -> None:
    model, program, sample, batches = cases["convnet"]
    state = {k: v for k, v in model.state_dict().items() if k != "fc.weight"}
    with pytest.raises(ExportError, match="fc.weight"):
        quantize_program(_structure_only(program, True), state, "w8a8", batches, sample)


def test_empty_calibration_warns_and_uses_the_sample_inputs(cases: dict) -> None:
    model, program, sample, _ = cases["convnet"]
    with pytest.warns(UserWarning, match="no calibration batches"):
        quantized = quantize_program(program, model.state_dict(), "w8a8", [], sample)
    with torch.no_grad():
        assert _sqnr(model(*sample), quantized.module()(*sample)) > 25.0


def test_calibration_batches_may_be_single_tensors(cases: dict) -> None:
    model, program, sample, batches = cases["convnet"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        quantized = quantize_program(
            program, model.state_dict(), "w8a8", (b[0] for b in batches), sample
        )
    assert any(n.target is Q_CHANNEL for n in _calls(quantized))


class InfMask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x + torch.full((4, 4), float("-inf")).triu(1), dim=-1)


class DynamicInf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(torch.where(x > 0.5, float("-inf"), x), dim=-1)


def test_infinite_mask_stays_float_and_is_named_when_asked_to_drop() -> None:
    model, sample = InfMask(), (torch.randn(1, 4, 4),)
    result = quantize(
        torch.export.export(model, sample), {}, "w8a8", [sample], sample, drop_non_finite=True
    )
    assert "add" in result.left_float and "non-finite" in result.left_float["add"]
    softmax = next(n for n in _calls(result.program) if n.target in SOFTMAX)
    assert _quantizers_of(softmax)  # its output is finite: quantized
    with torch.no_grad():
        expected = model(*sample)
        assert torch.allclose(result.program.module()(*sample), expected, atol=1.0 / 255)


def test_non_finite_activation_range_raises() -> None:
    model, sample = DynamicInf(), (torch.randn(1, 4, 4),)
    with pytest.raises(ExportError, match="not finite"):
        quantize_program(torch.export.export(model, sample), {}, "w8a8", [sample], sample)
