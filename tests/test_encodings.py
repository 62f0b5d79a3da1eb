"""The QNN encodings stage: formats, read-back, and fake quantization from the file alone."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from graphbuild.errors import ExportError
from graphbuild.quant.quantmap import QParams, QuantMap, QuantSpec, QuantValues
from graphbuild.targets.qnn.encodings import (
    VERSIONS,
    build_encodings,
    insert_fake_quant,
    read_encodings,
)

# ------------------------------------------------------------------------------------ helpers


def grid(bits: int, signed: bool) -> tuple[int, int]:
    return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)


def make_spec(qid: int, bits: int = 8, signed: bool = True, **kw) -> QuantSpec:
    qmin, qmax = grid(bits, signed)
    kw.setdefault("qmin", qmin)
    kw.setdefault("qmax", qmax)
    return QuantSpec(qid=qid, bits=bits, signed=signed, **kw)


def qparams(scale, zero_point) -> QParams:
    return QParams(
        torch.tensor(scale, dtype=torch.float32), torch.tensor(zero_point, dtype=torch.int64)
    )


def encode(quantizers: list[tuple[QuantSpec, QParams, str]], version: str = "1.0.0") -> dict:
    qmap = QuantMap(tuple(spec for spec, _, _ in quantizers))
    values = QuantValues({spec.qid: qp for spec, qp, _ in quantizers})
    names = {spec.qid: name for spec, _, name in quantizers}
    return build_encodings(qmap, values, names, version)


def f32(x: float) -> float:
    """The Python float of a float32 value, as the encodings file holds scales."""
    return float(np.float32(x))


def one_entry(doc: dict, name: str) -> list[dict]:
    """The entry (or 0.6.1 channel list) for ``name``, whatever the version and section."""
    if doc["version"] == "2.0.0":
        return [e for e in doc["encodings"] if e["name"] == name]
    sections = (doc["activation_encodings"], doc["param_encodings"])
    if doc["version"] == "0.6.1":
        return [s[name] for s in sections if name in s]
    return [e for s in sections for e in s if e["name"] == name]


# ----------------------------------------------------------------------- the offset formulas

# bits, signed, symmetric, zero points (one per channel)
FORMULA_CASES = [
    (bits, signed, symmetric, zps)
    for bits in (4, 8, 16)
    for signed in (True, False)
    for symmetric in (True, False)
    for zps in (1, 3)
]


def case_zero_points(bits: int, signed: bool, symmetric: bool, channels: int) -> list[int]:
    qmin, qmax = grid(bits, signed)
    if symmetric:
        return [0 if signed else 2 ** (bits - 1)] * channels
    return [qmin + 1 + (i * (qmax - qmin)) // (channels + 1) for i in range(channels)]


def case_quantizer(bits, signed, symmetric, channels) -> tuple[QuantSpec, QParams, list, list]:
    scales = [0.0123 * (i + 1) for i in range(channels)]
    zps = case_zero_points(bits, signed, symmetric, channels)
    axis = None if channels == 1 else 0
    spec = make_spec(0, bits, signed, axis=axis, param="w" if axis == 0 else None)
    return spec, qparams(scales, zps), scales, zps


def expected_offset(bits: int, signed: bool, z: int) -> int:
    return -(2 ** (bits - 1)) - z if signed else -z


@pytest.mark.parametrize("bits,signed,symmetric,channels", FORMULA_CASES)
def test_1_0_0_offsets_follow_the_unsigned_grid_formula(bits, signed, symmetric, channels):
    spec, qp, scales, zps = case_quantizer(bits, signed, symmetric, channels)
    (entry,) = one_entry(encode([(spec, qp, "t")], "1.0.0"), "t")
    assert entry["bw"] == bits and entry["dtype"] == "INT"
    assert entry["enc_type"] == ("PER_TENSOR" if channels == 1 else "PER_CHANNEL")
    assert entry["is_sym"] is symmetric
    assert entry["scale"] == [f32(s) for s in scales]
    assert entry["offset"] == [expected_offset(bits, signed, z) for z in zps]
    assert all(type(o) is int for o in entry["offset"])


@pytest.mark.parametrize("bits,signed,symmetric,channels", FORMULA_CASES)
def test_0_6_1_min_max_are_scale_times_offset_and_offset_plus_span(
    bits, signed, symmetric, channels
):
    spec, qp, scales, zps = case_quantizer(bits, signed, symmetric, channels)
    (chans,) = one_entry(encode([(spec, qp, "t")], "0.6.1"), "t")
    assert len(chans) == channels
    for ch, s, z in zip(chans, scales, zps, strict=True):
        offset = expected_offset(bits, signed, z)
        assert ch["bitwidth"] == bits and ch["dtype"] == "int"
        assert ch["is_symmetric"] == str(symmetric)
        assert ch["offset"] == offset and ch["scale"] == f32(s)
        assert ch["min"] == f32(s) * offset
        assert ch["max"] == f32(s) * (offset + 2**bits - 1)


@pytest.mark.parametrize("bits,signed,symmetric,channels", FORMULA_CASES)
def test_2_0_0_stores_the_zero_point_itself_in_its_container(bits, signed, symmetric, channels):
    spec, qp, scales, zps = case_quantizer(bits, signed, symmetric, channels)
    (entry,) = one_entry(encode([(spec, qp, "t")], "2.0.0"), "t")
    assert entry["output_dtype"] == f"{'' if signed else 'u'}int{bits}"
    if channels == 1:
        assert entry["y_scale"] == f32(scales[0]) and "axis" not in entry
        assert entry.get("y_zero_point", 0) == zps[0]
    else:
        assert entry["y_scale"] == [f32(s) for s in scales] and entry["axis"] == 0
        assert entry.get("y_zero_point", [0] * channels) == zps
    assert ("y_zero_point" in entry) == any(zps)


def test_symmetric_int8_has_offset_minus_128():
    (entry,) = one_entry(encode([(make_spec(0), qparams([0.5], [0]), "t")]), "t")
    assert entry["offset"] == [-128] and entry["is_sym"] is True


def test_asymmetric_uint8_offset_is_minus_zero_point_and_range_follows():
    spec = make_spec(0, 8, signed=False)
    (chans,) = one_entry(encode([(spec, qparams([0.25], [10]), "t")], "0.6.1"), "t")
    assert chans[0]["offset"] == -10
    assert (chans[0]["min"], chans[0]["max"]) == (-2.5, 0.25 * 245)


def test_explicit_symmetric_flag_wins_over_zero_points():
    spec = make_spec(0, symmetric=False)
    (entry,) = one_entry(encode([(spec, qparams([0.5], [0]), "t")]), "t")
    assert entry["is_sym"] is False


@pytest.mark.parametrize(
    "bits,signed,qmin,qmax,dtype",
    [
        (4, True, -8, 7, "int4"),
        (4, False, 0, 15, "uint4"),
        (8, True, -127, 127, "int8"),
        (8, False, 0, 255, "uint8"),
        (16, True, -32768, 32767, "int16"),
        (16, False, 0, 65535, "uint16"),
        (6, True, -32, 31, "int8"),
    ],
)
def test_2_0_0_output_dtype_is_the_smallest_container_holding_the_grid(
    bits, signed, qmin, qmax, dtype
):
    spec = make_spec(0, bits, signed, qmin=qmin, qmax=qmax)
    (entry,) = encode([(spec, qparams([0.1], [0]), "t")], "2.0.0")["encodings"]
    assert entry["output_dtype"] == dtype


# ------------------------------------------------------------------------ document structure


def mixed_quantizers() -> list[tuple[QuantSpec, QParams, str]]:
    return [
        (make_spec(0, 8, False), qparams([0.02], [128]), "x"),
        (make_spec(1, axis=0, param="fc.weight"), qparams([0.1, 0.2], [0, 0]), "fc.weight"),
        (make_spec(2, 8, False), qparams([0.05], [3]), "y"),
        (make_spec(3, 16, False, param="fc.bias"), qparams([1e-4], [0]), "fc.bias"),
    ]


def entry_names(doc: dict, section: str) -> list[str]:
    entries = doc[section]
    return list(entries) if isinstance(entries, dict) else [e["name"] for e in entries]


@pytest.mark.parametrize("version", ["1.0.0", "0.6.1"])
def test_params_and_activations_go_to_their_own_sections_in_qid_order(version):
    doc = encode(mixed_quantizers(), version)
    assert doc["version"] == version
    assert entry_names(doc, "activation_encodings") == ["x", "y"]
    assert entry_names(doc, "param_encodings") == ["fc.weight", "fc.bias"]


def test_1_0_0_document_has_the_documented_top_level_keys():
    doc = encode(mixed_quantizers(), "1.0.0")
    assert list(doc) == [
        "version",
        "producer",
        "activation_encodings",
        "param_encodings",
        "excluded_layers",
        "quantizer_args",
    ]
    assert doc["excluded_layers"] == []


@pytest.mark.parametrize("version", VERSIONS)
def test_one_entry_per_quantizer(version):
    doc = encode(mixed_quantizers(), version)
    assert len(read_encodings(doc)) == len(mixed_quantizers())


def test_2_0_0_has_one_list_in_qid_order():
    doc = encode(mixed_quantizers(), "2.0.0")
    assert list(doc) == ["version", "producer", "encodings"]
    assert [e["name"] for e in doc["encodings"]] == ["x", "fc.weight", "y", "fc.bias"]


@pytest.mark.parametrize("version", VERSIONS)
def test_output_is_deterministic(version):
    assert encode(mixed_quantizers(), version) == encode(mixed_quantizers(), version)


@pytest.mark.parametrize("version", VERSIONS)
def test_identical_quantizers_on_one_tensor_are_written_once(version):
    twice = [(make_spec(q, 8, False), qparams([0.02], [7]), "x") for q in (0, 1)]
    doc = encode(twice, version)
    assert len(one_entry(doc, "x")) == 1 and len(read_encodings(doc)) == 1


@pytest.mark.parametrize("version", VERSIONS)
def test_conflicting_quantizers_on_one_tensor_name_the_tensor(version):
    clash = [
        (make_spec(0, 8, False), qparams([0.02], [7]), "x"),
        (make_spec(1, 8, False), qparams([0.03], [7]), "x"),
    ]
    with pytest.raises(ExportError, match="tensor 'x' has conflicting encodings"):
        encode(clash, version)


def test_unknown_version_lists_the_known_ones():
    with pytest.raises(ExportError, match=r"'3\.0\.0'.*1\.0\.0, 0\.6\.1, 2\.0\.0"):
        encode(mixed_quantizers(), "3.0.0")


def test_missing_tensor_name_is_an_export_error():
    qmap = QuantMap((make_spec(0),))
    with pytest.raises(ExportError, match="quantizer 0 .* no ONNX tensor name"):
        build_encodings(qmap, QuantValues({0: qparams([0.1], [0])}), {})


# ---------------------------------------------------------------------------------- blocked


def blocked_weight() -> tuple[QuantSpec, QParams, str]:
    """A (4, 3) MatMul weight, int4 blocks of 2 along its input-channel axis 0."""
    spec = make_spec(0, 4, True, axis=0, block_size=2, param="w", symmetric=True)
    scale = [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]
    return spec, qparams(scale, [[0, 0, 0], [0, 0, 0]]), "w"


def test_1_0_0_blocked_flattens_scales_and_records_block_size():
    (entry,) = encode([blocked_weight()], "1.0.0")["param_encodings"]
    assert entry["enc_type"] == "PER_BLOCK" and entry["block_size"] == 2
    assert entry["scale"] == [f32(v) for v in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)]
    assert entry["offset"] == [-8] * 6


def test_2_0_0_blocked_keeps_the_block_grid_with_axis_and_block_size():
    (entry,) = encode([blocked_weight()], "2.0.0")["encodings"]
    assert entry["output_dtype"] == "int4" and (entry["axis"], entry["block_size"]) == (0, 2)
    assert np.asarray(entry["y_scale"]).shape == (2, 3)


def test_0_6_1_cannot_express_blocked_quantization():
    with pytest.raises(ExportError, match="0.6.1 cannot express blocked.*use 1.0.0 or 2.0.0"):
        encode([blocked_weight()], "0.6.1")


# ------------------------------------------------------------------------------- round trip

# Signed symmetric and unsigned asymmetric: the cases every format reads back exactly.
ROUND_TRIP_CASES = [
    (8, True, [0.02], [0]),
    (4, True, [0.1, 0.2, 0.3], [0, 0, 0]),
    (16, True, [1e-4, 3e-4], [0, 0]),
    (8, False, [0.05], [17]),
    (16, False, [2e-3, 1e-3], [30000, 123]),
    (4, False, [0.3], [3]),
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("bits,signed,scales,zps", ROUND_TRIP_CASES)
def test_read_encodings_gives_back_scales_and_zero_points(version, bits, signed, scales, zps):
    axis = None if len(scales) == 1 else 0
    spec = make_spec(0, bits, signed, axis=axis, param="w")
    enc = read_encodings(encode([(spec, qparams(scales, zps), "w")], version))["w"]
    np.testing.assert_array_equal(enc.scale, np.float32(scales))
    np.testing.assert_array_equal(enc.zero_point, zps)
    assert (enc.bits, enc.signed, enc.axis) == (bits, signed, axis)
    assert (enc.qmin, enc.qmax) == grid(bits, signed)


@pytest.mark.parametrize("version", ["1.0.0", "0.6.1"])
def test_sections_read_back_as_is_param(version):
    encs = read_encodings(encode(mixed_quantizers(), version))
    assert {n for n, e in encs.items() if e.is_param} == {"fc.weight", "fc.bias"}


@pytest.mark.parametrize("version", ["1.0.0", "0.6.1"])
def test_signed_asymmetric_reads_back_unsigned_with_the_same_grid(version):
    """1.0.0 and 0.6.1 store no container: asymmetric means unsigned, same values."""
    spec = make_spec(0, 8, True)
    enc = read_encodings(encode([(spec, qparams([0.1], [-5]), "t")], version))["t"]
    assert enc.signed is False and enc.zero_point.tolist() == [-5 + 128]
    assert (enc.qmin - enc.zero_point[0], enc.qmax - enc.zero_point[0]) == (-128 + 5, 127 + 5)


def test_0_6_1_min_max_form_reads_back_scales_and_zero_points():
    scales, zps = [0.02, 0.07, 0.5], [200, 3, 128]
    spec = make_spec(0, 8, False, axis=0, param="w")
    doc = encode([(spec, qparams(scales, zps), "w")], "0.6.1")
    for ch in doc["param_encodings"]["w"]:
        del ch["scale"], ch["offset"]
    enc = read_encodings(doc)["w"]
    np.testing.assert_allclose(enc.scale, np.float32(scales), rtol=1e-6)
    assert enc.zero_point.tolist() == zps


@pytest.mark.parametrize("version", ["1.0.0", "2.0.0"])
def test_blocked_round_trip(version):
    spec, qp, _ = blocked_weight()
    enc = read_encodings(encode([blocked_weight()], version))["w"]
    assert enc.block_size == 2 and enc.granularity == "PER_BLOCK"
    np.testing.assert_array_equal(enc.scale.reshape(-1), qp.scale.numpy().reshape(-1))
    np.testing.assert_array_equal(enc.zero_point.reshape(-1), 0)


def test_reading_an_unknown_version_is_an_export_error():
    with pytest.raises(ExportError, match="unknown QNN encodings version"):
        read_encodings({"version": "9.9.9", "encodings": []})


def test_reading_a_malformed_document_is_an_export_error():
    with pytest.raises(ExportError, match="malformed 1.0.0"):
        read_encodings({"version": "1.0.0", "activation_encodings": [{"name": "x"}]})


# ----------------------------------------------------------------------- fake quant in ONNX

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 4)).astype(np.float32)
W = RNG.standard_normal((4, 3)).astype(np.float32)


def matmul_relu(opset: int = 17) -> onnx.ModelProto:
    """``out = Relu(MatMul(x, w))`` with ``w`` an initializer and ``y`` the MatMul output."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["out"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(W, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10  # what onnxruntime reads
    return model


