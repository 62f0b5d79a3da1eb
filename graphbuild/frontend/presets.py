"""Quantizer presets by name: what ``quantizer = "w8a16"`` means, and how a key covers it.

A preset is a factory of a torchao ``Quantizer``. The built-in presets live in target
modules (the QNN target's ``w8a8``, ``w8a16``, ``w4a16``), which import torchao; they are
imported when a preset is first resolved, never to compute a key. So the registry reading
(``"registry.quantizer_presets"``) is the same whether or not a built-in module was imported
in this process: built-ins count by the source files of their modules, and only entries
that differ from them (a preset a user registered, replaced or removed) count by their code.

This module imports neither torch nor torchao.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUILTIN_PRESET_MODULES",
    "QUANTIZER_PRESETS",
    "BuiltinPresets",
    "load_builtin_presets",
    "preset_entries",
    "register_preset",
]

#: Preset name -> factory of a torchao Quantizer. Targets register their presets here; the
#: front end resolves names without knowing targets.
QUANTIZER_PRESETS: dict[str, Callable[[], Any]] = {}

#: The modules that register graphbuild's own presets when imported (by name: a target sits
#: above the front end, and naming it imports nothing).
BUILTIN_PRESET_MODULES: tuple[str, ...] = ("graphbuild.targets.qnn.preset",)

# name -> the factory a built-in module registered under it
_BUILTIN_FACTORIES: dict[str, Callable[[], Any]] = {}


def register_preset(name: str, factory: Callable[[], Any]) -> None:
    """Make ``name`` usable wherever a quantizer is accepted (config, CLI, API).

    A built-in module never replaces a preset a user registered first: what a name means
    does not depend on when the built-ins were imported."""
    if getattr(factory, "__module__", None) in BUILTIN_PRESET_MODULES:
        _BUILTIN_FACTORIES.setdefault(name, factory)
        if name in QUANTIZER_PRESETS and QUANTIZER_PRESETS[name] is not factory:
            return
    QUANTIZER_PRESETS[name] = factory


def load_builtin_presets() -> None:
    """Import the modules that register the built-in presets (torchao with them)."""
    for module in BUILTIN_PRESET_MODULES:
        importlib.import_module(module)


@dataclass(frozen=True)
class BuiltinPresets:
    """The presets a built-in module registers, as a key sees them: the module and the
    source files it reaches (its code closure)."""

    module: str
    files: dict[str, str]


def preset_entries() -> dict[str, Any]:
    """What ``registry.quantizer_presets`` covers, the same before and after the built-in
    modules are imported: each built-in module by its files, then every preset that is not
    the built-in of its name (registered, replaced, or ``None`` for a removed built-in)."""
    from graphbuild.engine.fingerprint import code_closure

    out: dict[str, Any] = {
        f"builtin:{m}": BuiltinPresets(m, code_closure([m], own=True))
        for m in BUILTIN_PRESET_MODULES
    }
    for name in sorted({*QUANTIZER_PRESETS, *_BUILTIN_FACTORIES}):
        factory = QUANTIZER_PRESETS.get(name)
        if factory is not None and factory is _BUILTIN_FACTORIES.get(name):
            continue
        out[f"preset:{name}"] = factory
    return out
