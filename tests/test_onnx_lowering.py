"""to_onnx (skeleton), lower_markers and bind, checked against torch in onnxruntime.

Scales are powers of two and inputs dyadic, so torch (x * 1/s) and onnxruntime (x / s) round
the same values the same way and the comparisons can be exact up to float noise.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphbuild.quant.markers  # noqa: F401  - registers torch.ops.graphbuild.q
from graphbuild.errors import ExportError, SkeletonValueError
from graphbuild.onnx import skeleton as onnx_export
from graphbuild.onnx.bind import BoundModel, bind
from graphbuild.onnx.lower import QID_KEY, QPARAMS_LOCATION, ROLE_KEY, lower_markers
from graphbuild.onnx.save import materialize, save_model
from graphbuild.onnx.skeleton import STATE_LOCATION, export_skeleton
from graphbuild.quant.quantmap import QParams, QuantMap, QuantSpec, QuantValues


def marker(t: torch.Tensor, qid: int) -> torch.Tensor:
    return torch.ops.graphbuild.q(t, qid)


def identity(t: torch.Tensor, qid: int) -> torch.Tensor:
    return t


class ConvNet(nn.Module):
    """Quantized input (0), conv weight (1) and output (2), the output marker feeding the
    graph output; ``quant`` is the marker for export, a torch fake-quantizer for reference."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.quant = marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        y = F.conv2d(q(x, 0), q(self.conv.weight, 1), self.conv.bias)
        return q(F.relu(y), 2)


class LinearNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.quant = marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        return q(F.linear(q(x, 0), q(self.fc.weight, 1), self.fc.bias), 2)


class BiasNet(nn.Module):
    """An int32-quantized bias: lowered to DequantizeLinear of a precomputed int32 tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.quant = marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.conv.weight, self.quant(self.conv.bias, 0)) * 2


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("offset", torch.tensor([0.5, 1.0, 1.5, 2.0]), persistent=False)
        self.scale = torch.tensor([3.0])  # a lifted constant: code, kept in the skeleton

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.bn(self.conv(marker(x, 0))) * self.scale + self.offset.view(1, 4, 1, 1)
        z = torch.relu(y)
        w = marker(z, 2) * 2  # annotates z before marker 3 renames z to the output's name
        return y, marker(x, 1), w, marker(z, 3)  # marker 1: an input straight into an output


def dyadic(shape: tuple[int, ...], low: int, high: int, step: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).float() * step


def make_conv() -> ConvNet:
    torch.manual_seed(0)
    m = ConvNet().eval()
    with torch.no_grad():
        m.conv.weight.copy_(torch.randn(4, 3, 3, 3) * 0.1)
        m.conv.bias.copy_(dyadic((4,), -8, 8, 2**-4, 1))
    return m


CONV_X = dyadic((1, 3, 8, 8), -160, 160, 2**-3, 2)  # beyond the input grids: saturates


def state_of(m: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(m.named_parameters()), **dict(m.named_buffers())}


def skeleton_of(m: nn.Module, x: torch.Tensor, **kw) -> onnx.ModelProto:
    return export_skeleton(torch.export.export(m, (x,)), **kw)


@pytest.fixture(scope="module")
def conv_skeleton() -> onnx.ModelProto:
    return skeleton_of(make_conv(), CONV_X)


# -- quantizers ---------------------------------------------------------------------------------


def spec(qid, bits, signed, grid=None, axis=None, block=None, param=None) -> QuantSpec:
    lo, hi = grid or ((-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1))
    return QuantSpec(qid, bits, signed, lo, hi, axis=axis, block_size=block, param=param)


def qparams(scale, zero_point) -> QParams:
    s = torch.tensor(scale, dtype=torch.float32)
    z = torch.tensor(zero_point, dtype=torch.int64)
    return QParams(s.reshape(-1) if s.dim() < 2 else s, z.reshape(-1) if z.dim() < 2 else z)


def reference_quant(qmap: QuantMap, qvalues: QuantValues, only_params: bool = False):
    """Fake quantization with torch's own ops (manual math for blocked and 32-bit grids)."""

    def quant(t: torch.Tensor, qid: int) -> torch.Tensor:
        sp, qp = qmap[qid], qvalues[qid]
        if only_params and sp.param is None:
            return t
        if sp.block_size is not None or sp.bits > 16:
            s, z = qp.scale.float(), qp.zero_point.float()
            if sp.block_size is not None:
                s = s.repeat_interleave(sp.block_size, dim=sp.axis)
                z = z.repeat_interleave(sp.block_size, dim=sp.axis)
            return s * (torch.clamp(torch.round(t / s) + z, sp.qmin, sp.qmax) - z)
        if sp.axis is None:
            s, z = float(qp.scale), int(qp.zero_point)
            return torch.fake_quantize_per_tensor_affine(t, s, z, sp.qmin, sp.qmax)
        z = qp.zero_point.int()
        return torch.fake_quantize_per_channel_affine(t, qp.scale, z, sp.axis, sp.qmin, sp.qmax)

    return quant


