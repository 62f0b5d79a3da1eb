"""What ExecuTorch's stages run outside Python's imports, as tools their keys cover
(``engine.toolchain``): Arm's VGF flow serialises TOSA with the TOSA serializer's native code
and compiles it with the ML SDK model converter, a separate program; the numerics check runs
the ``.pte`` in ExecuTorch's native runtime library (for VGF on Arm's ML emulation layer for
Vulkan, where no device has the ML extensions natively). A new converter (0.11 to 0.9) or
runtime build reruns the stages that call it, and the lock file lists each one."""

from __future__ import annotations

from graphbuild.engine.toolchain import Tool, register_tool

__all__ = ["EMULATION_LAYER", "RUNTIME", "VGF_TOOLS"]

#: Arm's ML SDK model converter, found as ExecuTorch finds it
MODEL_CONVERTER = register_tool(
    Tool.executable(
        "model-converter",
        "model-converter",
        "model_converter",
        env="MODEL_CONVERTER_PATH",
        version_args=("--version",),
    )
)
#: the TOSA serializer ExecuTorch's Arm backend writes the TOSA flatbuffer with
TOSA_SERIALIZER = register_tool(
    Tool.package_files("tosa-serializer", "tosa_serializer", "**/*.py", "**/*.so", "**/*.pyd")
)
#: what the ``vgf`` format's lowering calls
VGF_TOOLS = (TOSA_SERIALIZER, MODEL_CONVERTER)

#: ExecuTorch's native runtime (its Python bindings' shared library), which runs a ``.pte``
RUNTIME = register_tool(
    Tool.package_files(
        "executorch-runtime",
        "executorch",
        "extension/pybindings/_portable_lib*",
        distribution="executorch",
    )
)

#: Arm's ML emulation layer for Vulkan, the VGF check's tensor and data graph extensions
EMULATION_LAYER = register_tool(
    Tool.package_files(
        "vulkan-ml-emulation-layer",
        "emulation_layer",
        "deploy/lib/*.so*",
        "deploy/lib/*.dylib",
        "deploy/bin/*.dll",
        "deploy/share/vulkan/explicit_layer.d/*.json",
        distribution="ai-ml-emulation-layer-for-vulkan",
    )
)
