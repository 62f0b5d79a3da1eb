"""The ExecuTorch target's options, formats, recipes, and the keys a config file may set."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from graphbuild.errors import ConfigError
from graphbuild.targets.base import BOOL, SPECS, STR, OptionType, check_calibration

#: ``xnnpack``: XNNPACK-delegated program (CPU, Arm and x86); ``portable``: ExecuTorch's
#: portable kernels only (no delegate); ``vgf``: Arm's VGF flow (needs the Arm tools).
FORMATS = ("xnnpack", "portable", "vgf")


@dataclass(frozen=True)
class Recipe:
    """What a recipe does.

    ``scheme``: ``float`` (no quantization); ``pt2e`` (the format's PT2E quantizer on the
    captured program: symmetric int8 weights, per output channel unless ``per_channel`` is
    false, activations calibrated or, ``dynamic``, quantized at run time); ``source`` (torchao's
    ``quantize_`` on the model's ``nn.Linear`` layers, a source transform: ``weight_bits``
    weights per output channel, or in groups of ``group_size`` input channels, with int8
    activations quantized at run time, which XNNPACK runs as its dynamically quantized linear).
    """

    description: str
    scheme: str = "float"
    dynamic: bool = False
    per_channel: bool = True
    weight_bits: int = 8
    group_size: int | None = None


_INT8_STATIC = Recipe(
    "int8 weights per channel and activations per tensor, calibrated, with the format's "
    "quantizer (XNNPACK's, or Arm's for vgf)",
    "pt2e",
)
_INT8_DYNAMIC = Recipe(
    "int8 weights per channel, activations quantized at run time", "pt2e", dynamic=True
)
_INT8DA_INT4W = Recipe(
    "int4 weights in groups of 32 input channels and int8 activations quantized at run time "
    "(torchao quantize_ on nn.Linear, a source transform; XNNPACK's dynamic int4 linear)",
    "source",
    dynamic=True,
    weight_bits=4,
    group_size=32,
)
_INT8DA_INT4W_PER_CHANNEL = Recipe(
    "int4 weights per output channel, int8 activations quantized at run time (torchao "
    "quantize_ on nn.Linear)",
    "source",
    dynamic=True,
    weight_bits=4,
)

#: Recipe name -> what it does. The ``xnnpack_*`` names are ExecuTorch 1.4's own recipe names
#: (``XNNPackRecipeType``) for the same schemes.
RECIPES: dict[str, Recipe] = {
    "fp32": Recipe("float32, no quantization"),
    "int8_static": _INT8_STATIC,
    "int8_dynamic": _INT8_DYNAMIC,
    "int8da_int4w": _INT8DA_INT4W,
    "int8da_int4w_per_channel": _INT8DA_INT4W_PER_CHANNEL,
    "int8da_int8w": Recipe(
        "int8 weights per output channel, int8 activations quantized at run time (torchao "
        "quantize_ on nn.Linear)",
        "source",
        dynamic=True,
    ),
    "xnnpack_int8_static": _INT8_STATIC,
    "xnnpack_int8_dynamic": _INT8_DYNAMIC,
    "xnnpack_fp32": Recipe("float32, no quantization"),
    "xnnpack_pt2e_int8_static_per_channel": _INT8_STATIC,
    "xnnpack_pt2e_int8_static_per_tensor": Recipe(
        "int8 weights and activations per tensor, calibrated", "pt2e", per_channel=False
    ),
    "xnnpack_pt2e_int8_dynamic_per_channel": _INT8_DYNAMIC,
    "xnnpack_torchao_int8da_int4w_per_channel": _INT8DA_INT4W_PER_CHANNEL,
    # ExecuTorch's name; its weights are in groups of 32, as int8da_int4w's
    "xnnpack_torchao_int8da_int4w_per_tensor": _INT8DA_INT4W,
}

#: Names that read like recipes but cannot lower: why, and what to use instead.
NOT_RECIPES: dict[str, str] = {
    name: "weight-only quantization does not lower in ExecuTorch 1.4: XNNPACK runs quantized "
    "linear layers only with int8 activations quantized at run time, and the portable kernels "
    "have no torchao::dequantize_affine; use int8da_int4w (int4 weights in groups of 32) or "
    "int8da_int8w"
    for name in ("int4_weight_only", "int8_weight_only", "int4wo", "int8wo")
}


@dataclass
class ExecuTorchOptions:
    """Options of the ExecuTorch export; each becomes one context key that stages declare.

    ``recipe`` picks the quantization (see ``RECIPES``); ``quantizer`` (a torchao PT2E
    ``Quantizer``) replaces the recipe's, for a custom scheme; ``calibration`` is a list of
    batches of positional inputs for static recipes (the sample inputs when absent).
    ``check_numerics`` runs the ``.pte`` in ExecuTorch's runtime against the torch model.

    A multi-method program: ``methods`` maps the name of another method of the model (say
    ``"encode"``) to its sample inputs; each becomes a method of the ``.pte`` beside
    ``forward`` (calibrated on its own sample inputs under a static recipe).
    ``constant_methods`` maps names to values the program returns as they are (ExecuTorch's
    constant methods, e.g. ``{"max_seq_len": 128}``). ``dynamic_dims`` makes dimensions of
    ``forward``'s inputs dynamic: one entry per positional input, None or ``{dim: [name, min,
    max]}``; dimensions sharing a name are equal. A config file gives all three in
    ``[options]`` (see ``CONFIG_SCHEMA``).
    """

    recipe: str = "fp32"
    quantizer: Any = None
    calibration: Sequence[Any] | None = None
    check_numerics: bool = False
    methods: Mapping[str, Any] | None = None
    constant_methods: Mapping[str, Any] | None = None
    dynamic_dims: Sequence[Mapping[Any, Sequence[Any]] | None] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.quantizer, str):
            raise ConfigError(
                f"the executorch target takes no quantizer preset ('{self.quantizer}'): pick a "
                f"recipe ({', '.join(RECIPES)}) or pass a torchao PT2E Quantizer"
            )
        if self.recipe in NOT_RECIPES:
            raise ConfigError(f"recipe '{self.recipe}': {NOT_RECIPES[self.recipe]}")
        if self.recipe not in RECIPES:
            raise ConfigError(
                f"unknown ExecuTorch recipe '{self.recipe}'; known: {', '.join(RECIPES)}"
            )
        if self.quantizer is not None and self.source_transform:
            raise ConfigError(
                f"recipe '{self.recipe}' quantizes with torchao's quantize_ (a source "
                "transform); a PT2E quantizer replaces a pt2e recipe only: give one of them"
            )
        for key in ("methods", "constant_methods"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(
                    f"{key} must map method names to "
                    + ("sample inputs" if key == "methods" else "values")
                    + f", got {type(value).__name__}"
                )
        for name in (*(self.methods or {}), *(self.constant_methods or {})):
            if not isinstance(name, str) or not name.isidentifier() or name == "forward":
                raise ConfigError(
                    f"method name {name!r} must be a Python identifier other than 'forward'"
                )
        overlap = set(self.methods or {}) & set(self.constant_methods or {})
        if overlap:
            raise ConfigError(f"{sorted(overlap)} named as both a method and a constant method")
        if self.dynamic_dims is not None:
            canonical_dims(self.dynamic_dims)  # raises on a malformed spec
        check_calibration(self.calibration)

    @property
    def quantized(self) -> bool:
        return self.quantizer is not None or RECIPES[self.recipe].scheme != "float"

    @property
    def source_transform(self) -> bool:
        """Whether the recipe quantizes the model with torchao's ``quantize_``."""
        return RECIPES[self.recipe].scheme == "source"

    def to_context(self) -> dict[str, Any]:
        ctx = {f.name: getattr(self, f.name) for f in fields(self)}
        ctx["calibration"] = list(self.calibration) if self.calibration is not None else None
        check_calibration(ctx["calibration"])
        ctx["methods"] = dict(sorted(self.methods.items())) if self.methods else None
        constants = self.constant_methods
        ctx["constant_methods"] = dict(sorted(constants.items())) if constants else None
        dims = self.dynamic_dims
        ctx["dynamic_dims"] = canonical_dims(dims) if dims is not None else None
        return ctx


