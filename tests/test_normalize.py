"""normalize: quantizers become markers, the quant map says what they were, values come apart."""

from __future__ import annotations

import io

import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed ops)
from torch import nn
from torch.export import ExportedProgram

from graphbuild.errors import UnknownQuantizerError
from graphbuild.frontend.normalize import (
    Match,
    collect_qvalues,
    looks_like_quantizer,
    normalize_program,
    recognizers,
    register_recognizer,
    unregister_recognizer,
    value_ref,
)
from graphbuild.quant.markers import MARKER_TARGET, is_marker
from graphbuild.quant.quantmap import QuantMap, ValueRef

qd = torch.ops.quantized_decomposed


@torch.library.custom_op("gbtest::fake_quantize_int4", mutates_args=())
def fake_quantize_int4(x: torch.Tensor, scale: float) -> torch.Tensor:
    """A custom quantizer op no built-in recogniser knows."""
    return torch.clamp(torch.round(x / scale), -8, 7) * scale


@fake_quantize_int4.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


# ---------------------------------------------------------------------------------------------
# Models: each has ``quant``; with ``quant = False`` it is the model with quantizers removed.
# ---------------------------------------------------------------------------------------------


class QModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = True
        self.lin = nn.Linear(4, 3)

    def fq(self, fn, x, *args):
        return fn(x, *args) if self.quant else x


class PerTensorLiteral(QModel):
    def __init__(self, scale: float = 0.1, zp: int = 3) -> None:
        super().__init__()
        self.scale, self.zp = scale, zp

    def forward(self, x):
        x = self.fq(torch.fake_quantize_per_tensor_affine, x, self.scale, self.zp, -128, 127)
        y = self.lin(x)
        return self.fq(torch.fake_quantize_per_tensor_affine, y, self.scale / 2, 0, 0, 255)


class PerTensorBuffer(QModel):
    def __init__(self, scale: float = 0.05, zp: int = 0) -> None:
        super().__init__()
        self.register_buffer("s", torch.tensor([scale]))
        self.register_buffer("z", torch.tensor([zp], dtype=torch.int32))

    def forward(self, x):
        x = self.fq(torch.fake_quantize_per_tensor_affine, x, self.s, self.z, -127, 127)
        return self.lin(x)


class PerChannelWeight(QModel):
    def __init__(self, scale: float = 0.02) -> None:
        super().__init__()
        self.register_buffer("ws", torch.full((3,), scale) * torch.tensor([1.0, 2.0, 3.0]))
        self.register_buffer("wz", torch.tensor([0, 1, -1], dtype=torch.int32))

    def forward(self, x):
        w = self.lin.weight
        if self.quant:
            w = torch.fake_quantize_per_channel_affine(w, self.ws, self.wz, 0, -8, 7)
        return nn.functional.linear(x, w, self.lin.bias)


class Learnable(QModel):
    def __init__(self, scale: float = 0.1, zp: float = 2.6) -> None:
        super().__init__()
        self.a_scale = nn.Parameter(torch.tensor([scale]))
        self.a_zp = nn.Parameter(torch.tensor([float(zp)]))
        self.w_scale = nn.Parameter(torch.full((3,), scale / 10))
        self.w_zp = nn.Parameter(torch.tensor([0.4, -0.6, 9.0]))

    def forward(self, x):
        if self.quant:
            x = torch._fake_quantize_learnable_per_tensor_affine(x, self.a_scale, self.a_zp, 0, 255)
            w = torch._fake_quantize_learnable_per_channel_affine(
                self.lin.weight, self.w_scale, self.w_zp, 0, -8, 7
            )
        else:
            w = self.lin.weight
        return nn.functional.linear(x, w, self.lin.bias)


