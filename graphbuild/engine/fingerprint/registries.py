"""Registries that stages consult, as reads: ``registry.<name>`` keys on every entry's code."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from graphbuild.engine.fingerprint.code import code_identity
from graphbuild.engine.fingerprint.readings import Reading
from graphbuild.errors import FingerprintError
from graphbuild.hashing import digest_json

#: Registries that stages consult, by name: a stage that declares ``"registry.<name>"`` keys
#: on the code and configuration of every entry (docs/design.md, invariant 9).
_REGISTRIES: dict[str, Callable[[], Iterable[Any]]] = {}


def register_registry(name: str, entries: Callable[[], Iterable[Any]]) -> None:
    """Make ``"registry.<name>"`` a read: ``entries()`` returns the registered objects (or a
    mapping of names to them) at the time a key is computed."""
    _REGISTRIES[name] = entries


def read_registry(name: str) -> Reading:
    entries = _REGISTRIES.get(name)
    if entries is None:
        known = ", ".join(sorted(_REGISTRIES)) or "none"
        return Reading(None, reason=f"registry.{name}: no such registry (known: {known})")
    try:
        current = entries()
        if isinstance(current, Mapping):
            form: Any = {"entries": [[k, code_identity(v)] for k, v in sorted(current.items())]}
        else:
            form = [code_identity(v) for v in current]
    except FingerprintError as err:
        return Reading(None, reason=f"registry.{name}: {err}")
    digest = digest_json(form)
    size = len(form["entries"]) if isinstance(form, dict) else len(form)
    return Reading(digest, f"{size} entries <{digest[:12]}>")
