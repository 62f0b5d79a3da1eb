"""Qualcomm's own tooling accepts graphbuild's QNN exports: aimet-onnx 2.42 with its
``htp_v81`` configuration loads the encodings of every zoo model strictly (1.0.0, 0.6.1 and
2.0.0) and imports the ``onnx_qdq`` model strictly: as it is with the qnn option
``matmul_int16_requantize = false``, and by default once the one thing AIMET has no quantizer
for is bypassed: the HTP's int16 requantization in front of a 16-bit second MatMul input
(``qdq_forms``), each checked to be the very grid of the quantizer before it.

Needs the ``interop`` extra (``pip install -e ".[interop]"``); skipped without it.
"""

from __future__ import annotations

import json
import logging
import tempfile

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests import zoo
from tests.test_qdq_forms import export_bias_relu
from tests.zoo_exports import DEFAULT_CASES, PRESETS, export_zoo

aimet_onnx = pytest.importorskip(
    "aimet_onnx", reason="the interop extra (aimet-onnx) is not installed"
)
from aimet_onnx import QuantizationSimModel  # noqa: E402
from aimet_onnx.quantsim import load_encodings_to_sim  # noqa: E402

logging.getLogger("Quant").setLevel(logging.ERROR)  # aimet's logger; errors are raised

CONFIG = "htp_v81"
#: preset -> (aimet param_type, activation_type)
TYPES = {"w8a8": ("int8", "int8"), "w8a16": ("int8", "int16"), "w4a16": ("int4", "int16")}
VERSIONS = ("1.0.0", "0.6.1", "2.0.0")


def cases() -> list:
    return [
        pytest.param(
            name,
            preset,
            marks=() if (name, preset) in DEFAULT_CASES else (pytest.mark.slow,),
            id=f"{name}-{preset}",
        )
        for name in zoo.ZOO
        for preset in PRESETS
    ]


def sim_for(model: onnx.ModelProto, preset: str) -> QuantizationSimModel:
    param_type, activation_type = TYPES[preset]
    return QuantizationSimModel(
        model,
        param_type=param_type,
        activation_type=activation_type,
        quant_scheme="min_max",
        config_file=CONFIG,
        path=tempfile.mkdtemp(prefix="aimet_sim_"),
    )


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "preset"), cases())
def test_aimet_loads_the_encodings_strictly(name, preset, version, zoo_cache):
    """2.0.0 without int32 bias encodings: AIMET's strict loader refuses those, its own too
    (its sim leaves biases unquantized; see the next test)."""
    bias = False if version == "2.0.0" else None
    art = export_zoo(name, preset, "onnx", zoo_cache, version, int32_bias=bias)
    sim = sim_for(onnx.load(art.files["onnx"]), preset)
    mismatches = load_encodings_to_sim(sim, str(art.files["encodings"]), strict=True)
    assert [m for m in mismatches if m.has_mismatch()] == []
    enabled = {n for n, q in sim.qc_quantize_op_dict.items() if q.enabled}
    assert enabled, "the sim quantizes nothing"
    assert all(sim.qc_quantize_op_dict[n].is_initialized() for n in enabled)


@pytest.mark.parametrize(("name", "preset"), cases())
def test_aimet_loads_2_0_0_int32_biases_and_differs_on_them_alone(name, preset, zoo_cache):
    """The 2.0.0 default writes int32 bias encodings, as AIMET's own export does; AIMET's
    loader takes them (strict=False) and its only complaint is that its sim does not
    quantize biases."""
    art = export_zoo(name, preset, "onnx", zoo_cache, "2.0.0")
    doc = json.loads(art.files["encodings"].read_text())
    biases = {e["name"] for e in doc["encodings"] if e["output_dtype"] == "int32"}
    sim = sim_for(onnx.load(art.files["onnx"]), preset)
    mismatches = load_encodings_to_sim(sim, str(art.files["encodings"]), strict=False)
    assert {m.quantizer_name for m in mismatches if m.has_mismatch()} == biases
    assert all(m.enabled_mismatch == (False, True) for m in mismatches if m.has_mismatch())


def producers_and_readers(
    model: onnx.ModelProto,
) -> tuple[dict[str, onnx.NodeProto], dict[str, list[tuple[onnx.NodeProto, int]]]]:
    """tensor -> the node making it; tensor -> (node, input index) of each node reading it."""
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, i))
    return producer, readers


