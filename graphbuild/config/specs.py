"""Specs: ``file.py:attr`` and ``module:attr`` strings, resolved to the objects they name.

A file is imported under the name Python's import gives it (its package path, the same in
every checkout; its siblings importable as in a script); a module by its import name. What a spec names may be called (a factory) when it takes no arguments.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import keyword
import os
import re
import sys
from pathlib import Path
from typing import Any

from graphbuild.errors import ConfigError
from graphbuild.hashing import digest_bytes


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


def _package_name(path: Path) -> tuple[str, Path] | None:
    """The name Python's own import gives ``path`` from the directory above its packages
    (directories holding ``__init__.py``), and that directory: ``examples/convnet.py`` in a
    package ``examples`` is ``examples.convnet``, as ``from examples import convnet`` names
    it. None when a part is not an identifier."""
    parts = [path.stem]
    base = path.parent
    while (base / "__init__.py").is_file() and base.parent != base:
        parts.insert(0, base.name)
        base = base.parent
    if not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        return None
    return ".".join(parts), base


def _fallback_name(path: Path) -> str:
    """A name for a file whose own name is taken (``json.py``, a second ``model.py``): its stem
    and the digest of its bytes, so it is the same in every checkout and process."""
    stem = re.sub(r"\W", "_", path.stem)
    return f"graphbuild_user_{stem}_{digest_bytes(path.read_bytes())[:12]}"


def _same_file(module: Any, path: Path) -> bool:
    where = getattr(module, "__file__", None)
    try:
        return bool(where) and os.path.samefile(where, path)
    except OSError:
        return False


def _top_level_is_ours(top: str, base: Path) -> bool:
    """True when the top-level name ``top`` imports from ``base`` (and not from another
    directory on ``sys.path``, the standard library or an installed package)."""
    loaded = sys.modules.get(top)
    if loaded is not None:
        places = [getattr(loaded, "__file__", None), *getattr(loaded, "__path__", ())]
    else:
        try:
            found = importlib.util.find_spec(top)  # a top-level name: nothing is imported
        except (ImportError, ValueError):
            return False
        if found is None:
            return False
        places = [found.origin, *(found.submodule_search_locations or ())]
    mine = {base / top, base / f"{top}.py"}
    for place in places:
        if not place:
            continue
        try:
            if any(m.exists() and os.path.samefile(place, m) for m in mine):
                return True
        except OSError:
            continue
    return False


def _load_file(path: Path, spec: str) -> Any:
    """The module of the file ``path``, imported under the name Python's import gives it
    (:func:`_package_name`), never one derived from where the checkout is: class names and
    ``nn_module_stack`` entries reach structure keys and ONNX metadata, which must be the
    same in every clone and for the Python API. Where that name is taken by another module,
    a name from the file's contents (:func:`_fallback_name`)."""
    if not path.is_file():
        raise ConfigError(f"{spec!r}: file {path} does not exist")
    _on_path(path.parent, front=False)  # its sibling modules import as in a script
    found = _package_name(path)
    if found is not None:
        name, base = found
        module = sys.modules.get(name)
        if module is not None and _same_file(module, path):
            return module
        _on_path(base, front=False)
        if module is None and _top_level_is_ours(name.split(".")[0], base):
            module = _import_module(name, spec)
            if _same_file(module, path):
                return module
    return _exec_file(path, _fallback_name(path), spec)


def _exec_file(path: Path, name: str, spec: str) -> Any:
    module = sys.modules.get(name)
    if module is not None and _same_file(module, path):
        return module
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
