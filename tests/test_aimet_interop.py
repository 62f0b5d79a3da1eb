"""Qualcomm's own tooling accepts graphbuild's QNN exports: aimet-onnx 2.42 with its
``htp_v81`` configuration loads the encodings of every zoo model strictly (1.0.0, 0.6.1 and
2.0.0) and imports the ``onnx_qdq`` model strictly.

Needs the ``interop`` extra (``pip install -e ".[interop]"``); skipped without it.
"""

from __future__ import annotations

import json
import logging
import tempfile

import onnx
import pytest

from tests import zoo
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


@pytest.mark.parametrize(("name", "preset"), cases())
def test_aimet_imports_the_qdq_model_strictly(name, preset, zoo_cache):
    art = export_zoo(name, preset, "onnx_qdq", zoo_cache)
    param_type, activation_type = TYPES[preset]
    sim = QuantizationSimModel.from_onnx_qdq(
        onnx.load(art.files["onnx"]),
        strict=True,
        param_type=param_type,
        activation_type=activation_type,
        config_file=CONFIG,
        path=tempfile.mkdtemp(prefix="aimet_sim_"),
    )
    enabled = [q for q in sim.qc_quantize_op_dict.values() if q.enabled]
    assert enabled and all(q.is_initialized() for q in enabled)