def torch_out(m: nn.Module, x: torch.Tensor, quant) -> np.ndarray:
    m.quant = quant
    try:
        with torch.no_grad():
            return m(x).numpy()
    finally:
        m.quant = marker


def run_ort(model: onnx.ModelProto | str, x: torch.Tensor) -> list[np.ndarray]:
    source = model if isinstance(model, str) else model.SerializeToString()
    sess = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})


def conv_quant(kind: str) -> tuple[QuantMap, QuantValues]:
    w = "conv.weight"
    w_scales = [2**-5, 2**-6, 2**-5, 2**-7]
    if kind == "int8":
        specs = (spec(0, 8, False), spec(1, 8, True, axis=0, param=w), spec(2, 8, False))
        values = [([2**-3], [128]), (w_scales, [0] * 4), ([2**-4], [0])]
    elif kind == "int4":
        specs = (spec(0, 8, False), spec(1, 4, True, axis=0, param=w), spec(2, 8, False))
        values = [([2**-3], [128]), ([2**-4, 2**-5, 2**-4, 2**-5], [0, 1, -1, 0]), ([2**-4], [3])]
    elif kind == "uint16":
        specs = (spec(0, 16, False), spec(1, 8, True, axis=0, param=w), spec(2, 16, False))
        values = [([2**-8], [32768]), (w_scales, [0] * 4), ([2**-6], [1000])]
    elif kind == "narrow":  # int8 on [-127, 127]: Clip per tensor, Max/Min per channel
        narrow = (-127, 127)
        specs = (
            spec(0, 8, True, grid=narrow),
            spec(1, 8, True, grid=narrow, axis=0, param=w),
            spec(2, 8, False),
        )
        values = [([2**-3], [0]), ([2**-9, 2**-8, 2**-9, 2**-10], [0, 2, 0, -3]), ([2**-4], [0])]
    else:
        raise AssertionError(kind)
    return QuantMap(specs), QuantValues({i: qparams(*v) for i, v in enumerate(values)})


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def assert_no_markers(model: onnx.ModelProto) -> None:
    assert all(n.domain != "graphbuild" for n in model.graph.node)
    assert all(o.domain != "graphbuild" for o in model.opset_import)


# -- skeleton -----------------------------------------------------------------------------------


def test_skeleton_holds_no_state_values(conv_skeleton):
    blob = conv_skeleton.SerializeToString()
    for t in state_of(make_conv()).values():
        assert t.detach().numpy().tobytes() not in blob
    inits = {i.name: i for i in conv_skeleton.graph.initializer}
    assert set(inits) == {"conv.weight", "conv.bias"}
    for init in inits.values():
        assert init.data_location == onnx.TensorProto.EXTERNAL and not init.raw_data
        assert {e.key: e.value for e in init.external_data}["location"] == STATE_LOCATION
    assert all(
        "pkg.torch.onnx.stack_trace" not in {p.key for p in n.metadata_props}
        for n in conv_skeleton.graph.node
    )


