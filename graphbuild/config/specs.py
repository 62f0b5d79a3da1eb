"""Specs: ``file.py:attr`` and ``module:attr`` strings, resolved to the objects they name.

A file is imported under a name of its own (its siblings importable as in a script); a module
by its import name. What a spec names may be called (a factory) when it takes no arguments.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

from graphbuild.errors import ConfigError


def _split(spec: str, key: str) -> tuple[str, str]:
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr or not all(p.isidentifier() for p in attr.split(".")):
        raise ConfigError(
            f"'{key}' must look like 'path/to/file.py:name' or 'package.module:name', got {spec!r}"
        )
    return target, attr


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _stem(spec: str) -> str:
    target = spec.rpartition(":")[0] or spec
    if _is_file(target):
        return Path(target).stem
    return target.rsplit(".", 1)[-1]


def _on_path(directory: Path, front: bool) -> None:
    entry = str(directory)
    if entry in sys.path:
        return
    if front:
        sys.path.insert(0, entry)
    else:
        sys.path.append(entry)


def _module_name(path: Path) -> str:
    """A stable module name for a file: the same file always loads under the same name, so
    the class names and source files that structure fingerprints record do not change from
    one run (or process) to the next."""
    stem = re.sub(r"\W", "_", path.stem)
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    return f"graphbuild_user_{stem}_{digest}"


def _load_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise ConfigError(f"{spec!r}: file {path} does not exist")
    name = _module_name(path)
    module = sys.modules.get(name)
    if module is not None:
        return module
    _on_path(path.parent, front=False)  # its sibling modules import as in a script
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{spec!r}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ConfigError(f"importing {path} raised {type(err).__name__}: {err}") from err
    return module


def _import_module(target: str, spec: str) -> Any:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as err:
        if err.name and (target == err.name or target.startswith(err.name + ".")):
            raise ConfigError(
                f"{spec!r}: no module named '{err.name}' (searched sys.path, which starts "
                "with the config file's directory)"
            ) from err
        raise ConfigError(f"importing {target} raised ModuleNotFoundError: {err}") from err
    except Exception as err:
        raise ConfigError(f"importing {target} raised {type(err).__name__}: {err}") from err


def _resolve(spec: str, root: Path, key: str) -> Any:
    """The object a ``file.py:attr`` or ``module:attr`` spec names."""
    target, attr = _split(spec, key)
    _check_path_text(target)
    _on_path(root, front=True)
    if _is_file(target):
        module = _load_file((root / Path(target).expanduser()).resolve(), spec)
    else:
        module = _import_module(target, spec)
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{key} {spec!r}: {target} has no attribute '{part}'{hint}") from None
    return obj


def _call(fn: Any, spec: str, what: str) -> Any:
    try:
        return fn()
    except TypeError as err:
        if _needs_arguments(fn):
            raise ConfigError(f"{what} {spec!r} must take no arguments: {err}") from err
        raise ConfigError(f"{what} {spec!r} raised TypeError: {err}") from err
    except Exception as err:
        raise ConfigError(f"{what} {spec!r} raised {type(err).__name__}: {err}") from err


def _needs_arguments(fn: Any) -> bool:
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return any(
        p.default is p.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        for p in sig.parameters.values()
    )


def _kind(value: Any) -> str:
    if isinstance(value, tuple):
        inner = ", ".join(type(v).__name__ for v in value[:4])
        return f"a tuple of {len(value)} ({inner})"
    return f"{type(value).__name__} {value!r}"[:120]


def _check_path_text(value: str | os.PathLike) -> None:
    if "\0" in os.fspath(value):
        raise ConfigError(f"the path {os.fspath(value)!r} contains a NUL character")