def without_matmul_requantizations(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with each QuantizeLinear -> DequantizeLinear that requantizes a dequantized
    tensor for the second inputs of MatMuls alone bypassed, after checking it changes no
    value: the same scale, a signed zero point 2^(b-1) below the unsigned one it follows."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    producer, readers = producers_and_readers(model)
    bypassed = []
    for q in [n for n in model.graph.node if n.op_type == "QuantizeLinear"]:
        before = producer.get(q.input[0])
        dqs = [r for r, _ in readers.get(q.output[0], []) if r.op_type == "DequantizeLinear"]
        if before is None or before.op_type != "DequantizeLinear" or len(dqs) != 1:
            continue
        uses = readers.get(dqs[0].output[0], [])
        if not uses or any(r.op_type != "MatMul" or i != 1 for r, i in uses):
            continue
        zero, prior = inits[q.input[2]], inits[before.input[2]]
        assert inits[q.input[1]] == inits[before.input[1]], q.name
        assert zero.dtype == np.int16 and prior.dtype == np.uint16, q.name
        assert int(zero) == int(prior) - 32768 == 0, q.name
        for r, i in uses:
            r.input[i] = q.input[0]
        bypassed += [q, dqs[0]]
    for node in bypassed:
        model.graph.node.remove(node)
    return model, len(bypassed) // 2


@pytest.mark.parametrize(("name", "preset"), cases())
def test_aimet_imports_the_qdq_model_strictly(name, preset, zoo_cache):
    """Strictly, once the int16 requantizations before 16-bit second MatMul inputs are
    checked to be exact and bypassed: the HTP's 16x16 MatMul keeps about 8 bits of a uint16
    second input (``tests/test_qdq_forms.py``), AIMET's sim has no quantizer there."""
    art = export_zoo(name, preset, "onnx_qdq", zoo_cache)
    param_type, activation_type = TYPES[preset]
    model, requantized = without_matmul_requantizations(onnx.load(art.files["onnx"]))
    if activation_type == "int8" or name in ("resnet", "mobilenetv3", "convbias", "poolhead"):
        assert requantized == 0
    sim = QuantizationSimModel.from_onnx_qdq(
        model,
        strict=True,
        param_type=param_type,
        activation_type=activation_type,
        config_file=CONFIG,
        path=tempfile.mkdtemp(prefix="aimet_sim_"),
    )
    enabled = [q for q in sim.qc_quantize_op_dict.values() if q.enabled]
    assert enabled and all(q.is_initialized() for q in enabled)


@pytest.mark.parametrize(("name", "preset"), cases())
def test_aimet_imports_the_qdq_model_without_int16_requantization_strictly_as_it_is(
    name, preset, zoo_cache
):
    """``matmul_int16_requantize = false`` writes the QDQ model AIMET's sim represents: it
    takes the file as written, nothing bypassed."""
    art = export_zoo(name, preset, "onnx_qdq", zoo_cache, matmul_int16_requantize=False)
    model = onnx.load(art.files["onnx"])
    _, requantized = without_matmul_requantizations(onnx.load(art.files["onnx"]))
    assert requantized == 0
    param_type, activation_type = TYPES[preset]
    sim = QuantizationSimModel.from_onnx_qdq(
        model,
        strict=True,
        param_type=param_type,
        activation_type=activation_type,
        config_file=CONFIG,
        path=tempfile.mkdtemp(prefix="aimet_sim_"),
    )
    enabled = [q for q in sim.qc_quantize_op_dict.values() if q.enabled]
    assert enabled and all(q.is_initialized() for q in enabled)


@pytest.mark.parametrize("preset", ["w8a16", "w4a16"])
def test_aimet_groups_a_linears_bias_add_with_its_relu_as_the_encodings_do(preset, tmp_path):
    """MatMul + Add (a linear on 3-D activations) then Relu: AIMET's sim leaves the Add's
    output unquantized (its ``Add -> Relu`` supergroup), and so do the encodings."""
    art = export_bias_relu(tmp_path, "onnx", preset)
    sim = sim_for(onnx.load(art.files["onnx"]), preset)
    mismatches = load_encodings_to_sim(sim, str(art.files["encodings"]), strict=True)
    assert [m for m in mismatches if m.has_mismatch()] == []


def without_relu_group_quantizers(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with each QuantizeLinear -> DequantizeLinear between an Add and its Relu
    (the HTP form of the ``Add -> Relu`` supergroup) bypassed, after checking it is the
    Relu output's own encoding: the same scale and zero point initializers."""
    producer, readers = producers_and_readers(model)
    bypassed = []
    for relu in [n for n in model.graph.node if n.op_type == "Relu"]:
        dq = producer.get(relu.input[0])
        q = (
            producer.get(dq.input[0])
            if dq is not None and dq.op_type == "DequantizeLinear"
            else None
        )
        if q is None or q.op_type != "QuantizeLinear" or producer[q.input[0]].op_type != "Add":
            continue
        (after,) = [r for r, _ in readers[relu.output[0]] if r.op_type == "QuantizeLinear"]
        assert list(q.input[1:]) == list(after.input[1:]), q.name
        relu.input[0] = q.input[0]
        bypassed += [q, dq]
    for node in bypassed:
        model.graph.node.remove(node)
    return model, len(bypassed) // 2


def test_aimet_imports_the_qdq_model_of_a_bias_add_before_a_relu_strictly(tmp_path):
    """Once the HTP's Q/DQ on the Add (the Relu's own grid: exact) is bypassed."""
    art = export_bias_relu(tmp_path, "onnx_qdq", "w8a16")
    model, bypassed = without_relu_group_quantizers(onnx.load(art.files["onnx"]))
    assert bypassed == 1
    sim = QuantizationSimModel.from_onnx_qdq(
        model,
        strict=True,
        param_type="int8",
        activation_type="int16",
        config_file=CONFIG,
        path=tempfile.mkdtemp(prefix="aimet_sim_"),
    )
    enabled = [q for q in sim.qc_quantize_op_dict.values() if q.enabled]
    assert enabled and all(q.is_initialized() for q in enabled)
