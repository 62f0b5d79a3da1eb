"""Fingerprints of plain Python values: scalars, bytes, containers, enums, paths."""

from __future__ import annotations

import enum
from pathlib import PurePath
from typing import Any

from graphbuild.engine.fingerprint.walk import _qualname, _Walk, fingerprint, fingerprint_type
from graphbuild.hashing import digest_bytes, digest_json


@fingerprint_type.register(type(None))
@fingerprint_type.register(bool)
@fingerprint_type.register(str)
def _(value: Any, walk: _Walk) -> Any:
    return value


@fingerprint_type.register(int)
def _(value: int, walk: _Walk) -> Any:
    return value if abs(value) < 2**53 else {"int": str(value)}


@fingerprint_type.register(float)
def _(value: float, walk: _Walk) -> Any:
    return {"float": value.hex()}


@fingerprint_type.register(bytes)
@fingerprint_type.register(bytearray)
def _(value: bytes, walk: _Walk) -> Any:
    return {"bytes": digest_bytes(bytes(value))}


@fingerprint_type.register(list)
@fingerprint_type.register(tuple)
def _(value: Any, walk: _Walk) -> Any:
    items = [walk.child(f"[{i}]", v) for i, v in enumerate(value)]
    return items if type(value) in (list, tuple) else {_qualname(type(value)): items}


@fingerprint_type.register(dict)
def _(value: dict, walk: _Walk) -> Any:
    items = [[fingerprint(k), walk.child(str(k), v)] for k, v in value.items()]
    items.sort(key=lambda kv: digest_json(kv[0]))
    return {"dict": items}


@fingerprint_type.register(set)
@fingerprint_type.register(frozenset)
def _(value: Any, walk: _Walk) -> Any:
    return {"set": sorted((walk.child("{}", v) for v in value), key=digest_json)}


@fingerprint_type.register(enum.Enum)
def _(value: enum.Enum, walk: _Walk) -> Any:
    return {"enum": _qualname(type(value)), "name": value.name}


@fingerprint_type.register(PurePath)
def _(value: PurePath, walk: _Walk) -> Any:
    return {"path": str(value)}
