"""Recipe -> quantizer: ExecuTorch's XNNPACK PT2E quantizer configured as each recipe says."""

from __future__ import annotations

from typing import Any

from graphbuild.targets.executorch.lowering import require_executorch


def recipe_quantizer(recipe: str) -> Any:
    """The torchao PT2E ``Quantizer`` of ``recipe`` (None for ``fp32``)."""
    if recipe == "fp32":
        return None
    require_executorch("the XNNPACK quantizer")
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    dynamic = recipe == "xnnpack_int8_dynamic"
    config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=dynamic)
    return XNNPACKQuantizer().set_global(config)