def test_skeleton_ignores_state_values_and_is_deterministic(conv_skeleton):
    program = torch.export.export(make_conv(), (CONV_X,))
    for name, t in list(program.state_dict.items()):  # zero-stride dummies, like the cache's
        dummy = torch.zeros(()).expand(t.shape)
        program.state_dict[name] = nn.Parameter(dummy, requires_grad=False)
    again = export_skeleton(program)
    first = conv_skeleton.SerializeToString(deterministic=True)
    assert again.SerializeToString(deterministic=True) == first


_DETERMINISM_SCRIPT = textwrap.dedent(
    """
    import hashlib, torch, torch.nn as nn, torch.nn.functional as F
    import graphbuild.quant.markers
    from graphbuild.onnx.skeleton import export_skeleton

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)
        def forward(self, x):
            q = torch.ops.graphbuild.q
            y = self.bn(F.conv2d(q(x, 0), q(self.conv.weight, 1), self.conv.bias))
            return q(F.relu(y), 2), y.mean()

    model = export_skeleton(torch.export.export(Net().eval(), (torch.randn(1, 3, 8, 8),)))
    DIGEST = hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()
    print(DIGEST)
    """
)


@pytest.fixture(scope="module", autouse=True)
def other_process():
    """The same export in another process, started first so that it runs alongside."""
    cmd = [sys.executable, "-c", _DETERMINISM_SCRIPT]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def convbn() -> tuple[ConvBN, onnx.ModelProto]:
    m = ConvBN().eval()
    with torch.no_grad():
        m.bn.running_mean.copy_(m.conv.bias)  # the optimizer would merge these two
    return m, skeleton_of(m, torch.randn(1, 3, 8, 8))


def test_batchnorm_trap_keeps_initializers_apart(convbn):
    _, skeleton = convbn
    inits = {i.name: i for i in skeleton.graph.initializer}
    assert {"conv.bias", "bn.running_mean", "conv.weight", "offset"} <= set(inits)
    assert "BatchNormalization" in op_types(skeleton)
    assert inits["scale"].data_location == onnx.TensorProto.DEFAULT  # lifted constant keeps data
    assert inits["offset"].data_location == onnx.TensorProto.EXTERNAL  # non-persistent buffer


def test_io_names(conv_skeleton, monkeypatch):
    m = make_conv()
    exported = ir.serde.deserialize_model(conv_skeleton)  # skip the exporter: same model
    monkeypatch.setattr(onnx_export, "_torch_export", lambda program, opset: exported)
    renamed = skeleton_of(m, CONV_X, input_names=["image"], output_names=["logits"])
    assert [i.name for i in renamed.graph.input] == ["image"]
    assert [o.name for o in renamed.graph.output] == ["logits"]
    with pytest.raises(ExportError, match="expected 1"):
        skeleton_of(m, CONV_X, output_names=["a", "b"])


def test_forged_initializer_is_a_skeleton_value_error(monkeypatch):
    real = onnx_export._torch_export

    def forging(program, opset):
        model = real(program, opset)
        forged = ir.Value(name="folded_weight", const_value=ir.tensor(np.ones(4, np.float32)))
        model.graph.register_initializer(forged)
        return model

    monkeypatch.setattr(onnx_export, "_torch_export", forging)
    with pytest.raises(SkeletonValueError, match="folded_weight"):
        skeleton_of(make_conv(), CONV_X)


def test_initializer_of_wrong_shape_is_a_skeleton_value_error():
    graph = ir.Graph([], [], nodes=[])
    graph.register_initializer(ir.Value(name="w", const_value=ir.tensor(np.ones(3, np.float32))))
    state = {"w": onnx_export.TensorMeta((4,), torch.float32)}
    with pytest.raises(SkeletonValueError, match="'w'"):
        onnx_export.check_initializers(graph, state, set())
    onnx_export.check_initializers(graph, {}, {"w"})  # a lifted constant is fine


