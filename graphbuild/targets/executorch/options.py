"""The ExecuTorch target's options, formats, recipes, and the keys a config file may set."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from graphbuild.errors import ConfigError
from graphbuild.targets.base import BOOL, STR, OptionType

#: ``xnnpack``: XNNPACK-delegated program (CPU, Arm and x86); ``portable``: ExecuTorch's
#: portable kernels only (no delegate); ``vgf``: Arm's VGF flow (needs the Arm tools).
FORMATS = ("xnnpack", "portable", "vgf")

#: Recipe name -> what it does. ``fp32`` lowers the float model; the others quantize it first
#: with the format's PT2E quantizer (symmetric int8 weights, per output channel).
RECIPES: dict[str, str] = {
    "fp32": "float32, no quantization",
    "int8_static": "int8 weights per channel and activations per tensor, calibrated, with the "
    "format's quantizer (XNNPACK's, or Arm's for vgf)",
    "int8_dynamic": "int8 weights per channel, activations quantized at run time",
    "xnnpack_int8_static": "int8_static, as ExecuTorch's XNNPACK recipe names it",
    "xnnpack_int8_dynamic": "int8_dynamic, as ExecuTorch's XNNPACK recipe names it",
}


@dataclass
class ExecuTorchOptions:
    """Options of the ExecuTorch export; each becomes one context key that stages declare.

    ``recipe`` picks the quantization (see ``RECIPES``); ``quantizer`` (a torchao PT2E
    ``Quantizer``) replaces the recipe's, for a custom scheme; ``calibration`` is a list of
    batches of positional inputs for static recipes (the sample inputs when absent).
    ``check_numerics`` runs the ``.pte`` in ExecuTorch's runtime against the torch model.
    """

    recipe: str = "fp32"
    quantizer: Any = None
    calibration: Sequence[Any] | None = None
    check_numerics: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.quantizer, str):
            raise ConfigError(
                f"the executorch target takes no quantizer preset ('{self.quantizer}'): pick a "
                f"recipe ({', '.join(RECIPES)}) or pass a torchao PT2E Quantizer"
            )
        if self.recipe not in RECIPES:
            raise ConfigError(
                f"unknown ExecuTorch recipe '{self.recipe}'; known: {', '.join(RECIPES)}"
            )

    @property
    def quantized(self) -> bool:
        return self.quantizer is not None or self.recipe != "fp32"

    def to_context(self) -> dict[str, Any]:
        ctx = {f.name: getattr(self, f.name) for f in fields(self)}
        ctx["calibration"] = list(self.calibration) if self.calibration is not None else None
        return ctx


#: What a config file's ``[options]`` table (and ``--set``) may set for the executorch target.
CONFIG_SCHEMA: dict[str, OptionType] = {"recipe": STR, "check_numerics": BOOL}
