"""``executorch/vgf``'s numerics check: the ``.pte`` runs in ExecuTorch's runtime on a Vulkan
device with Arm's ML extensions, in a process of its own.

On a machine without an ML-capable GPU the device is Mesa's lavapipe (``apt-get install
mesa-vulkan-drivers libvulkan1``) under Arm's ML emulation layer (``pip install
'graphbuild[vgf]'``), which graphbuild enables for the runtime's process. The end-to-end tests
skip, saying what is missing, without Arm's tools or such a device; the environment and its
errors are checked everywhere, on stand-ins for the probe and the layer package.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import graphbuild as gb
from examples import convnet
from graphbuild.errors import StageError, VulkanDeviceError
from graphbuild.targets.executorch import vulkan

APT = "apt-get install mesa-vulkan-drivers libvulkan1"
PIP = "pip install 'graphbuild[vgf]'"
GRAPH, TENSOR = "VK_LAYER_ML_Graph_Emulation", "VK_LAYER_ML_Tensor_Emulation"
ML = ["VK_ARM_data_graph", "VK_ARM_tensors"]


def _vgf_ready(tmp_path: Path) -> None:
    """Skip, with the reason, unless Arm's tools lower and a Vulkan device runs VGF here."""
    pytest.importorskip("executorch.exir", reason="needs the executorch extra")
    from graphbuild.targets.executorch.lowering import _vgf_missing

    missing = _vgf_missing()
    if missing is not None:
        pytest.skip(f"Arm's VGF tools are not usable here ({missing}): {PIP}")
    try:
        vulkan.vgf_environment(tmp_path / "probe")
    except VulkanDeviceError as err:
        pytest.skip(f"no Vulkan device for the VGF delegate: {err}")


def export(model, samples, out: Path, **options) -> gb.ExportArtifacts:
    options.setdefault("check_numerics", True)
    return gb.export(
        model, samples, out, "model", target="executorch", format="vgf", options=options,
        cache=False,
    )  # fmt: skip


def numerics(art: gb.ExportArtifacts) -> dict:
    report = art.report.extra["numerics"]
    assert report["outputs"], f"the numerics check compared no output: {report}"
    return report


# --------------------------------------------------------------------------- end to end


def test_fp32_convnet_runs_on_vulkan_like_torch(tmp_path):
    _vgf_ready(tmp_path)
    model, samples = convnet.build()
    art = export(model, samples, tmp_path / "out", recipe="fp32")
    report = numerics(art)
    assert report["reference"] == "float model"
    assert art.report.extra["delegation"]["delegated_ops"] > 0
    assert min(o["sqnr_db"] for o in report["outputs"]) > 100  # measured ~123 dB on lavapipe


def test_int8_convnet_runs_on_vulkan_like_its_quantized_program(tmp_path):
    _vgf_ready(tmp_path)
    model, samples = convnet.build()
    art = export(
        model,
        samples,
        tmp_path / "out",
        recipe="int8_static",
        calibration=convnet.calibration(),
    )
    report = numerics(art)
    assert report["reference"] == "quantized program"
    for row in report["outputs"]:
        # the delegate reproduces the quantized program (bit-exact on lavapipe: inf dB) ...
        assert row["sqnr_db"] > 60, row
        # ... and quantization costs what int8 costs (measured ~35.5 dB)
        assert row["sqnr_db_vs_float"] > 30, row


def test_the_check_reads_the_emulation_layer_and_the_runtime(monkeypatch):
    pytest.importorskip("executorch", reason="needs the executorch extra")
    from graphbuild.api import ExportRequest
    from graphbuild.targets.executorch import lowering

    monkeypatch.setattr(lowering, "require_format", lambda fmt: None)  # Arm's tools absent
    from graphbuild.targets.executorch.pipeline import build_executorch_pipeline

    model, samples = convnet.build()
    options = {"check_numerics": True}
    request = ExportRequest(model, samples, "out", "m", "executorch", "vgf", options)
    pipeline = build_executorch_pipeline(request)
    reads = {s.name: set(s.reads or ()) for s in pipeline.stages}
    assert {"tool.vulkan-ml-emulation-layer", "tool.executorch-runtime"} <= reads["check_numerics"]
    assert "tool.vulkan-ml-emulation-layer" not in reads["lower"]


