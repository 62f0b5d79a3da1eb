"""The fingerprint walk: ``fingerprint(value)`` and the type dispatch it runs.

``fingerprint(value)`` turns a value into a canonical JSON-able form, one registration per
type (``functools.singledispatch``, as Hamilton's fingerprinting registers one type a
function): the registrations are in ``values``, ``callables``, ``torch_values`` and
``numpy_values``. A value of an unregistered type is walked as a dataclass, a class, a
function, or an object's attributes; anything else raises :class:`FingerprintError` naming the
value's path. The walk keeps the path, guards cycles and bounds the depth.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from graphbuild.errors import FingerprintError
from graphbuild.hashing import digest_json

_MAX_DEPTH = 12


class _Tree(threading.local):
    """The model whose structure is being fingerprinted on this thread: (tensor id ->
    state name, module id -> submodule name, True), empty outside a structure fingerprint."""

    def __init__(self) -> None:
        self.current: tuple[Mapping[int, str], Mapping[int, str], bool] = ({}, {}, False)


_TREE = _Tree()


class _Walk:
    """State of one recursive fingerprint: cycle guard and the path for error messages."""

    def __init__(
        self,
        state_names: Mapping[int, str] | None = None,
        module_names: Mapping[int, str] | None = None,
        model: bool = False,
    ) -> None:
        self.active: set[int] = set()
        self.path: list[str] = []
        # Within a structure fingerprint (and every fingerprint it starts: a closure's cells,
        # a partial's arguments), the model's own tensors and submodules, by id:
        # - a parameter or buffer an attribute holds (nn.LSTM's _flat_weights) is structure
        #   by name, its values are the state facet's;
        # - a submodule an attribute reaches (a traced GraphModule's owner, a bound method's
        #   object, a lambda's cell) is named by its place in the tree, whose structure and
        #   weights are fingerprinted where the tree holds it.
        # - where its tensors live is not structure (see torch.device).
        tree = _TREE.current
        self.state_names: Mapping[int, str] = state_names or tree[0]
        self.module_names: Mapping[int, str] = module_names or tree[1]
        self.model = model or tree[2]

    def child(self, label: str, value: Any) -> Any:
        if len(self.path) > _MAX_DEPTH:
            # what lies deeper would be ignored: uncacheable, never a stale hit
            raise FingerprintError(
                f"cannot fingerprint {'.'.join(self.path)}.{label}: nested more than "
                f"{_MAX_DEPTH} levels deep"
            )
        if id(value) in self.active:
            return {"cycle": type(value).__qualname__}
        self.path.append(label)
        keep = not isinstance(value, (str, int, float, bool, type(None)))
        if keep:
            self.active.add(id(value))
        try:
            return _fp(value, self)
        finally:
            if keep:
                self.active.discard(id(value))
            self.path.pop()


def fingerprint(value: Any) -> Any:
    """Canonical JSON-able form of ``value``: equal forms mean equal values for graphbuild.

    Register a type with ``@fingerprint_type.register(MyType)`` taking ``(value, walk)``.
    """
    return _Walk().child("value", value)


@functools.singledispatch
def fingerprint_type(value: Any, walk: _Walk) -> Any:
    cls = type(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "dataclass": _qualname(cls),
            "fields": {
                f.name: walk.child(f.name, getattr(value, f.name))
                for f in dataclasses.fields(value)
            },
        }
    from graphbuild.engine.fingerprint.code import callable_version, code_fingerprint

    if isinstance(value, type):
        return {"class": _qualname(value), "code": code_fingerprint([value])}
    if callable(value) and hasattr(value, "__code__"):
        return {"function": callable_version(value)}
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):
        skip = volatile_attributes(cls)
        return {
            "object": _qualname(cls),
            "code": code_fingerprint([cls]),
            "attrs": {k: walk.child(k, v) for k, v in sorted(state.items()) if k not in skip},
        }
    slots = _slot_values(value)
    if slots is not None:
        return {"object": _qualname(cls), "attrs": {k: walk.child(k, v) for k, v in slots}}
    raise FingerprintError(
        f"cannot fingerprint {'.'.join(walk.path)} of type {_qualname(cls)}; register it with "
        f"@graphbuild.engine.fingerprint.fingerprint_type.register({cls.__name__})"
    )


def _fp(value: Any, walk: _Walk) -> Any:
    fn = fingerprint_type.dispatch(type(value))
    if fn in _BUILTIN_FINGERPRINTS:
        return fn(value, walk)
    # a fingerprint function registered by a user: its code is part of what it computes
    return {"registered": _registered_version(fn), "value": fn(value, walk)}


def _registered_version(fn: Callable) -> str:
    from graphbuild.engine.fingerprint.code import code_identity

    return digest_json(code_identity(fn))


# the fingerprint functions graphbuild registers itself; any other registration carries its code
_BUILTIN_FINGERPRINTS: frozenset[Callable] = frozenset()


def mark_builtin_fingerprints() -> None:
    """Take every registration made so far as graphbuild's own (the package does this once
    its type modules are loaded): those are covered by the engine's code, a user's
    registration by its own."""
    global _BUILTIN_FINGERPRINTS
    _BUILTIN_FINGERPRINTS = frozenset(fingerprint_type.registry.values())


#: Attributes whose values differ from one process to the next for the same object, by the
#: qualified name of the class that has them (and its subclasses). transformers'
#: GenerationConfig keeps ``hash(self)``, which string hash randomization changes per process.
VOLATILE_ATTRIBUTES: dict[str, set[str]] = {
    "transformers.generation.configuration_utils.GenerationConfig": {"_original_object_hash"},
}


def ignore_attribute(cls: type | str, name: str) -> None:
    """Leave attribute ``name`` of ``cls`` (and subclasses) out of every fingerprint: for
    values that change per process (a ``hash()``, an ``id()``) and do not change the model."""
    qualname = cls if isinstance(cls, str) else _qualname(cls)
    VOLATILE_ATTRIBUTES.setdefault(qualname, set()).add(name)


def volatile_attributes(cls: type) -> set[str]:
    out: set[str] = set()
    for base in cls.__mro__:
        out |= VOLATILE_ATTRIBUTES.get(_qualname(base), set())
    return out


def _slot_values(value: Any) -> list[tuple[str, Any]] | None:
    names = [s for c in type(value).__mro__ for s in getattr(c, "__slots__", ())]
    if not names:
        return None
    return [(n, getattr(value, n)) for n in sorted(set(names)) if hasattr(value, n)]


# Ids of the modules and callables being fingerprinted: a module reachable from its own
# attributes (a back-reference to a parent) or a function in its own closure is fingerprinted
# by the call already under way, not again (which would recurse without end). Per thread, so
# one thread's work in progress never stands in for another's.
class _ActiveIds(threading.local):
    def __init__(self) -> None:
        self.ids: set[int] = set()


_ACTIVE = _ActiveIds()


_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


def stable_text(text: str, what: str) -> str:
    """``text`` (a ``repr`` or ``str`` graphbuild made of a value) if it is the same in
    every process; one holding a memory address (``<Foo object at 0x7f...>``) is refused:
    it differs per process (a needless rerun) and says nothing about the value's contents
    (a stale hit, were the address ignored)."""
    found = _ADDRESS.search(text)
    if found is not None:
        shown = text if len(text) <= 120 else text[:117] + "..."
        raise FingerprintError(
            f"cannot fingerprint {what}: its text form holds a memory address "
            f"({found.group()}), which differs in every process: {shown}. Give the object a "
            "repr of its contents, or register a fingerprint for its type"
        )
    return text


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