class QDQ(QModel):
    """What convert_pt2e(fold_quantize=False) emits, written by hand."""

    def __init__(self, scale: float = 0.05, zp: int = 2) -> None:
        super().__init__()
        self.scale, self.zp = scale, zp
        self.register_buffer("s", torch.tensor(scale * 2))
        self.register_buffer("z", torch.tensor(-3, dtype=torch.int64))
        self.register_buffer("ws", torch.full((3,), scale / 4))
        self.register_buffer("wz", torch.zeros(3, dtype=torch.int64))

    def forward(self, x):
        if not self.quant:
            y = self.lin(x)
            return y + y.relu()
        args = (self.scale, self.zp, -128, 127, torch.int8)
        x = qd.dequantize_per_tensor(qd.quantize_per_tensor(x, *args), *args)
        cargs = (self.ws, self.wz, 0, -127, 127, torch.int8)
        w = qd.dequantize_per_channel(qd.quantize_per_channel(self.lin.weight, *cargs), *cargs)
        y = nn.functional.linear(x, w, self.lin.bias)
        targs = (self.s, self.z, 0, 65535, torch.uint16)
        q = qd.quantize_per_tensor.tensor(y, *targs)
        return (
            qd.dequantize_per_tensor.tensor(q, *targs)
            + qd.dequantize_per_tensor.tensor(q, *targs).relu()
        )


def export(model: nn.Module, x: torch.Tensor) -> ExportedProgram:
    return torch.export.export(model.eval(), (x,))


def unquantized(model: QModel, x: torch.Tensor) -> torch.Tensor:
    model.quant = False
    try:
        return model(x)
    finally:
        model.quant = True


def check_normalized(model: QModel, program: ExportedProgram) -> tuple[ExportedProgram, QuantMap]:
    """Normalize; check it runs as the model without quantizers and leaves no quant op."""
    before = (str(program.graph), str(program.graph_signature), set(program.state_dict))
    out, qmap = normalize_program(program)
    assert (str(program.graph), str(program.graph_signature), set(program.state_dict)) == before
    ops = [n for n in out.graph.nodes if n.op == "call_function"]
    assert not any(looks_like_quantizer(n.target) for n in ops)
    markers = [n for n in ops if is_marker(n)]
    assert [n.args[1] for n in markers] == list(range(len(qmap)))
    assert [s.qid for s in qmap] == list(range(len(qmap)))
    x = torch.randn(2, 4)
    torch.testing.assert_close(out.module()(x), unquantized(model, x))
    return out, qmap


def input_names(program: ExportedProgram) -> set[str]:
    return {s.target or s.arg.name for s in program.graph_signature.input_specs}


# ---------------------------------------------------------------------------------------------


def test_fake_quant_per_tensor_literals():
    model = PerTensorLiteral()
    program = export(model, torch.randn(2, 4))
    out, qmap = check_normalized(model, program)
    a, y = qmap
    assert (a.bits, a.signed, a.qmin, a.qmax, a.axis, a.param) == (8, True, -128, 127, None, None)
    assert (y.bits, y.signed, y.qmin, y.qmax) == (8, False, 0, 255)
    assert a.op == "aten.fake_quantize_per_tensor_affine.default"
    assert a.scale == ValueRef("literal", f"{a.node}:1")
    assert a.zero_point == ValueRef("literal", f"{a.node}:2")
    assert a.granularity == "PER_TENSOR"
    values = collect_qvalues(program, qmap)
    assert values[0].scale.dtype == torch.float32 and values[0].scale.shape == (1,)
    assert values[0].zero_point.dtype == torch.int64
    torch.testing.assert_close(values[0].scale, torch.tensor([0.1]))
    assert values[0].zero_point.tolist() == [3]
    torch.testing.assert_close(values[1].scale, torch.tensor([0.05]))
    assert values[1].zero_point.tolist() == [0]
    assert input_names(out) == input_names(program)


