"""The target seam: what a target declares so that config, CLI and API need no target names.

A target (``qnn``, ``executorch``, or one a user registers) is a ``Target`` value: its name,
formats, options dataclass, the ``[options]`` keys a config file may set and their types, the
quantizer preset names it knows, and the function that builds its pipeline. ``config``
validates ``[options]`` against ``config_schema``, ``ExportRequest`` turns whatever options it
is given into ``options_type`` with ``make_options``, and ``graphbuild targets`` lists them.

Declaring a target must stay cheap: a warm export imports the target's package to read this
declaration, so heavy libraries (torchao, executorch) are imported by its stages, not here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Protocol

from graphbuild.errors import ConfigError

if TYPE_CHECKING:
    from graphbuild.engine.pipeline import Pipeline

__all__ = [
    "BOOL",
    "INT",
    "ExportFlag",
    "STR",
    "SPECS",
    "STRS",
    "OptionType",
    "PipelineBuilder",
    "Request",
    "Target",
    "coerce_options",
    "lazy_builder",
]


@dataclass(frozen=True)
class OptionType:
    """The type a config value must have: a check, and how to say it in an error message.

    ``imports``: the value names Python objects, as ``model`` does (``"file.py:name"`` or
    ``"package.module:name"``), either one spec or a table of them; the config imports each
    (calling it when it is a factory) and the option receives the result, or the table of
    results."""

    label: str
    check: Callable[[Any], bool]
    imports: bool = False

    def accepts(self, value: Any) -> bool:
        return bool(self.check(value))


STR = OptionType("a string", lambda v: isinstance(v, str))
INT = OptionType("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
BOOL = OptionType("true or false", lambda v: isinstance(v, bool))
FLOAT = OptionType("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
STRS = OptionType(
    "a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)
)
SPECS = OptionType(
    "a 'file.py:name' spec, or a table of them",
    lambda v: (
        isinstance(v, str) or (isinstance(v, dict) and all(isinstance(x, str) for x in v.values()))
    ),
    imports=True,
)


@dataclass(frozen=True)
class ExportFlag:
    """A switch a target adds to ``graphbuild export``: ``--<name>`` turns on the boolean
    option ``option``, as ``--set options.<option>=true`` would. The command line takes its
    flags from the targets, so it names none of them; ``help`` is what ``--help`` says."""

    name: str
    option: str
    help: str


class Request(Protocol):
    """What a pipeline builder reads of an export request (``graphbuild.api.ExportRequest``)."""

    target: str
    format: str
    model_name: str
    options: Any


#: Builds the pipeline for an export request and a format.
PipelineBuilder = Callable[[Request, str], "Pipeline"]


def lazy_builder(module: str, function: str) -> PipelineBuilder:
    """A pipeline builder that imports ``module`` when first called, so that declaring a
    target costs no import of its stages (torch, torchao, a back end)."""

    def build(request: Request, fmt: str | None = None, **options: Any) -> Pipeline:
        return getattr(importlib.import_module(module), function)(request, fmt, **options)

    build.__name__ = build.__qualname__ = function
    build.__doc__ = f"``{module}.{function}``, imported on first use."
    return build


def check_calibration(calibration: Any) -> None:
    """An empty calibration set is a mistake (an exhausted generator, a filter that kept
    nothing), refused rather than quietly calibrating on the sample inputs instead."""
    if calibration is None or isinstance(calibration, (str, bytes)):
        return
    if hasattr(calibration, "__len__") and len(calibration) == 0:
        raise ConfigError(
            "calibration is empty: give at least one batch, or leave it unset (None) to "
            "calibrate on the sample inputs"
        )


def coerce_options(options_type: type, options: Any, target: str) -> Any:
    """``options`` as ``options_type``: None gives the defaults, a mapping gives keyword
    arguments, an instance is taken as it is; anything else is a ConfigError naming the target
    and the keys it knows."""
    if options is None:
        return options_type()
    if isinstance(options, options_type):
        return options
    names = [f.name for f in fields(options_type)]
    if isinstance(options, Mapping):
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(unknown)} for target '{target}'; known: "
                f"{', '.join(names)}"
            )
        return options_type(**options)
    raise ConfigError(
        f"options for target '{target}' must be {options_type.__name__} or a dict, "
        f"not {type(options).__name__}"
    )


@dataclass(frozen=True)
class Target:
    """One export target, as config, CLI, API and ``graphbuild targets`` see it.

    ``options_type`` is a dataclass with a ``to_context()`` method returning the stage context
    (one key per option, which stages declare as ``ctx.<name>`` reads). ``config_schema`` names
    the keys a config file's ``[options]`` table may set for this target. ``presets`` are the
    quantizer preset names the target registers, known without importing its quantizers.

    ``top_level_options`` are schema keys a config file may also set at its top level, beside
    ``model`` (executorch: ``recipe``), so that one file serves several targets: a target that
    does not declare such a key ignores it. ``quantization_option`` names the option that picks
    this target's quantization in place of a ``[quantization]`` preset; when it is set, a
    preset meant for another target is ignored rather than refused.

    ``export_flags`` are the switches the target adds to ``graphbuild export`` (qnn:
    ``--check-htp``); ``numerics_option`` names the boolean option that turns on its numerics
    check, which a sweep turns on to compare its variants (None: the target has none).
    """

    name: str
    description: str
    formats: tuple[str, ...]
    options_type: type
    build_pipeline: PipelineBuilder
    config_schema: Mapping[str, OptionType] = field(default_factory=dict)
    presets: tuple[str, ...] = ()
    top_level_options: tuple[str, ...] = ()
    quantization_option: str | None = None
    export_flags: tuple[ExportFlag, ...] = ()
    numerics_option: str | None = None

    def __post_init__(self) -> None:
        if not self.formats:
            raise ConfigError(f"target '{self.name}' declares no formats")
        if not is_dataclass(self.options_type):
            raise ConfigError(f"target '{self.name}': options_type must be a dataclass")
        names = self.option_names()
        for key in (*self.top_level_options, *filter(None, [self.quantization_option])):
            if key not in self.config_schema or key not in names:
                raise ConfigError(
                    f"target '{self.name}': '{key}' must be an option in its config_schema"
                )
        switches = [f.option for f in self.export_flags]
        for key in (*switches, *filter(None, [self.numerics_option])):
            if self.config_schema.get(key) is not BOOL or key not in names:
                raise ConfigError(
                    f"target '{self.name}': '{key}' must be a true/false option in its "
                    "config_schema"
                )

    @property
    def default_format(self) -> str:
        return self.formats[0]

    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.options_type))

    def make_options(self, options: Any) -> Any:
        """``options`` (None, a mapping or an instance) as this target's options dataclass."""
        return coerce_options(self.options_type, options, self.name)

    def check_format(self, fmt: str) -> None:
        """A ConfigError naming the known formats when ``fmt`` is not one of them."""
        if fmt not in self.formats:
            raise ConfigError(
                f"unknown format '{fmt}' for target {self.name}; known: {', '.join(self.formats)}"
            )
