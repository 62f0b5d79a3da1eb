"""A Vulkan device for the VGF delegate of ExecuTorch: the environment its runtime runs in.

ExecuTorch's VGF backend runs a delegate on a Vulkan device with Arm's ML extensions
(``VK_ARM_tensors``, ``VK_ARM_data_graph``). Few drivers offer them; Arm's ML emulation layer
for Vulkan (the ``ai-ml-emulation-layer-for-vulkan`` pip package) adds them to any Vulkan
1.3 device, Mesa's CPU driver lavapipe included. :func:`vgf_environment` looks at the devices
this machine offers (in a fresh process: :mod:`.vulkan_probe`) and, when none has the
extensions, enables the emulation layer for the runtime's process only: one directory per
layer manifest, each naming its library by absolute path, the Graph layer before the Tensor
layer (a loader that orders layers by discovery puts the Tensor layer above the Graph layer
otherwise, and ``vkCreateDevice`` fails). The user sets no Vulkan variable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphbuild.errors import VulkanDeviceError

__all__ = ["INSTALL_HINT", "emulation_layer_manifests", "probe_devices", "vgf_environment"]

#: what gives a machine without an ML-capable GPU a device for the VGF delegate
INSTALL_HINT = (
    "install a Vulkan loader and Mesa's CPU driver (apt-get install mesa-vulkan-drivers "
    "libvulkan1) and Arm's ML emulation layer at the version ExecuTorch pins "
    "(pip install 'graphbuild[vgf]', which gives ai-ml-emulation-layer-for-vulkan==0.9.0)"
)

#: the emulation layers, in the order they must be enabled (the Graph layer first)
_LAYERS = (
    ("VK_LAYER_ML_Graph_Emulation", "VkLayer_Graph.json"),
    ("VK_LAYER_ML_Tensor_Emulation", "VkLayer_Tensor.json"),
)
_PACKAGE = "emulation_layer"
_PROBE = Path(__file__).with_name("vulkan_probe.py")
_ML = ("VK_ARM_tensors", "VK_ARM_data_graph")


def probe_devices(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What :mod:`.vulkan_probe` reports in a fresh interpreter run with ``env`` (this
    process's environment when None): ``loader``, ``devices`` (name, ML extensions,
    ``create_device``: vkCreateDevice's result with them enabled) and any ``error``."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.read_text()],
        env=dict(os.environ if env is None else env),
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-10:])
        return {"loader": True, "devices": [], "error": f"probe died ({proc.returncode}): {tail}"}
    return json.loads(lines[-1])


def emulation_layer_manifests() -> dict[str, Path] | None:
    """The installed emulation layer's manifests, by layer name in enabling order, or None
    when the pip package is not installed (found without importing it)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    deploy = Path(next(iter(spec.submodule_search_locations))) / "deploy"
    manifests = {
        layer: deploy / "share" / "vulkan" / "explicit_layer.d" / file for layer, file in _LAYERS
    }
    if not all(path.is_file() for path in manifests.values()):
        return None
    return manifests


def vgf_environment(work: Path) -> dict[str, str]:
    """The environment ExecuTorch's runtime runs a VGF delegate in: this process's when one
    of its Vulkan devices has the ML extensions; else this one with the emulation layer
    enabled (its manifests rewritten under ``work``, which must outlive the runtime's process).
    Raises :class:`VulkanDeviceError` saying what to install when neither gives a device."""
    env = dict(os.environ)
    native = probe_devices(env)
    if not native.get("loader"):
        raise VulkanDeviceError(
            f"the VGF delegate needs a Vulkan device, and no Vulkan loader loads here "
            f"({native.get('error')}): {INSTALL_HINT}"
        )
    if _usable(native):
        return env
    names = ", ".join(d["name"] for d in native["devices"]) or "none"
    manifests = emulation_layer_manifests()
    if manifests is None:
        raise VulkanDeviceError(
            f"the VGF delegate needs a Vulkan device with {' and '.join(_ML)}; the devices "
            f"here ({names}) lack them and Arm's ML emulation layer is not installed: "
            f"{INSTALL_HINT}"
        )
    if not native["devices"]:
        raise VulkanDeviceError(
            f"the VGF delegate needs a Vulkan device, and the Vulkan loader finds none "
            f"({native.get('error') or 'no driver'}): {INSTALL_HINT}"
        )
    layered = _with_layers(env, manifests, work)
    emulated = probe_devices(layered)
    if not _usable(emulated):
        raise VulkanDeviceError(
            f"the VGF delegate needs a Vulkan device with {' and '.join(_ML)}, and Arm's ML "
            f"emulation layer ({manifests[_LAYERS[0][0]].parents[3]}) does not give one to "
            f"the devices here ({names}): {json.dumps(emulated)}; {INSTALL_HINT}"
        )
    return layered


def _usable(report: Mapping[str, Any]) -> bool:
    return any(
        len(d.get("extensions", ())) == len(_ML) and d.get("create_device") == 0
        for d in report.get("devices", ())
    )


def _with_layers(env: Mapping[str, str], manifests: Mapping[str, Path], work: Path) -> dict:
    """``env`` with the emulation layers enabled: each manifest copied into a directory of
    its own under ``work`` with its library's absolute path, the directories on
    ``VK_LAYER_PATH`` and the layers on ``VK_INSTANCE_LAYERS`` in ``_LAYERS``' order."""
    dirs = []
    for index, source in enumerate(manifests.values()):
        manifest = json.loads(source.read_text())
        library = source.parents[3] / "lib" / Path(manifest["layer"]["library_path"]).name
        manifest["layer"]["library_path"] = str(library)
        folder = work / f"vulkan-layer-{index}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / source.name).write_text(json.dumps(manifest, indent=1))
        dirs.append(str(folder))
    out = dict(env)
    out["VK_LAYER_PATH"] = os.pathsep.join([*dirs, *filter(None, [env.get("VK_LAYER_PATH")])])
    layers = [*manifests, *filter(None, [env.get("VK_INSTANCE_LAYERS")])]
    out["VK_INSTANCE_LAYERS"] = os.pathsep.join(layers)
    return out