def test_fake_quant_per_tensor_buffers_are_removed():
    model = PerTensorBuffer(scale=0.25, zp=-3)
    program = export(model, torch.randn(2, 4))
    out, qmap = check_normalized(model, program)
    (spec,) = qmap
    assert (spec.bits, spec.signed, spec.qmin, spec.qmax) == (8, True, -127, 127)
    assert spec.op == "aten.fake_quantize_per_tensor_affine.tensor_qparams"
    assert spec.scale == ValueRef("state", "s") and spec.zero_point == ValueRef("state", "z")
    assert {"s", "z"} <= input_names(program)
    assert not {"s", "z"} & input_names(out)
    assert set(out.state_dict) == {"lin.weight", "lin.bias"}
    assert out.state_dict["lin.weight"] is program.state_dict["lin.weight"]  # shared, not copied
    values = collect_qvalues(program, qmap)
    assert values[0].scale.tolist() == [0.25] and values[0].zero_point.tolist() == [-3]
    new_state = dict(program.state_dict, s=torch.tensor([0.5]), z=torch.tensor([4]))
    values = collect_qvalues(program, qmap, new_state)
    assert values[0].scale.tolist() == [0.5] and values[0].zero_point.tolist() == [4]


def test_fake_quant_per_channel_weight():
    model = PerChannelWeight()
    program = export(model, torch.randn(2, 4))
    out, qmap = check_normalized(model, program)
    (spec,) = qmap
    assert (spec.bits, spec.signed, spec.qmin, spec.qmax) == (4, True, -8, 7)
    assert (spec.axis, spec.param, spec.granularity) == (0, "lin.weight", "PER_CHANNEL")
    assert spec.scale == ValueRef("state", "ws") and spec.zero_point == ValueRef("state", "wz")
    assert "lin.weight" in out.state_dict and not {"ws", "wz"} & set(out.state_dict)
    values = collect_qvalues(program, qmap)
    torch.testing.assert_close(values[0].scale, model.ws)
    assert values[0].zero_point.tolist() == [0, 1, -1]
    assert values[0].zero_point.dtype == torch.int64


def test_learnable_fake_quant():
    model = Learnable()
    program = export(model, torch.randn(2, 4))
    out, qmap = check_normalized(model, program)
    act, weight = sorted(qmap, key=lambda s: s.axis is not None)
    assert (act.bits, act.signed, act.axis, act.param) == (8, False, None, None)
    assert act.op == "aten._fake_quantize_learnable_per_tensor_affine.default"
    assert act.scale == ValueRef("state", "a_scale") and act.zero_point.kind == "state"
    assert (weight.bits, weight.signed, weight.axis, weight.param) == (4, True, 0, "lin.weight")
    assert set(out.state_dict) == {"lin.weight", "lin.bias"}
    values = collect_qvalues(program, qmap)
    assert values[act.qid].zero_point.tolist() == [3]  # 2.6 rounded
    assert values[weight.qid].zero_point.tolist() == [0, -1, 7]  # rounded, clamped as ATen does
    torch.testing.assert_close(values[weight.qid].scale, torch.full((3,), 0.01))


def test_quantize_dequantize_pairs():
    model = QDQ()
    program = export(model, torch.randn(2, 4))
    out, qmap = check_normalized(model, program)
    a, w, y = qmap
    assert a.op == "quantized_decomposed.quantize_per_tensor.default"
    assert (a.bits, a.signed, a.scale.kind, a.zero_point.kind) == (8, True, "literal", "literal")
    assert a.scale.name == f"{a.node}:1"
    assert w.op == "quantized_decomposed.quantize_per_channel.default"
    assert (w.bits, w.axis, w.param, w.qmin, w.qmax) == (8, 0, "lin.weight", -127, 127)
    assert y.op == "quantized_decomposed.quantize_per_tensor.tensor"
    assert (y.bits, y.signed, y.qmin, y.qmax) == (16, False, 0, 65535)
    assert y.scale == ValueRef("state", "s")
    # one quantize feeding two dequantize nodes: one marker, used twice
    markers = [n for n in out.graph.nodes if is_marker(n)]
    assert len(markers) == 3 and len(markers[2].users) == 2
    assert set(out.state_dict) == {"lin.weight", "lin.bias"}
    values = collect_qvalues(program, qmap)
    torch.testing.assert_close(values[0].scale, torch.tensor([0.05]))
    assert values[0].zero_point.tolist() == [2]
    torch.testing.assert_close(values[1].scale, torch.full((3,), 0.0125))
    assert values[2].scale.shape == (1,) and values[2].zero_point.tolist() == [-3]


