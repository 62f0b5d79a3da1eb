"""An LPBQ export of transformers' Llama (``w4a16_lpbq``): AIMET's strict loader takes its
encodings, and QNN's HTP holds its projection weights in LPBQ blocks.

Slow (a few exports of a 2-layer Llama with hidden size 128, so that its weights have more
than one block of 64); needs transformers, and the interop and htp extras for their parts.
"""

from __future__ import annotations

import json

import pytest

import graphbuild as gb
from tests.test_lpbq import assert_aimet_takes_it

pytestmark = pytest.mark.slow
pytest.importorskip("transformers", reason="the examples extra (transformers)")

from examples import tiny_llama  # noqa: E402

#: 2 layers x (q, k, v, o, gate, up, down) and the output layer
LPBQ_WEIGHTS = 15


def export(out, cache, fmt="onnx", version="1.0.0", **options) -> gb.ExportArtifacts:
    model, sample = tiny_llama.build(
        hidden_size=128, intermediate_size=256, attn_implementation="sdpa"
    )
    options = gb.QnnOnnxOptions(
        quantizer="w4a16_lpbq",
        calibration=tiny_llama.calibration(2),
        encodings_version=version,
        **options,
    )
    return gb.export(model, sample, out, "llama", format=fmt, options=options, cache=cache)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> gb.Cache:
    return gb.Cache(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("version", ["1.0.0", "2.0.0"])
def test_aimet_loads_a_llamas_lpbq_encodings_strictly(tmp_path, cache, version):
    art = export(tmp_path / "out", cache, version=version, int32_bias=False, check_numerics=True)
    doc = json.loads(art.files["encodings"].read_text())
    entries = doc.get("param_encodings") or doc["encodings"]
    lpbq = [e for e in entries if e.get("enc_type") == "LPBQ" or "per_block_int_scale" in e]
    assert len(lpbq) == LPBQ_WEIGHTS
    for out in art.report.extra["numerics"]["outputs"]:
        assert out["forced_max_error_steps"] <= 2, out
    assert_aimet_takes_it(art, version, tmp_path)


def _htp_check(tmp_path, cache, fmt: str) -> dict:
    pytest.importorskip("onnxruntime_qnn", reason="the htp extra (onnxruntime-qnn)")
    from graphbuild.targets.qnn import htp_runtime as hr

    if not hr.availability().available:
        pytest.skip(hr.availability().reason)
    art = export(tmp_path, cache, fmt=fmt, check_htp=True)
    (check,) = art.report.extra["htp"]["checks"]
    return check


@pytest.mark.parametrize("fmt", ["onnx_qdq", "onnx"])
def test_qnn_htp_holds_every_projection_it_takes_quantized_in_lpbq_blocks(tmp_path, cache, fmt):
    """Every LPBQ weight is either held by QNN as LPBQ or, with QNN's reason, left to the
    CPU: today the value projections, whose output feeds attention's second MatMul input on
    a signed int16 grid, which QNN takes only unsigned (issue 18; with those activations in
    the unsigned container the export compiles with all 15 held as LPBQ)."""
    check = _htp_check(tmp_path, cache, fmt)
    partition = check["partition"]
    held = {t.removesuffix("_quantized") for t in partition["lpbq_tensors"]}
    on_cpu = {n["name"] for n in partition["cpu_nodes"]}
    left = {w for w in _weights() if w not in held}
    assert len(held) + len(left) == LPBQ_WEIGHTS
    assert all(".self_attn.v_proj." in w for w in left), left
    for weight in left:
        assert any(name.startswith(weight) for name in on_cpu), (weight, on_cpu)
    assert all(n["reason"] for n in partition["cpu_nodes"])


@pytest.mark.xfail(strict=True, reason="issue 18: QNN refuses signed int16 activations")
def test_the_llamas_lpbq_export_compiles_on_the_htp(tmp_path, cache):
    check = _htp_check(tmp_path, cache, "onnx_qdq")
    assert check["compiled"], check["refusal"]
    assert len(check["partition"]["lpbq_tensors"]) == LPBQ_WEIGHTS


def _weights() -> list[str]:
    layers = [
        f"model.model.layers.{i}.{part}.weight"
        for i in range(2)
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    return [*layers, "model.lm_head.weight"]