def canonical_dims(spec: Sequence[Any]) -> list[list[list[Any]] | None]:
    """``dynamic_dims`` as plain, ordered data: per input None or ``[[dim, name, min, max],
    ...]`` sorted by dim (config files give dims as strings; they become integers)."""
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
        raise ConfigError("dynamic_dims must be a list with one entry per positional input")
    out: list[list[list[Any]] | None] = []
    for index, entry in enumerate(spec):
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, Mapping):
            raise ConfigError(f"dynamic_dims[{index}] must be None or {{dim: [name, min, max]}}")
        dims = []
        for dim, bound in entry.items():
            try:
                name, low, high = bound
                dims.append([int(dim), str(name), int(low), int(high)])
            except (TypeError, ValueError):
                raise ConfigError(
                    f"dynamic_dims[{index}][{dim!r}] must be [name, min, max], got {bound!r}"
                ) from None
        out.append(sorted(dims) or None)
    return out


def _constant(value: Any) -> bool:
    """A value ExecuTorch can return from a constant method: a boolean, number or string, or
    a list or table of them (what TOML gives, less its dates and times)."""
    if isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_constant(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _constant(v) for k, v in value.items())
    return False


#: What a config file's ``[options]`` table (and ``--set``) may set for the executorch target.
#: ``methods`` is a spec of a factory returning ``{method: sample inputs}``, or a table of
#: ``method = "file.py:fn"`` specs of each method's sample inputs (imported like ``model``);
#: ``constant_methods`` a table of the values themselves.
CONFIG_SCHEMA: dict[str, OptionType] = {
    "recipe": STR,
    "check_numerics": BOOL,
    "dynamic_dims": OptionType(
        "a list with one entry per input: {} or {dim = [name, min, max]}",
        lambda v: isinstance(v, list) and all(isinstance(e, dict) for e in v),
    ),
    "methods": replace(
        SPECS,
        label="a 'file.py:fn' spec returning {method: sample inputs}, or a table of "
        "method = 'file.py:fn' specs of each method's sample inputs",
    ),
    "constant_methods": OptionType(
        "a table of method = value (booleans, numbers, strings, lists and tables of them)",
        lambda v: isinstance(v, dict) and _constant(v),
    ),
}