def test_quantize_tensor2_overload_reads_grid_from_constants():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("s", torch.tensor([0.1]))
            self.register_buffer("z", torch.tensor([0]))
            self.lo, self.hi = torch.tensor(-8), torch.tensor(7)  # lifted constants

        def forward(self, x):
            args = (self.s, self.z, self.lo, self.hi, torch.int8)
            return qd.dequantize_per_tensor.tensor2(qd.quantize_per_tensor.tensor2(x, *args), *args)

    program = export(M(), torch.randn(2, 4))
    out, qmap = normalize_program(program)
    (spec,) = qmap
    assert (spec.bits, spec.qmin, spec.qmax) == (4, -8, 7)
    assert out.graph_signature.input_specs[-1].arg.name == "x"
    assert len(out.graph_signature.input_specs) == 1 and not out.constants


def test_constant_and_nonpersistent_scales():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("s", torch.tensor([0.05]), persistent=False)
            self.c = torch.tensor([0.02])  # a plain tensor attribute: a lifted constant

        def forward(self, x):
            zp = torch.tensor([1], dtype=torch.int32)  # made in forward: constant via lift_fresh
            x = torch.fake_quantize_per_tensor_affine(x, self.s, zp, -128, 127)
            zeros = torch.zeros(1, dtype=torch.int32)
            return torch.fake_quantize_per_tensor_affine(x, self.c, zeros, -128, 127) * 2

    program = export(M(), torch.randn(2, 4))
    out, qmap = normalize_program(program)
    a, b = qmap
    assert a.scale == ValueRef("state", "s") and a.zero_point.kind == "constant"
    assert b.scale == ValueRef("constant", "c") and b.zero_point is None
    assert not out.constants and not out.state_dict
    assert [s.arg.name for s in out.graph_signature.input_specs] == ["x"]
    assert [n.target for n in out.graph.nodes if n.op == "call_function"] == [
        MARKER_TARGET,
        MARKER_TARGET,
        torch.ops.aten.mul.Tensor,
    ]
    values = collect_qvalues(program, qmap)
    assert values[0].scale.tolist() == pytest.approx([0.05]) and values[0].zero_point.tolist() == [
        1
    ]
    assert values[1].scale.tolist() == pytest.approx([0.02]) and values[1].zero_point.tolist() == [
        0
    ]
    x = torch.randn(2, 4)
    torch.testing.assert_close(out.module()(x), x * 2)


def test_chained_quantizers():
    class M(nn.Module):
        def forward(self, x):
            x = torch.fake_quantize_per_tensor_affine(x, 0.1, 0, -128, 127)
            x = torch.fake_quantize_per_tensor_affine(x, 0.2, 0, -8, 7)
            args = (0.3, 1, 0, 255, torch.uint8)
            return qd.dequantize_per_tensor(qd.quantize_per_tensor(x, *args), *args) * 3

    out, qmap = normalize_program(export(M(), torch.randn(2, 4)))
    markers = [n for n in out.graph.nodes if is_marker(n)]
    assert [m.args[0].name for m in markers] == ["x", markers[0].name, markers[1].name]
    assert [s.bits for s in qmap] == [8, 4, 8]
    x = torch.randn(2, 4)
    torch.testing.assert_close(out.module()(x), x * 3)


def test_dynamic_shapes_survive():
    model = QDQ()
    batch = torch.export.Dim("batch")
    program = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    out, _ = normalize_program(program)
    assert out.range_constraints.keys() == program.range_constraints.keys()
    x = torch.randn(7, 4)
    torch.testing.assert_close(out.module()(x), unquantized(model, x))