def run(model: onnx.ModelProto, x: np.ndarray = X) -> np.ndarray:
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def fq(t: torch.Tensor, spec: QuantSpec, qp: QParams) -> torch.Tensor:
    """The torch reference quantize-dequantize."""
    if spec.axis is None:
        s, z = float(qp.scale.reshape(-1)[0]), int(qp.zero_point.reshape(-1)[0])
        return torch.fake_quantize_per_tensor_affine(t, s, z, spec.qmin, spec.qmax)
    z = qp.zero_point.to(torch.int32)
    return torch.fake_quantize_per_channel_affine(t, qp.scale, z, spec.axis, spec.qmin, spec.qmax)


def matmul_relu_quantizers() -> dict[str, tuple[QuantSpec, QParams]]:
    """x: uint8 asymmetric; w: int8 per output channel (axis 1 of a MatMul weight);
    y: int8 asymmetric; out (the graph output): uint8."""
    return {
        "x": (make_spec(0, 8, False), qparams([0.015], [131])),
        "w": (make_spec(1, axis=1, param="w"), qparams([0.011, 0.017, 0.013], [0, 0, 0])),
        "y": (make_spec(2, 8, False), qparams([0.03], [120])),
        "out": (make_spec(3, 8, False), qparams([0.02], [0])),
    }


