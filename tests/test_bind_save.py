"""``bind.fake_quantize`` against torch's own ops, bit for bit; ``save_model``'s streamed
inline writer against ``materialize``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zlib

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from graphbuild.errors import ExportError
from graphbuild.onnx import fakequant as fakequant_module
from graphbuild.onnx import save as save_module
from graphbuild.onnx.bind import BoundModel
from graphbuild.onnx.fakequant import fake_quantize
from graphbuild.onnx.lower import QPARAMS_LOCATION
from graphbuild.onnx.save import materialize, save_model
from graphbuild.onnx.skeleton import STATE_LOCATION
from graphbuild.quant.quantmap import QParams, QuantSpec

# -- fake_quantize: bit-exact with torch.fake_quantize_per_{tensor,channel}_affine -----------

GRIDS = {  # (bits, signed): (qmin, qmax)
    (4, True): (-8, 7),
    (4, False): (0, 15),
    (8, True): (-128, 127),
    (8, False): (0, 255),
    (16, True): (-32768, 32767),
    (16, False): (0, 65535),
}


def grid_spec(bits: int, signed: bool, axis: int | None, narrow: bool = False) -> QuantSpec:
    qmin, qmax = GRIDS[bits, signed]
    return QuantSpec(0, bits, signed, qmin + (narrow and signed), qmax, axis=axis)


def torch_reference(x: torch.Tensor, spec: QuantSpec, qp: QParams) -> torch.Tensor:
    xf = x.detach().float()
    if spec.axis is None:
        return torch.fake_quantize_per_tensor_affine(
            xf, qp.scale.reshape(()), qp.zero_point.reshape(()).int(), spec.qmin, spec.qmax
        ).to(x.dtype)
    return torch.fake_quantize_per_channel_affine(
        xf, qp.scale, qp.zero_point.int(), spec.axis, spec.qmin, spec.qmax
    ).to(x.dtype)


@pytest.fixture
def fast_path(monkeypatch) -> list[bool]:
    """Whether each fake_quantize call took the blocked evaluation (not torch's op)."""
    taken: list[bool] = []
    blocked = fakequant_module._fake_quantize_blocked

    def spy(*args, **kwargs):
        out = blocked(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(fakequant_module, "_fake_quantize_blocked", spy)
    return taken


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (tells -0.0 from 0.0 and compares NaNs)."""
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def adversarial(shape, scale_b: torch.Tensor, zp_b: torch.Tensor, spec, gen) -> torch.Tensor:
    """Values on and next to the grid's .5 ties, saturating, signed zeros, noise, all mixed.

    ``scale_b``/``zp_b`` broadcast against ``shape``."""
    qmin, qmax = spec.qmin, spec.qmax
    span = qmax - qmin
    k = torch.randint(qmin - span // 4 - 2, qmax + span // 4 + 3, shape, generator=gen)
    k = (k - zp_b).float()
    tie = (k + 0.5) * scale_b  # float32: exactly a tie when the scale is a power of two
    after = torch.nextafter(tie, torch.full_like(tie, float("inf")))
    before = torch.nextafter(tie, torch.full_like(tie, -float("inf")))
    on_grid = k * scale_b
    noise = torch.randn(shape, generator=gen) * scale_b * span / 3
    far = torch.randn(shape, generator=gen) * scale_b * span * 1e3  # saturates
    tiny = torch.randn(shape, generator=gen) * scale_b * 0.49  # rounds to (-)0
    zeros = torch.where(torch.rand(shape, generator=gen) < 0.5, 0.0, -0.0)
    subnormal = torch.randn(shape, generator=gen) * 1e-40
    choices = torch.stack([tie, after, before, on_grid, noise, far, tiny, zeros, subnormal])
    pick = torch.randint(0, len(choices), (1, *shape), generator=gen)
    return choices.gather(0, pick)[0]


def random_qparams(channels: int, spec: QuantSpec, pow2: bool, uniform_zp: bool, gen):
    if pow2:
        scale = 2.0 ** torch.randint(-12, 3, (channels,), generator=gen).float()
    else:  # arbitrary float32 scales, including awkward ones
        scale = torch.exp(torch.empty(channels).uniform_(-12, 3, generator=gen))
        scale[: min(channels, 3)] = torch.tensor([1 / 3, 0.1, 7e-5])[: min(channels, 3)]
    lo, hi = spec.qmin, spec.qmax
    if uniform_zp:
        zp = torch.full((channels,), (lo + hi + 1) // 2 if lo == 0 else 0, dtype=torch.int64)
    else:
        zp = torch.randint(lo, hi + 1, (channels,), generator=gen, dtype=torch.int64)
    return QParams(scale.float(), zp)


CASES = [
    # shape, axis
    ((64, 48), 0),
    ((64, 48), 1),
    ((300, 700), 0),  # several blocks of channels
    ((700, 300), 1),  # channels on the inner axis: blocks along the outer axis
    ((5, 6, 7, 3), 1),
    ((3, 70_001), 0),  # a channel longer than a block
    ((2, 3, 40_000), 2),
    ((17,), 0),
    ((300, 700), None),
    ((70_001,), None),
    ((), None),
]


@pytest.mark.parametrize(("bits", "signed"), list(GRIDS))
@pytest.mark.parametrize(("shape", "axis"), CASES)
@pytest.mark.parametrize("pow2", [True, False])
def test_fake_quantize_bit_exact(bits, signed, shape, axis, pow2, fast_path):
    gen = torch.Generator().manual_seed(
        zlib.crc32(repr((bits, signed, shape, axis, pow2)).encode())
    )
    for narrow, uniform_zp in ((False, True), (False, False), (True, True)):
        spec = grid_spec(bits, signed, axis, narrow)
        channels = 1 if axis is None else shape[axis]
        qp = random_qparams(channels, spec, pow2, uniform_zp, gen)
        bshape = [1] * len(shape)
        if axis is not None:
            bshape[axis] = channels
        x = adversarial(shape, qp.scale.reshape(bshape), qp.zero_point.reshape(bshape), spec, gen)
        got, want = fake_quantize(x, spec, qp), torch_reference(x, spec, qp)
        assert got.dtype == x.dtype and got.shape == x.shape
        assert torch.equal(bits_of(got), bits_of(want)), (narrow, uniform_zp)
    assert fast_path == [True] * 3


@pytest.mark.parametrize("axis", [None, 0])
def test_fake_quantize_exact_ties_and_signed_zero(axis):
    spec = grid_spec(8, True, axis)
    qp = QParams(torch.tensor([0.25]), torch.tensor([0]))
    x = torch.tensor([0.125, -0.125, 0.375, -0.375, -0.0, 0.0, -0.1, 31.875, 32.0, -32.125, 1e3])
    if axis is not None:
        x = x.reshape(1, -1)
    got = fake_quantize(x, spec, qp)
    want = [0.0, 0.0, 0.5, -0.5, 0.0, 0.0, 0.0, 31.75, 31.75, -32.0, 31.75]  # half to even
    assert got.reshape(-1).tolist() == want
    zeros = got.reshape(-1)[[0, 1, 4, 5, 6]]
    assert not torch.signbit(zeros).any()  # torch's q - z is never -0.0
    assert torch.equal(bits_of(got), bits_of(torch_reference(x, spec, qp)))


def test_fake_quantize_negative_scale_zero_sign():
    x = torch.tensor([[0.2, -0.2, 3.0, -0.0]])
    for axis, z in ((None, 0), (None, 5), (0, 0), (0, 5)):
        spec, qp = grid_spec(8, True, axis), QParams(torch.tensor([-1.0]), torch.tensor([z]))
        assert torch.equal(
            bits_of(fake_quantize(x, spec, qp)), bits_of(torch_reference(x, spec, qp))
        )


@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_fake_quantize_other_dtypes_and_layouts(axis, dtype):
    gen = torch.Generator().manual_seed(3)
    spec = grid_spec(8, True, axis)
    base = (torch.randn(96, 80, generator=gen) * 3).to(dtype)
    for x in (base, base.t().contiguous().t(), base[:, ::2]):  # contiguous, transposed, strided
        channels = 1 if axis is None else x.shape[axis]
        qp = QParams(torch.rand(channels, generator=gen) * 0.05 + 1e-3, torch.zeros(channels))
        before = x.clone()
        got = fake_quantize(x, spec, qp)
        assert torch.equal(x, before)  # the input is never written
        assert torch.equal(bits_of(got), bits_of(torch_reference(x, spec, qp)))


def test_fake_quantize_float32_input_untouched_and_not_aliased():
    x = torch.randn(128, 64)
    before = x.clone()
    qp = QParams(torch.full((128,), 0.01), torch.zeros(128, dtype=torch.int64))
    got = fake_quantize(x, grid_spec(8, True, 0), qp)
    assert torch.equal(x, before) and got.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("axis", [None, 0])
@pytest.mark.parametrize(
    "bad", [float("inf"), -float("inf"), float("nan"), 1e30, -3e38, 2.0**63, 2.0**62]
)
def test_fake_quantize_non_finite_and_huge_match_torch(axis, bad, fast_path):
    """torch's int64 cast is undefined for these: whatever torch gives, bind gives."""
    spec = grid_spec(8, False, axis)
    x = torch.tensor([[0.3, bad, -0.7, 5.0, bad, 0.0]])
    qp = QParams(torch.tensor([0.05]), torch.tensor([128]))
    assert torch.equal(bits_of(fake_quantize(x, spec, qp)), bits_of(torch_reference(x, spec, qp)))
    assert fast_path == [False]  # |x / scale| >= 2**62: torch's own op


@pytest.mark.parametrize("scale", [0.0, -0.0, float("inf"), 1e-45])
def test_fake_quantize_degenerate_scales_match_torch(scale):
    x = torch.tensor([[0.3, -2.0, 0.0, 1e-44]])
    for axis in (None, 0):
        spec, qp = grid_spec(8, True, axis), QParams(torch.tensor([scale]), torch.tensor([0]))
        assert torch.equal(
            bits_of(fake_quantize(x, spec, qp)), bits_of(torch_reference(x, spec, qp))
        )


def test_fake_quantize_rejections_stay_torchs():
    x = torch.randn(4, 6)
    with pytest.raises(RuntimeError, match="zero_point"):  # outside [qmin, qmax]
        fake_quantize(x, grid_spec(8, True, 0), QParams(torch.ones(4), torch.full((4,), 200)))
    with pytest.raises(RuntimeError):  # 4 scales for 6 channels
        fake_quantize(x, grid_spec(8, True, 1), QParams(torch.ones(4), torch.zeros(4)))
    with pytest.raises(ExportError, match="per-tensor"):
        fake_quantize(x, grid_spec(8, True, None), QParams(torch.ones(2), torch.zeros(2)))
    # per tensor, torch takes a zero point off the grid: so does bind
    spec, qp = grid_spec(8, True, None), QParams(torch.tensor([0.1]), torch.tensor([200]))
    assert torch.equal(bits_of(fake_quantize(x, spec, qp)), bits_of(torch_reference(x, spec, qp)))


# -- save_model: the inline model streamed, one tensor at a time ------------------------------


def reference(name: str, dims, dtype: int, location: str = STATE_LOCATION) -> TensorProto:
    """A data-less graphbuild reference, with metadata of both kinds and a doc string."""
    t = TensorProto(name=name, dims=dims, data_type=dtype, data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", "0")):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    for key, value in (("graphbuild.qid", "3"), ("origin", name)):  # dropped, kept
        entry = t.metadata_props.add()
        entry.key, entry.value = key, value
    t.doc_string = f"the {name}"  # a field after raw_data
    return t


def mixed_bound_model() -> BoundModel:
    """References of many dtypes (4-bit packed, bf16, empty, scalar), inline constants between
    them, and references inside an If's subgraphs; runs in onnxruntime."""
    rng = np.random.default_rng(0)
    then_g = helper.make_graph(
        [helper.make_node("Identity", ["sub_then"], ["t_out"])],
        "then",
        [],
        [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [4])],
        [reference("sub_then", [4], TensorProto.FLOAT)],
    )
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["sub_else"], ["e_out"])],
        "else",
        [],
        [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [4])],
        [helper.make_tensor("sub_else", TensorProto.FLOAT, [4], [9.0, 8.0, 7.0, 6.0])],
    )
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "c"], ["y1"]),
        helper.make_node("Cast", ["b16"], ["b"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["y1", "b"], ["y2"]),
        helper.make_node("If", ["cond"], ["z"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Add", ["y2", "z"], ["y"]),
    ]
    inits = [
        reference("w", [3, 4], TensorProto.FLOAT),
        helper.make_tensor("c", TensorProto.FLOAT, [4], [0.5, -0.5, 1.0, 2.0]),
        reference("b16", [4], TensorProto.BFLOAT16, QPARAMS_LOCATION),
        reference("cond", [], TensorProto.BOOL),
        reference("q4", [5], TensorProto.INT4, QPARAMS_LOCATION),
        helper.make_tensor("k", TensorProto.INT64, [2], [7, -7]),
        reference("u16", [2, 2], TensorProto.UINT16, QPARAMS_LOCATION),
        reference("scalar", [], TensorProto.INT64),
        reference("empty", [0, 3], TensorProto.FLOAT),
        reference("f16", [3], TensorProto.FLOAT16),
    ]
    graph = helper.make_graph(
        nodes,
        "mixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10, producer_name="t"
    )
    tensors = {
        "w": rng.standard_normal((3, 4), dtype=np.float32),
        "b16": np.array([1.5, -2.0, 0.25, 3.0], dtype=ml_dtypes.bfloat16),
        "cond": np.array(True),
        "q4": np.array([-8, 7, 0, -1, 3], dtype=ml_dtypes.int4),
        "u16": np.array([[0, 65535], [1, 300]], dtype=np.uint16),
        "scalar": np.array(-5, dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "f16": np.array([0.1, -0.2, 65504], dtype=np.float16),
        "sub_then": rng.standard_normal(4, dtype=np.float32),
    }
    return BoundModel(model, tensors)


X = np.arange(6, dtype=np.float32).reshape(2, 3) / 4


def run(model) -> np.ndarray:
    arg = model if isinstance(model, str) else model.SerializeToString()
    sess = ort.InferenceSession(arg, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": X})[0]


def test_save_inline_loads_as_materialize(tmp_path):
    bound = mixed_bound_model()
    (path,) = save_model(bound, tmp_path / "m.onnx", external_data=False)
    want = materialize(bound)
    assert onnx.load(str(path)) == want  # initializers in the graph's order, too
    onnx.checker.check_model(str(path), full_check=True)
    np.testing.assert_array_equal(run(str(path)), run(want))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # no temporary left


def test_save_inline_bytes(tmp_path):
    """The file is the skeleton then one canonical ``graph {initializer}`` record per
    initializer: what protobuf itself writes for those messages, byte for byte."""
    bound = mixed_bound_model()
    (path,) = save_model(bound, tmp_path / "m.onnx", external_data=False)
    full = materialize(bound)
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(full)
    del skeleton.graph.initializer[:]
    records = [
        onnx.ModelProto(graph=onnx.GraphProto(initializer=[i])).SerializeToString(
            deterministic=True
        )
        for i in full.graph.initializer
    ]
    data = path.read_bytes()
    assert data == skeleton.SerializeToString(deterministic=True) + b"".join(records)
    save_model(bound, tmp_path / "again.onnx", external_data=False)
    save_model(mixed_bound_model(), tmp_path / "rebuilt.onnx", external_data=False)
    assert (tmp_path / "again.onnx").read_bytes() == data
    assert (tmp_path / "rebuilt.onnx").read_bytes() == data


def test_save_inline_reads_the_tensors_in_place(tmp_path, monkeypatch):
    """No copy of a tensor's bytes (and no materialize) on the way to the file."""
    bound = mixed_bound_model()
    monkeypatch.setattr(save_module, "materialize", None)
    written: list[object] = []
    write_atomic = save_module.write_atomic

    def spy(path, chunks, *sources):
        def record():
            for chunk in chunks:
                written.append(getattr(chunk, "data", chunk))  # a tensor's payload: its bytes
                yield chunk

        return write_atomic(path, record(), *sources)

    monkeypatch.setattr(save_module, "write_atomic", spy)
    save_model(bound, tmp_path / "m.onnx", external_data=False)
    views = [c for c in written if isinstance(c, memoryview)]
    assert len(views) == 7  # every reference but 4-bit q4 (packed) and sub_then (a subgraph's)
    w = next(v for v in views if len(v) == bound.tensors["w"].nbytes)
    assert np.shares_memory(np.asarray(w), bound.tensors["w"])


def test_save_inline_over_protobuf_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(save_module, "_PROTOBUF_LIMIT", 600)
    with pytest.raises(ExportError, match="external data"):
        save_model(mixed_bound_model(), tmp_path / "m.onnx", external_data=False)
    assert list(tmp_path.iterdir()) == []


_PEAK_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from onnx import TensorProto, helper
    from graphbuild.onnx.bind import BoundModel
    from graphbuild.onnx.save import save_model
    from graphbuild.onnx.skeleton import STATE_LOCATION

    inits, tensors, n = [], {}, 1024
    for i in range(32):  # 128 MiB of float32
        t = TensorProto(name=f"w{i}", dims=[n, n], data_type=TensorProto.FLOAT,
                        data_location=TensorProto.EXTERNAL)
        e = t.external_data.add()
        e.key, e.value = "location", STATE_LOCATION
        inits.append(t)
        tensors[t.name] = np.full((n, n), i, dtype=np.float32)
    graph = helper.make_graph([], "g", [], [], inits)
    bound = BoundModel(helper.make_model(graph), tensors)
    weights = sum(a.nbytes for a in tensors.values())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    save_model(bound, sys.argv[1], external_data=False)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print((after - before) / weights)
    """
)


def test_save_inline_peak_memory(tmp_path):
    """Saving adds next to nothing to the peak (it was 3x the weights through materialize)."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "m.onnx")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert float(out.stdout.split()[-1]) < 0.1