@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr Node")
def test_module_call_signature_follows_renamed_outputs():
    class Inner(nn.Module):
        def forward(self, x):
            return torch.fake_quantize_per_tensor_affine(x.relu(), 0.1, 0, -128, 127)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x) + 1

    program = torch.export.export(
        Outer(), (torch.randn(2, 4),), preserve_module_call_signature=("inner",)
    )
    out, _ = normalize_program(program)
    entry = next(e for e in out.module_call_graph if e.fqn == "inner")
    names = {n.name for n in out.graph.nodes}
    assert all(arg.name in names for arg in entry.signature.outputs)
    x = torch.randn(2, 4)
    torch.testing.assert_close(torch.export.unflatten(out)(x), x.relu() + 1)


@pytest.mark.parametrize("make", [PerTensorLiteral, PerTensorBuffer, Learnable, QDQ])
def test_marker_graph_is_value_free(make):
    x = torch.randn(2, 4)
    torch.manual_seed(0)
    first = normalize_program(export(make(), x))
    torch.manual_seed(1)
    second_model = make(0.37, 5)
    second = normalize_program(export(second_model, x))
    (p1, q1), (p2, q2) = first, second
    assert str(p1.graph) == str(p2.graph)
    assert str(p1.graph_signature) == str(p2.graph_signature)
    assert q1 == q2
    assert not torch.equal(p1.state_dict["lin.weight"], p2.state_dict["lin.weight"])


