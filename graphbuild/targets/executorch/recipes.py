"""Recipe -> quantizer: the format's own PT2E quantizer configured as the recipe says.

``xnnpack`` and ``portable`` use ExecuTorch's XNNPACK quantizer; ``vgf`` uses Arm's VGF
quantizer (what Arm's export script does), whose int8 grid the VGF partitioner accepts.
"""

from __future__ import annotations

from typing import Any

from graphbuild.targets.executorch.lowering import require_format


def recipe_quantizer(recipe: str, fmt: str) -> Any:
    """The torchao PT2E ``Quantizer`` of ``recipe`` for format ``fmt`` (None for ``fp32``)."""
    if recipe == "fp32":
        return None
    require_format(fmt)
    dynamic = recipe.endswith("int8_dynamic")
    if fmt == "vgf":
        from executorch.backends.arm.quantizer.arm_quantizer import (
            VgfQuantizer,
            get_symmetric_quantization_config,
        )
        from executorch.backends.arm.vgf.compile_spec import VgfCompileSpec

        config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=dynamic)
        return VgfQuantizer(VgfCompileSpec()).set_global(config)
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=dynamic)
    return XNNPACKQuantizer().set_global(config)
