"""Targets by name, and pipelines by (target, format).

``register_target`` makes a ``Target`` known to config, CLI and API; the built-in targets are
imported on first use, so naming one never costs another's import. ``PipelineRegistry`` maps
``(target, format)`` to a pipeline factory: every registered target's formats by default, plus
whatever custom pipelines a caller registers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from graphbuild.errors import ConfigError, ExportError
from graphbuild.targets.base import Request, Target

if TYPE_CHECKING:
    from graphbuild.engine.pipeline import Pipeline

__all__ = [
    "DEFAULT_TARGET",
    "PipelineFactory",
    "PipelineRegistry",
    "build_default_registry",
    "find_target",
    "get_target",
    "register_target",
    "target_names",
]

PipelineFactory = Callable[[Request], "Pipeline"]

#: The target an export uses when none is named.
DEFAULT_TARGET = "qnn"

#: Built-in targets: name -> the module whose ``TARGET`` declares it.
_BUILTIN = {
    "qnn": "graphbuild.targets.qnn",
    "executorch": "graphbuild.targets.executorch",
    "gguf": "graphbuild.targets.gguf",
}
_TARGETS: dict[str, Target] = {}


def register_target(target: Target, *, replace: bool = False) -> None:
    """Make ``target`` known by its name (``replace=True`` to override a registered one)."""
    if target.name in _TARGETS and not replace:
        raise ConfigError(
            f"a target named '{target.name}' is already registered; pass replace=True to "
            "override it"
        )
    _TARGETS[target.name] = target


def find_target(name: str) -> Target | None:
    """The target registered as ``name`` (a built-in is imported here), or None."""
    if name not in _TARGETS and name in _BUILTIN:
        module = importlib.import_module(_BUILTIN[name])
        _TARGETS.setdefault(name, module.TARGET)
    return _TARGETS.get(name)


def get_target(name: str) -> Target:
    """The target registered as ``name``; a ConfigError listing the known ones otherwise."""
    target = find_target(name)
    if target is None:
        raise ConfigError(f"unknown target '{name}'; known: {', '.join(target_names())}")
    return target


def target_names() -> list[str]:
    return sorted({*_BUILTIN, *_TARGETS})


def all_targets() -> list[Target]:
    return [get_target(name) for name in target_names()]


class PipelineRegistry:
    """Maps ``(target, format)`` to a factory building the export pipeline for a request."""

    def __init__(self) -> None:
        self._factories: dict[tuple[str, str], PipelineFactory] = {}

    def register(
        self, target: str, format: str, factory: PipelineFactory, *, replace: bool = False
    ) -> None:
        key = (target, format)
        if key in self._factories and not replace:
            raise ExportError(
                f"a pipeline for target '{target}', format '{format}' is already registered; "
                "pass replace=True to override it"
            )
        self._factories[key] = factory

    def get(self, target: str, format: str) -> PipelineFactory:
        try:
            return self._factories[(target, format)]
        except KeyError:
            pairs = [(t, f) for t, f in self.keys() if t == target] or self.keys()
            known = ", ".join(f"{t}/{f}" for t, f in pairs) or "none"
            raise ExportError(
                f"no pipeline for target '{target}', format '{format}'; known: {known}"
            ) from None

    def keys(self) -> list[tuple[str, str]]:
        return sorted(self._factories)

    def __contains__(self, key: object) -> bool:
        return key in self._factories


def build_default_registry() -> PipelineRegistry:
    """A registry with every registered target's formats (``qnn/onnx``, ``executorch/xnnpack``,
    ...)."""
    registry = PipelineRegistry()
    for target in all_targets():
        for fmt in target.formats:
            registry.register(target.name, fmt, _factory(target, fmt))
    return registry


def _factory(target: Target, fmt: str) -> PipelineFactory:
    def build(request: Request) -> Pipeline:
        return target.build_pipeline(request, fmt)

    build.__qualname__ = f"{target.name}/{fmt}"
    return build