def test_normalized_program_round_trips_through_torch_export_save():
    model = QDQ()
    out, _ = normalize_program(export(model, torch.randn(2, 4)))
    buffer = io.BytesIO()
    torch.export.save(out, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    assert str(loaded.graph) == str(out.graph)
    x = torch.randn(2, 4)
    torch.testing.assert_close(loaded.module()(x), out.module()(x))


def test_decomposed_fake_quant_is_recognised():
    model = PerTensorBuffer()
    program = export(model, torch.randn(2, 4)).run_decompositions()
    out, qmap = check_normalized(model, program)
    assert qmap[0].op.startswith("aten._fake_quantize_per_tensor_affine_cachemask")
    assert qmap[0].scale == ValueRef("state", "s")
    names = {n.name for n in out.graph.nodes}
    assert not any(name.startswith(("full", "getitem")) for name in names)


# ---------------------------------------------------------------------------------------------
# Unknown ops and user recognisers
# ---------------------------------------------------------------------------------------------


class CustomQuant(nn.Module):
    def forward(self, x):
        return torch.ops.gbtest.fake_quantize_int4(x, 0.5) + 1


class Int4Recognizer:
    def match(self, node, program):
        if node.target is not torch.ops.gbtest.fake_quantize_int4.default:
            return None
        return Match(
            input=node.args[0],
            replaces=(node,),
            op=str(node.target),
            qmin=-8,
            qmax=7,
            scale=value_ref(program, node, 1),
        )


@pytest.fixture
def int4_recognizer():
    recognizer = register_recognizer(Int4Recognizer(), first=True)
    try:
        yield recognizer
    finally:
        unregister_recognizer(recognizer)


def test_unknown_quantization_op_is_an_error():
    assert looks_like_quantizer(torch.ops.aten.quantize_per_tensor.default)
    assert looks_like_quantizer(torch.ops.aten.fake_quantize_per_tensor_affine.default)
    assert looks_like_quantizer(torch.ops.gbtest.fake_quantize_int4.default)
    assert not looks_like_quantizer(torch.ops.aten.linear.default)
    assert not looks_like_quantizer(MARKER_TARGET)
    program = export(CustomQuant(), torch.randn(2, 4))
    with pytest.raises(UnknownQuantizerError) as err:
        normalize_program(program)
    message = str(err.value)
    assert "gbtest.fake_quantize_int4.default" in message
    assert "'fake_quantize_int4'" in message and "register_recognizer" in message


def test_lone_dequantize_points_at_fold_quantize():
    class Folded(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randint(-128, 127, (3, 4), dtype=torch.int8))

        def forward(self, x):
            w = qd.dequantize_per_tensor(self.w, 0.1, 0, -128, 127, torch.int8)
            return nn.functional.linear(x, w)

    with pytest.raises(UnknownQuantizerError, match="fold_quantize=False"):
        normalize_program(export(Folded(), torch.randn(2, 4)))


def test_user_recognizer(int4_recognizer):
    assert recognizers()[0] is int4_recognizer
    program = export(CustomQuant(), torch.randn(2, 4))
    out, qmap = normalize_program(program)
    (spec,) = qmap
    assert (spec.bits, spec.signed, spec.op) == (4, True, "gbtest.fake_quantize_int4.default")
    assert spec.scale.kind == "literal"
    assert collect_qvalues(program, qmap)[0].scale.tolist() == [0.5]
    x = torch.randn(2, 4)
    torch.testing.assert_close(out.module()(x), x + 1)


def test_user_recognizer_is_unregistered_after_fixture():
    assert not any(isinstance(r, Int4Recognizer) for r in recognizers())


# ---------------------------------------------------------------------------------------------
# The real thing: torchao PT2E convert
# ---------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:XNNPACKQuantizer is deprecated")
def test_torchao_convert_pt2e_output():
    pt2e = pytest.importorskip(
        "torchao.quantization.pt2e.quantize_pt2e", reason="this torchao has no PT2E quantization"
    )
    xnn = pytest.importorskip(
        "torchao.testing.pt2e._xnnpack_quantizer",
        reason="this torchao has no XNNPACK test quantizer",
    )

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x).relu()

    model, x = M().eval(), torch.randn(8, 4)
    quantizer = xnn.XNNPACKQuantizer().set_global(
        xnn.get_symmetric_quantization_config(is_per_channel=True)
    )
    prepared = pt2e.prepare_pt2e(torch.export.export(model, (x,)).module(), quantizer)
    prepared(x)
    converted = pt2e.convert_pt2e(prepared, fold_quantize=False)
    program = torch.export.export(converted, (x,))
    out, qmap = normalize_program(program)
    assert {s.op.split(".")[0] for s in qmap} == {"quantized_decomposed"}
    weight = next(s for s in qmap if s.param == "lin.weight")
    assert (weight.axis, weight.qmin, weight.qmax, weight.scale.kind) == (0, -127, 127, "state")
    assert set(out.state_dict) == {"lin.weight", "lin.bias"}
    values = collect_qvalues(program, qmap)
    assert all(v.scale.dtype == torch.float32 for v in values.values.values())
    torch.testing.assert_close(out.module()(x), model(x))


# ---------------------------------------------------------------------------------------------
# Node names the graph copy would change (a placeholder ``input`` shadows a builtin)
# ---------------------------------------------------------------------------------------------


class FakeQuantModule(nn.Module):
    """A fake quantizer with buffer qparams whose forward argument is named ``input``."""

    def __init__(self, scale: float = 0.1, zp: int = 0) -> None:
        super().__init__()
        self.quant = True
        self.register_buffer("s", torch.tensor([scale]))
        self.register_buffer("z", torch.tensor([zp], dtype=torch.int32))

    def forward(self, input):
        if not self.quant:
            return input
        return torch.fake_quantize_per_tensor_affine(input, self.s, self.z, -128, 127)