def torch_reference(quantizers: dict[str, tuple[QuantSpec, QParams]]) -> np.ndarray:
    def q(name: str, t: torch.Tensor) -> torch.Tensor:
        return fq(t, *quantizers[name]) if name in quantizers else t

    y = q("y", q("x", torch.from_numpy(X)) @ q("w", torch.from_numpy(W)))
    return q("out", torch.relu(y)).numpy()


def encode_named(quantizers: dict[str, tuple[QuantSpec, QParams]], version: str) -> dict:
    return encode([(spec, qp, name) for name, (spec, qp) in quantizers.items()], version)


@pytest.mark.parametrize("version", VERSIONS)
def test_fake_quant_from_the_file_alone_matches_torch(version):
    quantizers = matmul_relu_quantizers()
    model = insert_fake_quant(matmul_relu(), encode_named(quantizers, version))
    np.testing.assert_allclose(run(model), torch_reference(quantizers), rtol=0, atol=1e-6)


@pytest.mark.parametrize("version", VERSIONS)
def test_per_channel_weight_alone_matches_torch(version):
    quantizers = {"w": matmul_relu_quantizers()["w"]}
    model = insert_fake_quant(matmul_relu(), encode_named(quantizers, version))
    expected = torch_reference(quantizers)
    np.testing.assert_allclose(run(model), expected, rtol=0, atol=1e-6)
    assert not np.allclose(run(matmul_relu()), expected, atol=1e-6)  # the weight did change