def test_without_a_device_the_export_fails_naming_what_to_install(tmp_path, monkeypatch):
    pytest.importorskip("executorch", reason="needs the executorch extra")
    from graphbuild.targets.executorch import lowering

    monkeypatch.setattr(lowering, "require_format", lambda fmt: None)  # Arm's tools absent
    monkeypatch.setattr(lowering, "lower_to_pte", lambda programs, fmt, consts: (b"vgf", {}))
    monkeypatch.setattr(vulkan, "probe_devices", lambda env=None: _no_loader())
    model, samples = convnet.build()
    with pytest.raises(StageError) as raised:
        export(model, samples, tmp_path / "out", recipe="fp32")
    assert raised.value.stage == "check_numerics"
    assert isinstance(raised.value.cause, VulkanDeviceError)
    assert APT in str(raised.value) and PIP in str(raised.value)


# --------------------------------------------------------------------------- the environment


def _no_loader() -> dict:
    return {"loader": False, "devices": [], "error": "libvulkan.so.1: cannot open"}


def _lavapipe(extensions: list[str], create_device: int | None = None) -> dict:
    device = {"name": "llvmpipe (LLVM 15.0.6, 256 bits)", "extensions": extensions}
    if create_device is not None:
        device["create_device"] = create_device
    return {"loader": True, "devices": [device]}


@pytest.fixture
def layer_package(tmp_path, monkeypatch) -> Path:
    """A stand-in for the emulation layer's pip package: its two manifests in one directory,
    naming their libraries by file name, as the wheel has them."""
    deploy = tmp_path / "site" / "emulation_layer" / "deploy"
    manifests = deploy / "share" / "vulkan" / "explicit_layer.d"
    manifests.mkdir(parents=True)
    for layer, file in ((GRAPH, "VkLayer_Graph.json"), (TENSOR, "VkLayer_Tensor.json")):
        library = "lib" + file.replace(".json", ".so")
        body = {"file_format_version": "1.0.0", "layer": {"name": layer, "library_path": library}}
        (manifests / file).write_text(json.dumps(body))
    found = {GRAPH: manifests / "VkLayer_Graph.json", TENSOR: manifests / "VkLayer_Tensor.json"}
    monkeypatch.setattr(vulkan, "emulation_layer_manifests", lambda: found)
    for name in ("VK_LAYER_PATH", "VK_INSTANCE_LAYERS"):
        monkeypatch.delenv(name, raising=False)
    return deploy


def test_no_vulkan_loader_names_the_apt_and_pip_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(vulkan, "probe_devices", lambda env=None: _no_loader())
    with pytest.raises(VulkanDeviceError, match="no Vulkan loader") as raised:
        vulkan.vgf_environment(tmp_path)
    assert APT in str(raised.value) and PIP in str(raised.value)


def test_no_ml_extensions_and_no_emulation_layer_names_the_pip_line(tmp_path, monkeypatch):
    monkeypatch.setattr(vulkan, "probe_devices", lambda env=None: _lavapipe([]))
    monkeypatch.setattr(vulkan, "emulation_layer_manifests", lambda: None)
    with pytest.raises(VulkanDeviceError, match="emulation layer is not installed") as raised:
        vulkan.vgf_environment(tmp_path)
    assert "llvmpipe" in str(raised.value)
    assert APT in str(raised.value) and PIP in str(raised.value)


