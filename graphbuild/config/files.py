"""Finding and reading the configuration file: ``graphbuild.toml`` or ``[tool.graphbuild]``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from graphbuild.config.schema import _describe
from graphbuild.errors import ConfigError

CONFIG_FILE = "graphbuild.toml"
PYPROJECT = "pyproject.toml"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from err
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror or err}") from err


def _pyproject_table(path: Path, required: bool) -> dict[str, Any] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from err
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror or err}") from err
    if "graphbuild" not in text and not required:
        return None  # cheap: do not parse every unrelated pyproject.toml on the way up
    doc = _read_toml(path)
    table = doc.get("tool", {}).get("graphbuild")
    if table is None:
        if required:
            raise ConfigError(f"{path} has no [tool.graphbuild] table")
        return None
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.graphbuild] must be a table, got {_describe(table)}")
    return table


def find_config(start: str | os.PathLike | None = None) -> Path | None:
    """The first ``graphbuild.toml``, or ``pyproject.toml`` with ``[tool.graphbuild]``, from
    ``start`` (default: the working directory) upward; None when there is none."""
    here = Path(start or os.getcwd()).resolve()
    for directory in (here, *here.parents):
        candidate = directory / CONFIG_FILE
        if candidate.is_file():
            return candidate
        pyproject = directory / PYPROJECT
        if pyproject.is_file() and _pyproject_table(pyproject, required=False) is not None:
            return pyproject
    return None


def _read_config(path: Path) -> dict[str, Any]:
    if path.name == PYPROJECT:
        return _pyproject_table(path, required=True) or {}
    return _read_toml(path)