@pytest.mark.parametrize("opset", [13, 21])
def test_quantized_graph_output_keeps_its_name_and_is_quantized(opset):
    quantizers = {"out": matmul_relu_quantizers()["out"]}
    model = insert_fake_quant(matmul_relu(opset), encode_named(quantizers, "1.0.0"))
    assert [o.name for o in model.graph.output] == ["out"]
    np.testing.assert_allclose(run(model), torch_reference(quantizers), rtol=0, atol=1e-6)


def test_blocked_weight_matches_a_per_channel_torch_reference():
    spec, qp, _ = blocked_weight()
    w = torch.from_numpy(W)  # (4, 3): blocks of 2 rows per column
    rows = w.reshape(2, 2, 3).permute(0, 2, 1).reshape(6, 2)  # one row per (block, column)
    row_spec = make_spec(9, 4, True, axis=0)
    w_fq = fq(rows, row_spec, QParams(qp.scale.reshape(-1), qp.zero_point.reshape(-1)))
    w_fq = w_fq.reshape(2, 3, 2).permute(0, 2, 1).reshape(4, 3)
    expected = torch.relu(torch.from_numpy(X) @ w_fq).numpy()
    for version in ("1.0.0", "2.0.0"):
        model = insert_fake_quant(matmul_relu(), encode([blocked_weight()], version))
        np.testing.assert_allclose(run(model), expected, rtol=0, atol=1e-6)


