"""Command-line overrides (``--set key=value``): parsed as TOML values, applied to the table."""

from __future__ import annotations

import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from graphbuild.config.schema import (
    _TABLE,
    _TABLES,
    _describe,
    _dotted_keys,
    _option_keys,
    _option_targets,
    _suggest,
    _top_keys,
)
from graphbuild.errors import ConfigError


def parse_override(text: str) -> tuple[str, Any]:
    """``"options.opset=17"`` -> ``("options.opset", 17)``: the value as a TOML value when it
    parses as one (numbers, booleans, quoted strings, lists), else as a plain string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects KEY=VALUE (e.g. options.opset=17), got {text!r}")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def _apply_override(table: dict[str, Any], key: str, value: Any) -> str:
    """Set ``key`` (dotted into tables) to ``value`` in ``table``; the key as the table
    spells it (a bare option name is ``options.<name>``)."""
    head, dot, tail = key.partition(".")
    top = _top_keys()
    if not dot and head not in top and _option_targets(head):
        head, dot, tail = "options", ".", head  # unambiguous: no top-level key has its name
    if not dot:
        if head not in top:
            hint = _suggest(head, top, _option_keys())  # a bare key may name an option
            raise ConfigError(f"--set: unknown top-level key '{head}'{hint}")
        table[head] = value
        return head
    if head not in _TABLES and head != "options":
        known = [f"{t}.{k}" for t, schema in _TABLES.items() for k in schema] + list(top)
        hint = _suggest(key, known, _dotted_keys())
        raise ConfigError(f"--set: unknown key '{key}'{hint}")
    schema = _TABLES.get(head)  # [options] is checked once the target is known (_validate)
    if schema is not None and tail not in schema:
        raise ConfigError(f"--set: unknown key '{tail}' in [{head}]{_suggest(tail, schema)}")
    sub = table.setdefault(head, {})
    if not isinstance(sub, dict):
        raise ConfigError(f"'{head}' must be {_TABLE.label}, got {_describe(sub)}")
    if head == "quantization":  # a preset on the command line replaces a configured quantizer
        sub.pop("quantizer" if tail == "preset" else "preset", None)
    option, dot, entry = tail.partition(".")
    if head == "options" and dot:  # options.methods.encode=...: one entry of a table option
        sub = sub.setdefault(option, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"--set {key}: 'options.{option}' is not a table")
        sub[entry] = value
        return f"{head}.{option}"
    sub[tail] = value
    return f"{head}.{tail}"
