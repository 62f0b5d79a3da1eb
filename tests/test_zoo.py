"""The model zoo through the QNN presets: every tensor QNN HTP runs quantized is quantized as
HTP runs it, the ONNX model agrees with torch's fake-quant reference, and a second export
from the command line in a new process is all hits.

Default suite: one preset per model (the cheap CNNs get all three); ``-m slow`` runs the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import zoo
from tests.zoo_exports import DEFAULT_CASES, PRESETS, export_zoo

REPO = Path(__file__).resolve().parents[1]


def cases(fmt_list: tuple[str, ...] = ("onnx", "onnx_qdq")) -> list:
    out = []
    for name in zoo.ZOO:
        for preset in PRESETS:
            for fmt in fmt_list:
                marks = () if (name, preset) in DEFAULT_CASES else (pytest.mark.slow,)
                out.append(
                    pytest.param(name, preset, fmt, marks=marks, id=f"{name}-{preset}-{fmt}")
                )
    return out


@pytest.mark.parametrize(("name", "preset", "fmt"), cases())
def test_every_tensor_htp_quantizes_is_quantized_as_htp_runs_it(name, preset, fmt, zoo_cache):
    coverage = export_zoo(name, preset, fmt, zoo_cache).report.extra["coverage"]
    assert coverage["expected"] > 0
    assert coverage["float"] == [], coverage["summary"]
    assert coverage["mismatched"] == [], coverage["summary"]
    assert coverage["extra"] == [], coverage["summary"]
    assert coverage["quantized"] == coverage["expected"]


@pytest.mark.parametrize(("name", "preset", "fmt"), cases())
def test_onnx_agrees_with_the_torch_fake_quant_reference(name, preset, fmt, zoo_cache):
    """Given torch's quantized inputs, every quantized tensor and the output land within two
    steps of torch's (reports/numerics.py: end to end, 16-bit steps flip through the layers)."""
    numerics = export_zoo(name, preset, fmt, zoo_cache).report.extra["numerics"]
    forced = numerics["forced"]
    assert forced["tensors"] > 0
    assert forced["max_error_steps"] <= 2, forced
    assert numerics["outputs"]
    for out in numerics["outputs"]:
        assert out["name"] == zoo.ZOO[name].output
        assert out["forced_max_error_steps"] is not None
        assert out["forced_max_error_steps"] <= 2, out
        assert out["sqnr_db"] > 60, out


def cli_cases() -> list:
    fast = {"resnet", "llama"}
    return [
        pytest.param(name, marks=() if name in fast else (pytest.mark.slow,), id=name)
        for name in zoo.ZOO
    ]


@pytest.mark.parametrize("name", cli_cases())
def test_second_cli_export_in_a_new_process_is_all_hits(name, zoo_cache, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "zoo_model.py").write_text(
        "from tests import zoo\n\n\n"
        f"def build():\n    return zoo.build({name!r})\n\n\n"
        f"def calibration():\n    return zoo.calibration({name!r})\n"
    )
    (project / "graphbuild.toml").write_text(
        'model = "zoo_model.py:build"\ncalibration = "zoo_model.py:calibration"\n'
        f'model_name = "{name}"\noutput_dir = "out"\n[quantization]\npreset = "w8a16"\n'
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    env["GRAPHBUILD_CACHE_DIR"] = str(zoo_cache.path)

    def export() -> dict:
        proc = subprocess.run(
            [sys.executable, "-m", "graphbuild", "export", "--target", "qnn", "--json"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    first = export()
    second = export()
    assert {s["status"] for s in second["stages"]} == {"hit"}, [
        (s["name"], s["reason"]) for s in second["stages"] if s["status"] != "hit"
    ]
    assert second["reports"]["coverage"] == first["reports"]["coverage"]
    assert second["reports"]["coverage"]["float"] == []


def test_zoo_models_are_built_from_configs_without_downloads():
    model, sample = zoo.build("llama")
    assert sum(p.numel() for p in model.parameters()) < 200_000
    assert sample[0].shape == (1, zoo.SEQ)