class OwnInputQDQ(nn.Module):
    """Its own forward argument is named ``input``; a q/dq pair on it."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = True
        self.lin = nn.Linear(4, 3)

    def forward(self, input):
        if self.quant:
            args = (0.05, 2, -128, 127, torch.int8)
            input = qd.dequantize_per_tensor(qd.quantize_per_tensor(input, *args), *args)
        return self.lin(input).relu()


def assert_signature_matches_graph(program: ExportedProgram) -> None:
    placeholders = [n.name for n in program.graph.find_nodes(op="placeholder")]
    assert [s.arg.name for s in program.graph_signature.input_specs] == placeholders
    outputs = program.graph.output_node().args[0]
    assert [s.arg.name for s in program.graph_signature.output_specs] == [n.name for n in outputs]


def normalize_twice(program: ExportedProgram) -> ExportedProgram:
    """Normalize; check the result is valid and its graph text deterministic."""
    out, _ = normalize_program(program)
    again, _ = normalize_program(program)
    assert str(out.graph) == str(again.graph)
    assert str(out.graph_signature) == str(again.graph_signature)
    assert_signature_matches_graph(out)
    return out


def test_sequential_with_fake_quant_module_taking_input():
    fq = FakeQuantModule(scale=0.25, zp=1)
    model = nn.Sequential(nn.Linear(4, 4), fq, nn.ReLU())
    program = export(model, torch.randn(2, 4))
    assert "input" in [n.name for n in program.graph.find_nodes(op="placeholder")]
    out = normalize_twice(program)
    assert list(out.graph_signature.user_inputs) == ["input"]
    assert set(out.state_dict) == {"0.weight", "0.bias"}
    qmap = normalize_program(program)[1]
    (spec,) = qmap
    assert spec.scale == ValueRef("state", "1.s") and spec.zero_point == ValueRef("state", "1.z")
    assert collect_qvalues(program, qmap)[0].scale.tolist() == [0.25]
    x = torch.randn(2, 4)
    fq.quant = False  # markers are identity
    torch.testing.assert_close(out.module()(x), model(x))


def test_own_forward_argument_named_input_with_qdq_pair():
    model = OwnInputQDQ()
    program = export(model, torch.randn(2, 4))
    out = normalize_twice(program)
    (marker,) = [n for n in out.graph.nodes if is_marker(n)]
    assert marker.args[0].name == "input"
    assert list(out.graph_signature.user_inputs) == ["input"]
    x = torch.randn(2, 4)
    model.quant = False
    torch.testing.assert_close(out.module()(x), model(x))
    buffer = io.BytesIO()
    torch.export.save(out, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.export.load(buffer).module()(x), model(x))


def test_output_that_is_a_quantizer_output_stays_valid():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fq = FakeQuantModule()

        def forward(self, input):
            args = (0.1, 0, 0, 255, torch.uint8)
            y = qd.dequantize_per_tensor(qd.quantize_per_tensor(input, *args), *args)
            return self.fq(input.relu()), y

    program = export(M(), torch.randn(2, 4))
    out = normalize_twice(program)
    markers = [n for n in out.graph.nodes if is_marker(n)]
    assert len(markers) == 2
    assert set(out.graph.output_node().args[0]) == set(markers)
    assert set(out.graph_signature.user_outputs) == {m.name for m in markers}
    x = torch.randn(2, 4)
    a, b = out.module()(x)
    torch.testing.assert_close(a, x.relu())
    torch.testing.assert_close(b, x)


def test_names_that_collide_with_renamed_copies_are_kept():
    class M(nn.Module):
        def forward(self, input, input_1):
            x = torch.fake_quantize_per_tensor_affine(input, 0.1, 0, -128, 127)
            return x + input_1

    program = torch.export.export(M(), (torch.randn(2, 4), torch.randn(2, 4)))
    out = normalize_twice(program)
    names = list(out.graph_signature.user_inputs)
    assert names == list(program.graph_signature.user_inputs) == ["input", "input_1"]
    (marker,) = [n for n in out.graph.nodes if is_marker(n)]
    assert marker.args[0].name == "input"
    assert [a.name for a in next(iter(marker.users)).args] == [marker.name, "input_1"]
    # not run: torch's FX codegen already miscompiles these two names in the exported program