def test_insert_fake_quant_does_not_modify_its_argument():
    model = matmul_relu()
    before = model.SerializeToString()
    insert_fake_quant(model, encode_named(matmul_relu_quantizers(), "1.0.0"))
    assert model.SerializeToString() == before


def test_fake_quant_constants_are_float32_initializers_with_unique_names():
    doc = encode_named(matmul_relu_quantizers(), "2.0.0")
    model = insert_fake_quant(matmul_relu(), doc)
    inits = [t for t in model.graph.initializer if t.name != "w"]
    assert len({t.name for t in inits}) == len(inits) == 4 * 4
    assert {t.data_type for t in inits} == {TensorProto.FLOAT}


def test_encoding_a_tensor_the_model_lacks_is_an_export_error():
    quantizers = {"nope": matmul_relu_quantizers()["x"]}
    with pytest.raises(ExportError, match="'nope'"):
        insert_fake_quant(matmul_relu(), encode_named(quantizers, "1.0.0"))


@pytest.mark.parametrize("version", ["1.0.0", "0.6.1", "2.0.0"])
def test_written_text_parses_back_to_the_document_one_entry_per_line(version):
    from graphbuild.targets.qnn.encodings import dumps_encodings

    qmap = QuantMap(
        (
            QuantSpec(0, 8, False, 0, 255),
            QuantSpec(1, 8, True, -127, 127, axis=0, param="w"),
        )
    )
    values = QuantValues(
        {
            0: QParams(torch.tensor([0.1]), torch.tensor([3])),
            1: QParams(torch.tensor([0.1, 0.2]), torch.tensor([0, 0])),
        }
    )
    doc = build_encodings(qmap, values, {0: "a", 1: "w"}, version)
    text = dumps_encodings(doc)
    assert json.loads(text) == doc
    assert len(text.splitlines()) >= 4