def test_a_loader_without_a_driver_names_the_apt_line(tmp_path, monkeypatch, layer_package):
    monkeypatch.setattr(vulkan, "probe_devices", lambda env=None: {"loader": True, "devices": []})
    with pytest.raises(VulkanDeviceError, match="finds none") as raised:
        vulkan.vgf_environment(tmp_path)
    assert APT in str(raised.value)


def test_a_device_with_the_extensions_runs_in_the_users_environment(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(
        vulkan, "probe_devices", lambda env=None: seen.append(env) or _lavapipe(ML, 0)
    )
    monkeypatch.delenv("VK_INSTANCE_LAYERS", raising=False)
    env = vulkan.vgf_environment(tmp_path)
    assert env == dict(os.environ) and len(seen) == 1
    assert not list(tmp_path.iterdir())  # no layer written


def test_the_emulation_layer_is_enabled_graph_first_one_directory_per_manifest(
    tmp_path, monkeypatch, layer_package
):
    probed = []

    def probe(env=None):
        probed.append(env)
        return _lavapipe(ML, 0) if env.get("VK_INSTANCE_LAYERS") else _lavapipe([])

    monkeypatch.setattr(vulkan, "probe_devices", probe)
    env = vulkan.vgf_environment(tmp_path / "work")
    assert env["VK_INSTANCE_LAYERS"] == os.pathsep.join([GRAPH, TENSOR])
    dirs = [Path(d) for d in env["VK_LAYER_PATH"].split(os.pathsep)]
    assert len(dirs) == 2 and all(d.parent == tmp_path / "work" for d in dirs)
    manifests = [json.loads(next(d.iterdir()).read_text()) for d in dirs]
    assert [len(list(d.iterdir())) for d in dirs] == [1, 1]
    assert [m["layer"]["name"] for m in manifests] == [GRAPH, TENSOR]
    libraries = [Path(m["layer"]["library_path"]) for m in manifests]
    assert libraries == [
        layer_package / "lib" / "libVkLayer_Graph.so",
        layer_package / "lib" / "libVkLayer_Tensor.so",
    ]
    assert "VK_INSTANCE_LAYERS" not in os.environ  # this process's environment is untouched
    assert probed[-1] == env  # the layered environment was probed before it was returned


def test_an_emulation_layer_that_gives_no_device_is_an_error_with_the_probe(
    tmp_path, monkeypatch, layer_package
):
    # the layers list the extensions but vkCreateDevice fails (the symptom of a wrong order)
    monkeypatch.setattr(
        vulkan,
        "probe_devices",
        lambda env=None: _lavapipe(ML, -8) if env.get("VK_INSTANCE_LAYERS") else _lavapipe([]),
    )
    with pytest.raises(VulkanDeviceError, match="does not give one") as raised:
        vulkan.vgf_environment(tmp_path)
    assert '"create_device": -8' in str(raised.value) and PIP in str(raised.value)


def test_the_probe_reports_this_machines_vulkan_without_crashing():
    """The real probe, in a fresh interpreter: whatever this machine has, a well-formed
    report (no loader, no device, or devices with the ML extensions they offer)."""
    report = vulkan.probe_devices()
    assert isinstance(report["loader"], bool) and isinstance(report["devices"], list)
    for device in report["devices"]:
        assert set(device["extensions"]) <= set(ML) and device["name"]


def test_the_runtime_process_reports_a_program_it_cannot_run(tmp_path, monkeypatch):
    """A .pte that is not one: the runtime's process reports the error, the export gets an
    ExportError with the runtime's words, not a crash."""
    pytest.importorskip("executorch.runtime", reason="needs the executorch extra")
    from graphbuild.errors import ExportError
    from graphbuild.targets.executorch import runtime

    monkeypatch.setattr(vulkan, "vgf_environment", lambda work: dict(os.environ))
    with pytest.raises(ExportError, match="did not run 'forward'"):
        runtime.run_pte_on_vulkan(b"not a program", (torch.zeros(1, 3, 8, 8),))
