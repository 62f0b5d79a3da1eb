"""Recipe -> quantization: the format's own PT2E quantizer, or torchao's ``quantize_``.

``xnnpack`` and ``portable`` use ExecuTorch's XNNPACK quantizer; ``vgf`` uses Arm's VGF
quantizer (what Arm's export script does), whose int8 grid the VGF partitioner accepts. The
``source`` recipes are torchao configs applied to the model's linear layers, as ExecuTorch's
own ``xnnpack_torchao_*`` recipes apply them (``Int8DynamicActivationIntxWeightConfig``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphbuild.errors import ConfigError
from graphbuild.targets.executorch.lowering import require_format
from graphbuild.targets.executorch.options import RECIPES


def recipe_quantizer(recipe: str, fmt: str) -> Any:
    """The torchao PT2E ``Quantizer`` of ``recipe`` for format ``fmt`` (None for ``fp32``)."""
    spec = RECIPES[recipe]
    if spec.scheme == "float":
        return None
    if spec.scheme != "pt2e":
        raise ConfigError(f"recipe '{recipe}' is not a PT2E recipe")
    require_format(fmt)
    if fmt == "vgf":
        from executorch.backends.arm.quantizer.arm_quantizer import (
            VgfQuantizer,
            get_symmetric_quantization_config,
        )
        from executorch.backends.arm.vgf.compile_spec import VgfCompileSpec

        config = get_symmetric_quantization_config(
            is_per_channel=spec.per_channel, is_dynamic=spec.dynamic
        )
        return VgfQuantizer(VgfCompileSpec()).set_global(config)
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    config = get_symmetric_quantization_config(
        is_per_channel=spec.per_channel, is_dynamic=spec.dynamic
    )
    return XNNPACKQuantizer().set_global(config)


def apply_source_transform(model: torch.nn.Module, recipe: str) -> None:
    """Quantize ``model``'s linear layers in place with the torchao config of ``recipe`` and
    unwrap torchao's tensor subclasses into plain parameters (``torch.export`` and ExecuTorch
    take those). A linear layer XNNPACK could not run quantized stays float (the delegation
    report shows it): under 4-bit weights, one whose input channels are not a multiple of the
    group size, or per channel of 32 (XNNPACK's 4-bit linear works in groups of 32)."""
    from torchao.quantization import quantize_
    from torchao.utils import unwrap_tensor_subclass

    config, keep = _source_config(recipe)
    quantize_(model, config, keep)
    unwrap_tensor_subclass(model)


#: XNNPACK delegates a 4-bit linear only when its group (per channel: all input channels)
#: is a multiple of 32.
_XNNPACK_INT4_GROUP = 32


def _source_config(recipe: str) -> tuple[Any, Callable[[torch.nn.Module, str], bool]]:
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig

    spec = RECIPES[recipe]
    if spec.scheme != "source":
        raise ConfigError(f"recipe '{recipe}' is not a torchao source transform")
    group = spec.group_size
    divisor = group or (_XNNPACK_INT4_GROUP if spec.weight_bits == 4 else None)
    config = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4 if spec.weight_bits == 4 else torch.int8,
        weight_granularity=PerGroup(group) if group else PerAxis(0),
    )

    def keep(module: torch.nn.Module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and (
            divisor is None or module.in_features % divisor == 0
        )

    return config, keep
