"""Fingerprints of code values: functions, bound methods, partials, builtins, modules.

What a callable computes is its code (``code.callable_version``) and what it is bound to.
"""

from __future__ import annotations

import functools
import types
from typing import Any

from graphbuild.engine.fingerprint.code import _files_of, callable_version
from graphbuild.engine.fingerprint.walk import _Walk, fingerprint_type


@fingerprint_type.register(types.ModuleType)
def _(value: types.ModuleType, walk: _Walk) -> Any:
    # a module's code is its source files (an installed library: its version)
    return {"module": value.__name__, "files": _files_of(value.__name__)}


@fingerprint_type.register(types.FunctionType)
def _(value: Any, walk: _Walk) -> Any:
    return {"function": callable_version(value)}


@fingerprint_type.register(functools.partial)
def _(value: functools.partial, walk: _Walk) -> Any:
    return {
        "partial": walk.child("func", value.func),
        "args": walk.child("args", list(value.args)),
        "keywords": walk.child("keywords", dict(value.keywords)),
    }


@fingerprint_type.register(types.MethodType)
def _(value: types.MethodType, walk: _Walk) -> Any:
    # a bound method calls its function with its object: both are what it computes
    return {
        "function": callable_version(value.__func__),
        "self": walk.child("__self__", value.__self__),
    }


@fingerprint_type.register(types.BuiltinFunctionType)
def _(value: Any, walk: _Walk) -> Any:
    owner = getattr(value, "__self__", None)
    if owner is None or isinstance(owner, types.ModuleType):  # a plain builtin function
        return {"function": callable_version(value)}
    return {"builtin method": value.__name__, "self": walk.child("__self__", owner)}


@fingerprint_type.register(staticmethod)
@fingerprint_type.register(classmethod)
def _(value: Any, walk: _Walk) -> Any:
    return {type(value).__name__: walk.child("__func__", value.__func__)}
