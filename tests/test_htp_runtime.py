"""Qualcomm's HTP backend (onnxruntime-qnn) as the judge: a QDQ model QNN takes whole compiles
with CPU fallback disabled and matches onnxruntime's CPU; one it does not is refused with QNN's
own reasons; ops QNN receives in float are named. Models are built here with onnx.helper."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphbuild.errors import ConfigError
from graphbuild.targets.qnn import htp_runtime as hr
from graphbuild.targets.qnn.htp_runtime import HtpRefusedError, HtpUnavailableError

pytest.importorskip("onnxruntime_qnn", reason="the htp extra (onnxruntime-qnn) is not installed")
if not hr.availability().available:
    pytest.skip(hr.availability().reason, allow_module_level=True)

V81 = hr.HtpTarget.of("v81")


def _model(nodes, inits, inputs, outputs) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _qdq(name: str, scale: float, zero: int, dtype=np.uint16) -> tuple[list, list, str]:
    """Q -> DQ of tensor ``name`` on a per-tensor grid."""
    s, z = f"{name}_s", f"{name}_z"
    inits = [numpy_helper.from_array(np.array(scale, np.float32), s)]
    inits.append(numpy_helper.from_array(np.array(zero, dtype), z))
    nodes = [
        helper.make_node("QuantizeLinear", [name, s, z], [f"{name}_q"]),
        helper.make_node("DequantizeLinear", [f"{name}_q", s, z], [f"{name}_dq"]),
    ]
    return nodes, inits, f"{name}_dq"


def _weight(rng: np.random.Generator, shape: tuple[int, int], axis: int) -> tuple[list, list, str]:
    """An int8 symmetric per-channel weight behind a DequantizeLinear."""
    w = rng.standard_normal(shape).astype(np.float32)
    scale = np.abs(w).max(axis=1 - axis) / 127
    q = np.clip(np.round(w / np.expand_dims(scale, 1 - axis)), -127, 127).astype(np.int8)
    inits = [
        numpy_helper.from_array(q, "w_q"),
        numpy_helper.from_array(scale.astype(np.float32), "w_s"),
        numpy_helper.from_array(np.zeros_like(scale, dtype=np.int8), "w_z"),
    ]
    return (
        [helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"], axis=axis)],
        inits,
        "w",
    )


def linear_qdq(quantize_input: bool = True) -> bytes:
    """x [1, 16] -> MatMul(W [16, 8], per-channel int8) -> y, 16-bit activations. Without
    ``quantize_input`` the MatMul's input is float and its weight DQ stands alone."""
    rng = np.random.default_rng(0)
    nodes, inits, a = _qdq("x", 4 / 65535, 32768) if quantize_input else ([], [], "x")
    w_nodes, w_inits, w = _weight(rng, (16, 8), axis=1)
    nodes += w_nodes
    inits += w_inits
    nodes.append(helper.make_node("MatMul", [a, w], ["mm"]))
    out_nodes, out_inits, _ = _qdq("mm", 16 / 65535, 32768)
    out_nodes[-1].output[0] = "y"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])
    return _model(nodes + out_nodes, inits + out_inits, [x], [y])


def float_add_then_qdq() -> bytes:
    """x + x in float, then quantized: QNN takes the Add in float."""
    nodes = [helper.make_node("Add", ["x", "x"], ["s"])]
    q_nodes, inits, _ = _qdq("s", 8 / 65535, 32768)
    q_nodes[-1].output[0] = "y"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])
    return _model(nodes + q_nodes, inits, [x], [y])


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).uniform(-1.5, 1.5, (1, 16)).astype(np.float32)}


def test_an_htp_target_names_its_arch_and_defaults_the_soc_model():
    assert hr.HtpTarget.of("v81") == hr.HtpTarget("81", "87")
    assert hr.HtpTarget.of(73, 57) == hr.HtpTarget("73", "57")
    with pytest.raises(ConfigError, match="unknown HTP architecture 'v99'"):
        hr.HtpTarget.of("v99")
    with pytest.raises(ConfigError, match="numeric SoC id"):
        hr.HtpTarget.of("81", "sm8850")


def test_a_model_qnn_takes_whole_compiles_with_no_cpu_fallback():
    session = hr.open_session(linear_qdq(), V81)
    assert not session.cpu_fallback
    report = session.partition
    assert report.fully_on_qnn and report.total_nodes == report.qnn_nodes == 6
    assert report.cpu_nodes == () and report.float_ops == ()
    assert report.qnn_graphs == 1 and report.qnn_ops > 0


