"""The HTP check as a stage of the qnn pipeline (``check_htp``, ``--check-htp``) and the
``context`` format: Qualcomm's HTP backend compiles the export with CPU fallback disabled, the
coverage report says what QNN took, ``--strict-coverage`` fails on what QNN runs in float or
leaves to the CPU, and the cache keys on the QDQ model, the HTP target and the backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

import graphbuild as gb
from graphbuild.errors import ConfigError, CoverageError, StageError
from graphbuild.onnx.bind import BoundModel
from graphbuild.targets.qnn import htp_runtime as hr
from tests.models import FakeQuantConvNet

pytest.importorskip("onnxruntime_qnn", reason="the htp extra (onnxruntime-qnn) is not installed")
if not hr.availability().available:
    pytest.skip(hr.availability().reason, allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]


def mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    return model, (torch.randn(2, 16),)


def export(
    out, cache, fmt="onnx_qdq", factory=None, model=None, check_fingerprints=False, **options
):
    model, sample = model or mlp()
    options = {"quantizer": "w8a8", "calibration": [sample], "check_htp": True, **options}
    return gb.export(
        model,
        sample,
        out,
        "mlp",
        format=fmt,
        options=gb.QnnOnnxOptions(**options),
        cache=cache,
        pipeline_factory=factory,
        check_fingerprints=check_fingerprints,
    )


def ran(artifacts) -> set[str]:
    """The stages that ran (not a hit, nor a cutoff: a hit whose upstream reran the same)."""
    return {s.name for s in artifacts.report.stages if s.status.value == "ran"}


# ------------------------------------------------------------------ the check


@pytest.mark.parametrize("fmt", ["onnx_qdq", "onnx"])
def test_the_htp_check_compiles_the_export_and_matches_ort_cpu(fmt, tmp_path):
    """``onnx``: the Q/DQ model a QNN tool rebuilds from the float model and its encodings."""
    extra = export(tmp_path / "out", gb.Cache(tmp_path / "cache"), fmt).report.extra
    (check,) = extra["htp"]["checks"]
    assert (check["htp_arch"], check["soc_model"]) == ("81", "87")  # the presets' htp_v81
    assert check["compiled"] and check["refusal"] == ""
    partition = check["partition"]
    assert partition["qnn_nodes"] == partition["total_nodes"] > 0
    assert partition["cpu_nodes"] == [] and partition["float_ops"] == []
    (out,) = check["outputs"]
    assert out["max_diff_steps"] <= 2 and out["forced_max_diff_steps"] <= 2
    assert out["sqnr_htp_db"] == pytest.approx(out["sqnr_cpu_db"], abs=0.5)
    assert check["forced"]["tensors"] > 0 and check["forced"]["max_error_steps"] <= 2
    assert set(check["versions"]) == {"onnxruntime", "onnxruntime_qnn", "qnn_sdk"}
    assert extra["coverage"]["summary"].startswith("QNN HTP v81 (SoC 87): ")


def test_the_htp_report_is_in_the_lock_file(tmp_path):
    art = export(tmp_path / "out", False)
    lock = json.loads(art.files["lock"].read_text())
    assert lock["reports"]["htp"]["summary"] == art.report.extra["htp"]["summary"]
    assert lock["reports"]["coverage"]["qnn"][0]["compiled"] is True


def test_a_warm_reexport_is_all_hits_and_arch_or_backend_changes_rerun_the_check(
    tmp_path, monkeypatch
):
    cache = gb.Cache(tmp_path / "cache")
    export(tmp_path / "a", cache)
    assert ran(export(tmp_path / "a", cache)) == set()
    v79 = export(tmp_path / "b", cache, htp_arch="v79")
    assert ran(v79) == {"check_htp_v79", "htp_report", "coverage_on_htp"}
    assert v79.report.extra["htp"]["checks"][0]["soc_model"] == "69"
    other = {**hr.backend_versions(), "qnn_sdk": "9.99.0"}
    monkeypatch.setattr(hr, "backend_versions", lambda: other)
    new_backend = export(tmp_path / "a", cache)
    assert ran(new_backend) == {"check_htp_v81"}  # its report is the same: cut off there
    assert "registry.htp_backend" in new_backend.report["check_htp_v81"].reason


def test_unknown_htp_architectures_are_configuration_errors():
    with pytest.raises(ConfigError, match="unknown HTP architecture 'v12'"):
        gb.QnnOnnxOptions(htp_arch="v12")
    with pytest.raises(ConfigError, match="one per architecture"):
        gb.QnnOnnxOptions(htp_arch=["v79", "v81"], soc_model=["69", "87", "57"])


# ------------------------------------------------------------------ what QNN refuses


def _unquantized_input(inputs, samples, context):
    """A user stage that drops the Q/DQ pair in front of the first Gemm's input: the Gemm
    then reads a float activation and its per-channel weight DQ stands alone, which QNN's
    HTP will not take (graphbuild's own rules, reading the lowered model, still pass)."""
    (bound,) = inputs
    model = onnx.ModelProto()
    model.CopyFrom(bound.model)
    producer = {o: n for n in model.graph.node for o in n.output}
    gemm = next(n for n in model.graph.node if n.op_type in ("Gemm", "MatMul"))
    dq = producer[gemm.input[0]]
    gemm.input[0] = producer[dq.input[0]].input[0]
    return BoundModel(model, bound.tensors, bound.digests)


def with_unquantized_input(request):
    from graphbuild.targets.qnn.pipeline.build import build_qnn_pipeline

    p = build_qnn_pipeline(request)
    p.insert_stage_after("bind", _unquantized_input, "drop_input_qdq", reads=())
    return p


def test_the_coverage_report_tells_what_qnn_refused(tmp_path):
    extra = export(tmp_path / "out", False, factory=with_unquantized_input).report.extra
    (check,) = extra["htp"]["checks"]
    assert not check["compiled"]
    assert "fallback to CPU EP has been explicitly disabled" in check["refusal"]
    (cpu,) = check["partition"]["cpu_nodes"]
    assert "standalone DQ op with per-channel quantization" in cpu["reason"]
    coverage = extra["coverage"]
    assert coverage["summary"].startswith(
        "QNN HTP v81 (SoC 87) refused it with CPU fallback disabled: "
    )
    assert "1 on the CPU" in coverage["summary"]
    assert coverage["float"] == [] and "rules_summary" in coverage  # graphbuild's view
    assert coverage["qnn"][0]["violations"]


def test_strict_coverage_fails_when_qnn_leaves_a_node_to_the_cpu(tmp_path):
    with pytest.raises(StageError) as caught:
        export(tmp_path / "out", False, factory=with_unquantized_input, strict_coverage=True)
    assert caught.value.stage == "coverage_on_htp"
    assert isinstance(caught.value.cause, CoverageError)
    assert "on the CPU: QNN EP does not support a standalone DQ op" in str(caught.value)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the context format


def test_the_context_format_writes_the_epcontext_model_and_its_binary(tmp_path):
    art = export(tmp_path / "out", gb.Cache(tmp_path / "cache"), "context", check_htp=False)
    ctx, binary = art.files["context_v81"], art.files["context_v81_bin"]
    assert (ctx.name, binary.name) == ("mlp_v81_ctx.onnx", "mlp_v81_ctx_qnn.bin")
    assert hr.context_binaries(ctx) == [binary.name]
    assert sorted(p.name for p in ctx.parent.iterdir()) == sorted(
        ["graphbuild.lock.json", ctx.name, binary.name]
    )
    # the deployed files run on the HTP, as a user loads them
    session = hr.open_session(ctx, hr.HtpTarget.of("v81"))
    assert [n.op_type for n in session.partition.cpu_nodes] == []
    (check,) = art.report.extra["htp"]["checks"]
    assert check["ran"] == "the EPContext model" and check["compiled"]
    assert check["outputs"][0]["max_diff_steps"] <= 2


def test_a_context_is_the_same_bytes_every_time(tmp_path):
    """QNN's binary numbers its tensors with counters that run on in a process, and the
    EPContext node hashes the model's path: preparation runs in a fresh process from a
    relative path, so recomputing every stage (the fingerprint check) gives the same bytes."""
    cache = gb.Cache(tmp_path / "cache")
    first = export(tmp_path / "a", cache, "context")
    export(tmp_path / "b", cache, "context", check_fingerprints=True)  # raises on a difference
    for kind in ("context_v81", "context_v81_bin"):
        assert (
            first.files[kind].read_bytes() == (tmp_path / "b" / first.files[kind].name).read_bytes()
        )


def test_a_scales_only_retune_reprepares_only_the_context(tmp_path):
    """A model with its own quantizers: a scale buffer retuned re-binds and re-prepares the
    context; nothing structural reruns."""
    torch.manual_seed(0)
    model, sample = FakeQuantConvNet().eval(), (torch.randn(1, 3, 16, 16),)
    cache = gb.Cache(tmp_path / "cache")

    def context_export():
        return gb.export(model, sample, tmp_path / "out", "fq", format="context", cache=cache)

    first = context_export()
    assert ran(context_export()) == set()
    with torch.no_grad():
        model.a1_scale.mul_(1.1)
    again = context_export()
    assert {"bind", "prepare_context_v81", "context_v81", "check_htp_v81"} <= ran(again)
    assert not ran(again) & {"capture", "normalize", "marker_graph", "to_onnx", "lower_markers"}
    assert again.files["context_v81_bin"].read_bytes() != b""
    assert first.report.extra["htp"]["checks"][0]["compiled"]


def test_an_architecture_added_prepares_only_its_own_context(tmp_path):
    cache = gb.Cache(tmp_path / "cache")
    export(tmp_path / "out", cache, "context")
    art = export(tmp_path / "out", cache, "context", htp_arch=["v79", "v81"])
    assert ran(art) == {"prepare_context_v79", "context_v79", "check_htp_v79"} | {
        "htp_report",
        "coverage_on_htp",
    }
    assert {"context_v79", "context_v79_bin", "context_v81", "context_v81_bin"} <= set(art.files)
    archs = [c["htp_arch"] for c in art.report.extra["htp"]["checks"]]
    assert archs == ["79", "81"]


# ------------------------------------------------------------------ the command line


@pytest.mark.slow  # a fresh process; the capture itself: test_htp_runtime.py
def test_cli_check_htp_json_is_one_json_document_with_the_htp_report(tmp_path):
    """QNN's libraries print to the process's stdout when they load: none of it may reach
    ``--json``'s document."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "mlp_model.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef build():\n    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()\n"
        "    return model, (torch.randn(2, 16),)\n"
    )
    (project / "graphbuild.toml").write_text(
        'model = "mlp_model.py:build"\nmodel_name = "mlp"\noutput_dir = "out"\n'
        '[quantization]\npreset = "w8a8"\n'
    )
    env = {**os.environ, "GRAPHBUILD_CACHE_DIR": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "graphbuild", "export", "--target", "qnn", "--check-htp", "--json"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["reports"]["htp"]["checks"][0]["compiled"] is True
    assert doc["reports"]["coverage"]["summary"].startswith("QNN HTP v81 (SoC 87): ")


def test_the_cli_prints_one_htp_line():
    from graphbuild.cli.export import _report_lines

    summary = "QNN HTP v81 (SoC 87): compiled; 13/13 ONNX nodes on QNN, 0 QNN ops float"
    lines = _report_lines({"htp": {"checks": [], "summary": summary}})
    assert lines == [f"htp        {summary}"]


def test_without_onnxruntime_qnn_the_check_fails_saying_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)  # its import fails
    hr.availability.cache_clear()
    hr.backend_versions.cache_clear()
    try:
        with pytest.raises(StageError) as caught:
            export(tmp_path / "out", False)
        assert caught.value.stage == "check_htp_v81"
        assert "pip install 'graphbuild[htp]'" in str(caught.value)
        assert "Linux x86_64" in str(caught.value)
    finally:
        hr.availability.cache_clear()
        hr.backend_versions.cache_clear()
