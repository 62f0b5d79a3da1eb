"""Quantizer presets by name: what ``quantizer = "w8a16"`` means, and how a key covers it.

A preset is a factory of a torchao ``Quantizer``. graphbuild's own presets are registered
by the target modules that define them (the QNN target's ``w8a8``, ``w8a16``, ``w4a16``, when
its quantize stage first runs); their code is part of that stage's code closure. So the
registry reading (``"registry.quantizer_presets"``) leaves them out, and is the same whether
or not a built-in module was imported in this process: it covers, by their code, the
presets that are not graphbuild's own of that name (a preset a user registered, a built-in
a user replaced or removed).

This module imports neither torch nor torchao.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["QUANTIZER_PRESETS", "preset_entries", "register_preset"]

#: Preset name -> factory of a torchao Quantizer. Targets register their presets here; the
#: front end resolves names without knowing targets.
QUANTIZER_PRESETS: dict[str, Callable[[], Any]] = {}

# name -> the factory graphbuild itself registered under it
_BUILTIN_FACTORIES: dict[str, Callable[[], Any]] = {}


def _is_builtin(factory: Callable[[], Any]) -> bool:
    module = getattr(factory, "__module__", None) or ""
    return module == "graphbuild" or module.startswith("graphbuild.")


def register_preset(name: str, factory: Callable[[], Any]) -> None:
    """Make ``name`` usable wherever a quantizer is accepted (config, CLI, API).

    A built-in never replaces a preset a user registered first: what a name means does not
    depend on when graphbuild's own presets were imported."""
    if _is_builtin(factory) and name not in _BUILTIN_FACTORIES:
        _BUILTIN_FACTORIES[name] = factory
        if name in QUANTIZER_PRESETS:
            return
    QUANTIZER_PRESETS[name] = factory


def preset_entries() -> dict[str, Any]:
    """What ``registry.quantizer_presets`` covers, the same before and after graphbuild's
    own presets are imported: every preset that is not graphbuild's own of its name
    (registered, replaced, or ``None`` for a removed built-in)."""
    out: dict[str, Any] = {}
    for name in sorted({*QUANTIZER_PRESETS, *_BUILTIN_FACTORIES}):
        factory = QUANTIZER_PRESETS.get(name)
        if factory is not None and factory is _BUILTIN_FACTORIES.get(name):
            continue
        out[name] = factory
    return out
