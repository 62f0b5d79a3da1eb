"""What AIMET's own encodings carry: ``producer``, ``quantizer_args``, ``excluded_layers`` and
int32 bias encodings (aimet-onnx / aimet-torch 2.42 ``QuantizationSimModel.export``)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import graphbuild
from graphbuild.errors import ExportError
from graphbuild.onnx.lower import lower_markers
from graphbuild.quant.quantmap import QParams, QuantMap, QuantSpec, QuantValues
from graphbuild.targets.qnn.encodings import (
    VERSIONS,
    build_encodings,
    dumps_encodings,
    insert_fake_quant,
    read_encodings,
)

INT32 = (-(2**31), 2**31 - 1)

# What aimet-onnx 2.42 wrote for a ConvNet (w8a16, htp_v81): the keys and value types of
# ``quantizer_args`` and ``producer`` graphbuild's documents must have too.
AIMET_QUANTIZER_ARGS = {
    "activation_bitwidth": 16,
    "dtype": "int",
    "is_symmetric": True,
    "param_bitwidth": 8,
    "per_channel_quantization": True,
    "quant_scheme": "min_max",
}
AIMET_PRODUCER = {"package": "aimet-onnx", "version": "2.42.0"}


def spec(qid: int, bits: int = 8, signed: bool = True, **kw) -> QuantSpec:
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return QuantSpec(qid=qid, bits=bits, signed=signed, qmin=lo, qmax=hi, **kw)


def qp(scale, zero_point) -> QParams:
    return QParams(
        torch.tensor(scale, dtype=torch.float32), torch.tensor(zero_point, dtype=torch.int64)
    )


# ------------------------------------------------------------------------- a Conv+Gemm graph

RNG = np.random.default_rng(3)
CONV_W = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.2
CONV_B = RNG.standard_normal(4).astype(np.float32) * 0.1
FC_W = RNG.standard_normal((5, 4 * 4 * 4)).astype(np.float32) * 0.1
FC_B = RNG.standard_normal(5).astype(np.float32) * 0.1
MM_W = RNG.standard_normal((5, 6)).astype(np.float32) * 0.2
MM_B = RNG.standard_normal(6).astype(np.float32) * 0.1
X = RNG.standard_normal((1, 3, 6, 6)).astype(np.float32)


def conv_gemm_matmul() -> onnx.ModelProto:
    """``x -> Conv(+b) -> Relu (r) -> Flatten (f) -> Gemm(+b, transB) (g) -> MatMul -> Add(b)``."""
    nodes = [
        helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["c"]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Flatten", ["r"], ["f"]),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["g"], transB=1),
        helper.make_node("MatMul", ["g", "mm.weight"], ["m"]),
        helper.make_node("Add", ["m", "mm.bias"], ["out"]),
    ]
    inits = [
        numpy_helper.from_array(a, n)
        for a, n in (
            (CONV_W, "conv.weight"),
            (CONV_B, "conv.bias"),
            (FC_W, "fc.weight"),
            (FC_B, "fc.bias"),
            (MM_W, "mm.weight"),
            (MM_B, "mm.bias"),
        )
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 6])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def per_channel_scales(w: np.ndarray, axis: int) -> list[float]:
    other = tuple(i for i in range(w.ndim) if i != axis)
    return (np.abs(w).max(axis=other) / 127).astype(np.float32).tolist()


def conv_gemm_quantizers(weight_axis: dict[str, int | None] | None = None) -> list:
    """(spec, values, tensor): uint16 x, r, g; int8 weights per channel along the output
    channel (Conv 0, Gemm with transB 0, MatMul 1) unless ``weight_axis`` says otherwise."""
    axes = {"conv.weight": 0, "fc.weight": 0, "mm.weight": 1, **(weight_axis or {})}
    weights = {"conv.weight": CONV_W, "fc.weight": FC_W, "mm.weight": MM_W}
    out = [
        (spec(0, 16, False), qp([0.0002], [30000]), "x"),
        (spec(2, 16, False), qp([0.0001], [0]), "r"),
        (spec(4, 16, False), qp([0.0003], [31000]), "g"),
    ]
    for qid, name in ((1, "conv.weight"), (3, "fc.weight"), (5, "mm.weight")):
        axis = axes[name]
        w = weights[name]
        if axis is None:
            out.append((spec(qid, param=name), qp([float(np.abs(w).max() / 127)], [0]), name))
        else:
            scales = per_channel_scales(w, axis)
            zeros = [0] * len(scales)
            out.append((spec(qid, axis=axis, param=name), qp(scales, zeros), name))
    return sorted(out, key=lambda q: q[0].qid)


def encode(quantizers: list, version: str, **kw) -> dict:
    qmap = QuantMap(tuple(s for s, _, _ in quantizers))
    values = QuantValues({s.qid: v for s, v, _ in quantizers})
    names = {s.qid: n for s, _, n in quantizers}
    return build_encodings(qmap, values, names, version, **kw)


def entries(doc: dict) -> dict[str, object]:
    if doc["version"] == "2.0.0":
        return {e["name"]: e for e in doc["encodings"]}
    if doc["version"] == "0.6.1":
        return {**doc["activation_encodings"], **doc["param_encodings"]}
    return {e["name"]: e for s in ("activation_encodings", "param_encodings") for e in doc[s]}


def scale_of(quantizers: list, name: str) -> np.ndarray:
    return next(v.scale.numpy() for _, v, n in quantizers if n == name)


# ------------------------------------------------------------------- producer, quantizer_args


@pytest.mark.parametrize("version", VERSIONS)
def test_every_version_names_graphbuild_as_producer_in_aimets_form(version):
    doc = encode(conv_gemm_quantizers(), version)
    assert doc["producer"] == {"package": "graphbuild", "version": graphbuild.__version__}
    assert set(doc["producer"]) == set(AIMET_PRODUCER)


@pytest.mark.parametrize("version", ["1.0.0", "0.6.1"])
def test_quantizer_args_have_aimets_keys_and_value_types(version):
    doc = encode(conv_gemm_quantizers(), version, quant_scheme="min_max")
    args = doc["quantizer_args"]
    assert args == AIMET_QUANTIZER_ARGS
    assert {k: type(v) for k, v in args.items()} == {
        k: type(v) for k, v in AIMET_QUANTIZER_ARGS.items()
    }


def test_quantizer_args_follow_the_most_common_bit_widths_and_say_per_tensor_weights():
    quantizers = [
        (spec(0, 8, False), qp([0.1], [3]), "a"),
        (spec(1, 8, False), qp([0.1], [3]), "b"),
        (spec(2, 16, False), qp([0.1], [3]), "c"),
        (spec(3, 4, param="w"), qp([0.1], [0]), "w"),
    ]
    args = encode(quantizers, "1.0.0")["quantizer_args"]
    assert args["activation_bitwidth"] == 8 and args["param_bitwidth"] == 4
    assert args["per_channel_quantization"] is False and args["is_symmetric"] is True
    assert "quant_scheme" not in args  # not known for a model graphbuild did not calibrate


def test_0_6_1_has_excluded_layers_as_aimet_torch_writes_it():
    doc = encode(conv_gemm_quantizers(), "0.6.1")
    assert doc["excluded_layers"] == []
    assert set(doc) == {
        "version",
        "producer",
        "activation_encodings",
        "param_encodings",
        "excluded_layers",
        "quantizer_args",
    }


def test_2_0_0_carries_no_quantizer_args_or_excluded_layers_as_aimet_onnx_writes_it():
    doc = encode(conv_gemm_quantizers(), "2.0.0", model=conv_gemm_matmul())
    assert set(doc) == {"version", "producer", "encodings"}


@pytest.mark.parametrize("version", VERSIONS)
def test_documents_with_the_new_fields_read_back(version):
    quantizers = conv_gemm_quantizers()
    doc = json.loads(dumps_encodings(encode(quantizers, version, model=conv_gemm_matmul())))
    read = read_encodings(doc)
    for _, v, name in quantizers:
        np.testing.assert_array_equal(read[name].scale, v.scale.numpy().reshape(-1))


# ----------------------------------------------------------------------------- int32 biases


def test_2_0_0_gives_each_bias_an_int32_encoding_input_scale_times_weight_scale():
    quantizers = conv_gemm_quantizers()
    doc = encode(quantizers, "2.0.0", model=conv_gemm_matmul())
    found = entries(doc)
    # conv reads x; fc reads r through Flatten (grid-preserving); mm reads g
    for bias, x, w in (("conv.bias", "x", "conv.weight"), ("fc.bias", "r", "fc.weight")):
        expected = np.float32(scale_of(quantizers, x)[0]) * scale_of(quantizers, w)
        assert found[bias] == {
            "name": bias,
            "output_dtype": "int32",
            "y_scale": expected.astype(np.float32).tolist(),
            "axis": 0,
        }
    mm = np.float32(scale_of(quantizers, "g")[0]) * scale_of(quantizers, "mm.weight")
    assert found["mm.bias"]["y_scale"] == mm.tolist()


def test_bias_entries_follow_their_weight_entry():
    doc = encode(conv_gemm_quantizers(), "2.0.0", model=conv_gemm_matmul())
    names = [e["name"] for e in doc["encodings"]]
    for layer in ("conv", "fc", "mm"):
        assert names.index(f"{layer}.bias") == names.index(f"{layer}.weight") + 1


def test_a_per_tensor_weight_gives_a_per_tensor_bias():
    quantizers = conv_gemm_quantizers({"conv.weight": None})
    found = entries(encode(quantizers, "2.0.0", model=conv_gemm_matmul()))
    expected = np.float32(scale_of(quantizers, "x")[0]) * scale_of(quantizers, "conv.weight")
    assert found["conv.bias"] == {
        "name": "conv.bias",
        "output_dtype": "int32",
        "y_scale": float(expected[0]),
    }


def test_int32_bias_false_leaves_biases_out_of_2_0_0():
    found = entries(
        encode(conv_gemm_quantizers(), "2.0.0", model=conv_gemm_matmul(), int32_bias=False)
    )
    assert not {"conv.bias", "fc.bias", "mm.bias"} & set(found)


def test_1_0_0_writes_no_bias_by_default_and_aimets_int32_entry_on_request():
    model = conv_gemm_matmul()
    assert "conv.bias" not in entries(encode(conv_gemm_quantizers(), "1.0.0", model=model))
    quantizers = conv_gemm_quantizers()
    doc = encode(quantizers, "1.0.0", model=model, int32_bias=True)
    (entry,) = [e for e in doc["param_encodings"] if e["name"] == "conv.bias"]
    expected = np.float32(scale_of(quantizers, "x")[0]) * scale_of(quantizers, "conv.weight")
    assert entry == {
        "name": "conv.bias",
        "dtype": "INT",
        "enc_type": "PER_CHANNEL",
        "bw": 32,
        "is_sym": True,
        "scale": expected.tolist(),
        "offset": [-(2**31)] * 4,
    }
    assert doc["quantizer_args"]["param_bitwidth"] == 8  # biases are not weights here


def test_0_6_1_bias_min_max_span_the_int32_grid():
    quantizers = conv_gemm_quantizers()
    doc = encode(quantizers, "0.6.1", model=conv_gemm_matmul(), int32_bias=True)
    channels = doc["param_encodings"]["conv.bias"]
    assert len(channels) == 4
    for c in channels:
        assert c["bitwidth"] == 32 and c["offset"] == -(2**31) and c["is_symmetric"] == "True"
        assert c["min"] == c["scale"] * INT32[0] and c["max"] == c["scale"] * INT32[1]


def test_int32_bias_true_without_a_model_is_an_error():
    with pytest.raises(ExportError, match="ONNX model"):
        encode(conv_gemm_quantizers(), "2.0.0", int32_bias=True)


def test_a_bias_whose_input_is_not_quantized_stays_float():
    quantizers = [q for q in conv_gemm_quantizers() if q[2] != "x"]
    assert "conv.bias" not in entries(encode(quantizers, "2.0.0", model=conv_gemm_matmul()))


def test_a_bias_whose_weight_is_not_quantized_stays_float():
    quantizers = [q for q in conv_gemm_quantizers() if q[2] != "fc.weight"]
    assert "fc.bias" not in entries(encode(quantizers, "2.0.0", model=conv_gemm_matmul()))


def test_a_weight_quantized_along_its_input_channel_gives_no_analytic_bias():
    quantizers = conv_gemm_quantizers({"mm.weight": 0})  # MatMul weight: output channel is 1
    assert "mm.bias" not in entries(encode(quantizers, "2.0.0", model=conv_gemm_matmul()))


def test_a_bias_the_input_reaches_through_a_non_preserving_op_stays_float():
    quantizers = [q for q in conv_gemm_quantizers() if q[2] != "r"]  # Relu is not grid-preserving
    assert "fc.bias" not in entries(encode(quantizers, "2.0.0", model=conv_gemm_matmul()))


def test_a_shared_bias_gets_no_single_scale():
    model = conv_gemm_matmul()
    model.graph.node.append(helper.make_node("Add", ["out", "mm.bias"], ["out2"]))
    model.graph.output[0].name = "out2"
    assert "mm.bias" not in entries(encode(conv_gemm_quantizers(), "2.0.0", model=model))


def test_an_already_encoded_bias_is_kept_as_is():
    quantizers = conv_gemm_quantizers()
    mine = (spec(6, 32, param="conv.bias", axis=0), qp([1e-6] * 4, [0] * 4), "conv.bias")
    doc = encode([*quantizers, mine], "2.0.0", model=conv_gemm_matmul())
    found = [e for e in doc["encodings"] if e["name"] == "conv.bias"]
    assert [e["y_scale"] for e in found] == [[np.float32(1e-6).item()] * 4]


def lowered_qdq(quantizers: list) -> tuple[onnx.ModelProto, dict[int, str]]:
    """``conv_gemm_matmul`` with a graphbuild marker on every quantized tensor, lowered to
    Q/DQ: what the encodings stage sees for ``onnx_qdq``."""
    model = onnx.shape_inference.infer_shapes(conv_gemm_matmul())  # typed, as exported
    graph = model.graph
    qids = {name: s.qid for s, _, name in quantizers}

    def marker(name: str) -> onnx.NodeProto:
        return helper.make_node("q", [name], [f"{name}__q"], domain="graphbuild", qid=qids[name])

    nodes = [marker(n) for n in ("x", *(t.name for t in graph.initializer)) if n in qids]
    for node in graph.node:
        for i, inp in enumerate(node.input):
            node.input[i] = f"{inp}__q" if inp in qids else inp
        nodes.append(node)
        nodes.extend(marker(o) for o in node.output if o in qids)
    del graph.node[:]
    graph.node.extend(nodes)
    model.opset_import.append(helper.make_opsetid("graphbuild", 1))
    qmap = QuantMap(tuple(s for s, _, _ in quantizers))
    return lower_markers(model, qmap, "onnx_qdq")


def test_biases_are_found_the_same_way_in_a_qdq_graph():
    quantizers = conv_gemm_quantizers()
    lowered, names = lowered_qdq(quantizers)
    qdq = {e["name"]: e for e in encode(quantizers, "2.0.0", model=lowered)["encodings"]}
    plain = entries(encode(quantizers, "2.0.0", model=conv_gemm_matmul()))
    for bias in ("conv.bias", "fc.bias", "mm.bias"):
        assert qdq[bias] == plain[bias]


def test_int32_bias_reinsertion_is_the_int32_grid_in_float():
    """Putting the bias encodings back quantizes each bias to ``s * round(b / s)`` exactly, so
    the numerics check covers them; the result stays within float32 rounding of the bias."""
    quantizers = conv_gemm_quantizers()
    model = conv_gemm_matmul()
    doc = encode(quantizers, "2.0.0", model=model)
    only_biases = {
        **doc,
        "encodings": [e for e in doc["encodings"] if e["output_dtype"] == "int32"],
    }
    fq = insert_fake_quant(model, only_biases)
    inits = {t.name: numpy_helper.to_array(t) for t in fq.graph.initializer}
    session = ort.InferenceSession(fq.SerializeToString(), providers=["CPUExecutionProvider"])
    out = session.run(None, {"x": X})[0]
    float_out = ort.InferenceSession(model.SerializeToString()).run(None, {"x": X})[0]
    np.testing.assert_allclose(out, float_out, rtol=0, atol=1e-6)
    scale = inits["conv.bias_fq_scale"].reshape(-1)
    expected = (np.round(CONV_B / scale) * scale).astype(np.float32)
    probe = helper.make_tensor_value_info("conv.bias_fq", TensorProto.FLOAT, [4])
    fq.graph.output.append(probe)
    got = ort.InferenceSession(fq.SerializeToString()).run(["conv.bias_fq"], {"x": X})[0]
    np.testing.assert_array_equal(got, expected)