def test_the_htp_matches_onnxruntime_cpu_within_output_steps():
    model = linear_qdq()
    steps = hr.output_steps(onnx.load_from_string(model))
    assert steps == {"y": pytest.approx(16 / 65535)}
    feeds = _feeds()
    reference = {"y": feeds["x"] @ np.ones((16, 8), np.float32)}  # any float signal
    (out,) = hr.compare_with_cpu(
        hr.open_session(model, V81), model, feeds, steps=steps, reference=reference
    )
    assert out.name == "y" and out.output_step == pytest.approx(16 / 65535)
    assert out.max_diff_steps is not None and out.max_diff_steps <= 2
    assert out.sqnr_htp_db == pytest.approx(out.sqnr_cpu_db, abs=1.0)


def test_a_refused_model_carries_qnn_reasons_and_the_partition():
    model = linear_qdq(quantize_input=False)
    with pytest.raises(HtpRefusedError) as caught:
        hr.open_session(model, V81)
    refused = caught.value
    assert "fallback to CPU EP has been explicitly disabled" in refused.onnxruntime_message
    assert refused.target == "v81 (SoC 87)"
    (cpu,) = refused.partition.cpu_nodes
    assert cpu.op_type == "DequantizeLinear"
    assert "standalone DQ op with per-channel quantization" in cpu.reason
    assert refused.partition.qnn_nodes < refused.partition.total_nodes
    assert cpu.reason in str(refused)


def test_with_cpu_fallback_allowed_the_same_model_runs_and_says_what_fell_back():
    session = hr.open_session(linear_qdq(quantize_input=False), V81, allow_cpu_fallback=True)
    assert session.cpu_fallback
    assert [n.op_type for n in session.partition.cpu_nodes] == ["DequantizeLinear"]
    assert session.run(_feeds())["y"].shape == (1, 8)


def test_every_op_qnn_receives_in_float_is_named_with_its_float_tensors():
    session = hr.open_session(float_add_then_qdq(), V81)
    (op,) = session.partition.float_ops
    assert op.op_type == "ElementWiseAdd"
    assert "x" in op.float_tensors and "float32" in op.dtypes


def test_check_model_reports_a_refusal_with_numbers_from_the_fallback_session():
    check = hr.check_model(linear_qdq(quantize_input=False), _feeds(), V81)
    doc = check.to_json()
    assert doc["compiled"] is False and "CPU EP" in doc["refusal"]
    assert doc["partition"]["cpu_nodes"][0]["reason"]
    assert doc["outputs"][0]["max_diff_steps"] is not None
    assert set(doc["versions"]) == {"onnxruntime", "onnxruntime_qnn", "qnn_sdk"}
    assert doc["summary"].startswith(
        "QNN HTP v81 (SoC 87): refused; 3/4 ONNX nodes on QNN, 1 on the CPU"
    )


def test_without_onnxruntime_qnn_the_reason_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)  # import fails
    hr.availability.cache_clear()
    hr.backend_versions.cache_clear()
    try:
        found = hr.availability()
        assert not found.available
        assert "pip install 'graphbuild[htp]'" in found.reason
        assert "Linux x86_64" in found.reason
        with pytest.raises(HtpUnavailableError, match="onnxruntime-qnn is not installed"):
            hr.require_backend()
    finally:
        hr.availability.cache_clear()
        hr.backend_versions.cache_clear()


def test_what_qnn_prints_from_c_is_captured_and_kept_off_stdout(capfd):
    """QNN's libraries print a line to the process's stdout when they load (``--json`` must
    stay one JSON document), and onnxruntime logs to stderr from C++."""
    import ctypes
    import os

    from graphbuild.targets.qnn.htp_runtime.intercept import intercepted_output

    libc = ctypes.CDLL(None)
    with intercepted_output() as got:
        libc.printf(b"printed from C\n")
        os.write(2, b"logged to stderr\n")
    out, err = capfd.readouterr()
    assert "printed from C" not in out and "logged to stderr" not in err
    assert "printed from C" in got[0] and "logged to stderr" in got[0]
    print("after")
    assert capfd.readouterr().out == "after\n"