# -- lower: onnx --------------------------------------------------------------------------------


def tensor_names(model: onnx.ModelProto) -> set[str]:
    g = model.graph
    names = {v.name for v in (*g.input, *g.output, *g.initializer)}
    for n in g.node:
        names.update(n.input)
        names.update(n.output)
    return names


def test_lower_onnx_names(conv_skeleton):
    qmap, qvalues = conv_quant("int8")
    lowered, names = lower_markers(conv_skeleton, qmap, "onnx")
    assert_no_markers(lowered)
    out = lowered.graph.output[0].name
    assert names == {0: lowered.graph.input[0].name, 1: "conv.weight", 2: out}
    assert set(names.values()) <= tensor_names(lowered)
    relu = next(n for n in lowered.graph.node if n.op_type == "Relu")
    assert relu.output[0] == out  # the producer took the graph output's name
    onnx.checker.check_model(materialize(bind(lowered, state_of(make_conv()), qmap, qvalues)))


def test_lower_onnx_input_to_output_gets_identity(convbn):
    m, skeleton = convbn
    x = torch.randn(1, 3, 8, 8)
    qmap = QuantMap(tuple(spec(i, 8, False) for i in range(4)))
    lowered, names = lower_markers(skeleton, qmap, "onnx")
    assert_no_markers(lowered)
    x_name, out, relu_out = (
        lowered.graph.input[0].name,
        lowered.graph.output[1].name,
        lowered.graph.output[3].name,
    )
    assert names == {0: x_name, 1: out, 2: relu_out, 3: relu_out}
    assert set(names.values()) <= tensor_names(lowered)
    identity_node = next(n for n in lowered.graph.node if n.op_type == "Identity")
    assert list(identity_node.input) == [x_name] and list(identity_node.output) == [out]
    bound = bind(lowered, state_of(m), qmap, QuantValues())
    got = run_ort(materialize(bound), x)
    with torch.no_grad():
        want = m(x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fake_quantize_weights", [False, True])
def test_bind_onnx_matches_torch(conv_skeleton, fake_quantize_weights):
    m = make_conv()
    qmap, qvalues = conv_quant("int8")
    lowered, _ = lower_markers(conv_skeleton, qmap, "onnx")
    bound = bind(lowered, state_of(m), qmap, qvalues, fake_quantize_weights=fake_quantize_weights)
    assert isinstance(bound, BoundModel) and set(bound.tensors) == {"conv.weight", "conv.bias"}
    assert lowered.SerializeToString() == bound.model.SerializeToString()
    quant = reference_quant(qmap, qvalues, only_params=True) if fake_quantize_weights else identity
    got = run_ort(materialize(bound), CONV_X)[0]
    np.testing.assert_allclose(got, torch_out(m, CONV_X, quant), rtol=1e-5, atol=1e-5)
    if not fake_quantize_weights:  # zero-copy: the array shares the parameter's memory
        assert np.shares_memory(bound.tensors["conv.weight"], m.conv.weight.detach().numpy())


def test_bind_missing_state_names_it(conv_skeleton):
    qmap, qvalues = conv_quant("int8")
    lowered, _ = lower_markers(conv_skeleton, qmap, "onnx")
    state = state_of(make_conv())
    del state["conv.bias"]
    with pytest.raises(ExportError, match="conv.bias"):
        bind(lowered, state, qmap, qvalues)


def test_unknown_format(conv_skeleton):
    with pytest.raises(ExportError, match="onnx, onnx_qdq"):
        lower_markers(conv_skeleton, conv_quant("int8")[0], "tflite")


# -- lower: onnx_qdq ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["int8", "int4", "uint16", "narrow"])
@pytest.mark.parametrize("fake_quantize_weights", [False, True])
def test_qdq_matches_torch_fake_quantize(conv_skeleton, kind, fake_quantize_weights):
    m = make_conv()
    qmap, qvalues = conv_quant(kind)
    lowered, names = lower_markers(conv_skeleton, qmap, "onnx_qdq")
    assert_no_markers(lowered)
    assert op_types(lowered).count("QuantizeLinear") == 3
    assert op_types(lowered).count("DequantizeLinear") == 3
    assert names[1] == "conv.weight"
    assert ("Clip" in op_types(lowered)) == (kind == "narrow")
    assert ("Max" in op_types(lowered)) == (kind == "narrow")
    for init in lowered.graph.initializer:  # qparams are data-less references
        assert init.raw_data == b"" and init.data_location == onnx.TensorProto.EXTERNAL
    bound = bind(lowered, state_of(m), qmap, qvalues, fake_quantize_weights=fake_quantize_weights)
    got = run_ort(materialize(bound), CONV_X)[0]
    want = torch_out(m, CONV_X, reference_quant(qmap, qvalues))
    np.testing.assert_allclose(got, want, atol=1e-5 * float(qvalues[2].scale))


def test_qdq_qparam_initializers(conv_skeleton):
    qmap, _ = conv_quant("int4")
    lowered, names = lower_markers(conv_skeleton, qmap, "onnx_qdq")
    inits = {i.name: i for i in lowered.graph.initializer}
    w_zp = inits["conv.weight_zero_point"]
    assert w_zp.data_type == onnx.TensorProto.INT4 and list(w_zp.dims) == [4]
    assert list(inits["conv.weight_scale"].dims) == [4]
    x_zp = inits[f"{names[0]}_zero_point"]
    assert x_zp.data_type == onnx.TensorProto.UINT8 and list(x_zp.dims) == []
    location = {e.key: e.value for e in w_zp.external_data}["location"]
    meta = {e.key: e.value for e in w_zp.metadata_props}
    assert location == QPARAMS_LOCATION and meta == {QID_KEY: "1", ROLE_KEY: "zero_point"}
    q = next(
        n
        for n in lowered.graph.node
        if n.op_type == "QuantizeLinear" and "conv.weight" in n.input[0]
    )
    assert {a.name: a.i for a in q.attribute} == {"axis": 0}


def test_qdq_blocked_int4():
    torch.manual_seed(3)
    m = LinearNet().eval()
    with torch.no_grad():
        m.fc.bias.copy_(dyadic((4,), -8, 8, 2**-4, 5))
    x = dyadic((2, 8), -12, 12, 2**-3, 6)
    blocked_scales = [[2**-4, 2**-5], [2**-3, 2**-4], [2**-5, 2**-5], [2**-4, 2**-3]]
    qmap = QuantMap(
        (spec(0, 8, False), spec(1, 4, True, axis=1, block=4, param="fc.weight"), spec(2, 8, True))
    )
    qvalues = QuantValues(
        {
            0: qparams([2**-3], [128]),
            1: qparams(blocked_scales, [[0, 0]] * 4),
            2: qparams([2**-4], [0]),
        }
    )
    lowered, _ = lower_markers(skeleton_of(m, x), qmap, "onnx_qdq")
    q = next(
        n for n in lowered.graph.node if n.op_type == "QuantizeLinear" and "fc.weight" in n.input[0]
    )
    assert {a.name: a.i for a in q.attribute} == {"axis": 1, "block_size": 4}
    bound = bind(lowered, state_of(m), qmap, qvalues, fake_quantize_weights=False)
    got = run_ort(materialize(bound), x)[0]
    np.testing.assert_allclose(got, torch_out(m, x, reference_quant(qmap, qvalues)), atol=1e-6)


def test_qdq_int32_bias_is_dequantize_of_precomputed_ints():
    torch.manual_seed(4)
    m = BiasNet().eval()
    x = torch.randn(1, 3, 6, 6)
    qmap = QuantMap((spec(0, 32, True, param="conv.bias"),))
    qvalues = QuantValues({0: qparams([2**-10], [0])})
    lowered, _ = lower_markers(skeleton_of(m, x), qmap, "onnx_qdq")
    assert "QuantizeLinear" not in op_types(lowered)
    inits = {i.name: i for i in lowered.graph.initializer}
    assert (
        "conv.bias" not in inits
        and inits["conv.bias_quantized"].data_type == onnx.TensorProto.INT32
    )
    bound = bind(lowered, state_of(m), qmap, qvalues)
    got = run_ort(materialize(bound), x)[0]
    np.testing.assert_allclose(got, torch_out(m, x, reference_quant(qmap, qvalues)), atol=1e-5)


def test_qdq_int4_needs_opset_21():
    qmap, _ = conv_quant("int4")
    skeleton = skeleton_of(make_conv(), CONV_X, opset=17)
    with pytest.raises(ExportError, match="21"):
        lower_markers(skeleton, qmap, "onnx_qdq")
    lowered, _ = lower_markers(skeleton, conv_quant("int8")[0], "onnx_qdq")  # int8 works at 17
    assert_no_markers(lowered)


# -- bind details and writing -------------------------------------------------------------------


def test_bind_bfloat16_state():
    m = LinearNet().to(torch.bfloat16).eval()
    qmap = QuantMap((spec(0, 8, False), spec(1, 8, True, param="fc.weight"), spec(2, 8, False)))
    lowered, _ = lower_markers(
        skeleton_of(m, torch.randn(2, 8, dtype=torch.bfloat16)), qmap, "onnx"
    )
    bound = bind(lowered, state_of(m), qmap, QuantValues(), fake_quantize_weights=False)
    weight = bound.tensors["fc.weight"]
    assert weight.dtype == ml_dtypes.bfloat16
    assert weight.tobytes() == m.fc.weight.detach().view(torch.int16).numpy().tobytes()
    init = next(i for i in materialize(bound).graph.initializer if i.name == "fc.weight")
    assert init.raw_data == weight.tobytes() and not init.external_data


@pytest.mark.parametrize("external", [True, False])
def test_save_model(conv_skeleton, tmp_path, external):
    m = make_conv()
    qmap, qvalues = conv_quant("int4")
    lowered, _ = lower_markers(conv_skeleton, qmap, "onnx_qdq")
    bound = bind(lowered, state_of(m), qmap, qvalues)
    paths = save_model(bound, tmp_path / "net.onnx", external_data=external)
    names = ["net.onnx", "net.onnx.data"] if external else ["net.onnx"]
    assert [p.name for p in paths] == names
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    got = run_ort(str(paths[0]), CONV_X)[0]
    np.testing.assert_array_equal(got, run_ort(materialize(bound), CONV_X)[0])
    saved = onnx.load(str(paths[0]), load_external_data=False)
    if not external:  # streamed tensor by tensor, it loads as the in-memory model
        assert saved == materialize(bound)
        onnx.checker.check_model(str(paths[0]), full_check=True)
    ext = [i for i in saved.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert len(ext) == (len(bound.tensors) if external else 0)
    assert all(
        {e.key: e.value for e in i.external_data}["location"] == "net.onnx.data" for i in ext
    )
    digest = hashlib.sha256(paths[0].read_bytes()).hexdigest()
    save_model(bound, tmp_path / "net.onnx", external_data=external)  # same bytes again
    assert hashlib.sha256(paths[0].read_bytes()).hexdigest() == digest


# last, so the other process had time to finish
def test_skeleton_deterministic_across_processes(other_process):
    namespace = {"__name__": "__main__"}  # same class path as in the other process
    exec(_DETERMINISM_SCRIPT, namespace)
    out, _ = other_process.communicate(timeout=300)
    assert other_process.returncode == 0
    assert out.strip().splitlines()[-1] == namespace["DIGEST"]
