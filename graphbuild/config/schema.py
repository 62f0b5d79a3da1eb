"""The keys a configuration may hold and their types; a problem is a ConfigError naming the key.

graphbuild's own keys, the ``[quantization]`` and ``[cache]`` tables, the options targets let
the top level set, and the configured target's ``[options]`` schema.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from graphbuild.errors import ConfigError
from graphbuild.targets.base import BOOL, STR, OptionType
from graphbuild.targets.registry import DEFAULT_TARGET, all_targets, get_target

_TABLE = OptionType("a table", lambda v: isinstance(v, dict))

_TOP: dict[str, OptionType] = {
    "model": STR,
    "samples": STR,
    "calibration": STR,
    "target": STR,
    "format": STR,
    "model_name": STR,
    "output_dir": STR,
    "cache_dir": STR,
    "cache": _TABLE,
    "quantization": _TABLE,
    "options": _TABLE,
    "build": _TABLE,
    "sweep": _TABLE,  # read by `graphbuild sweep` (graphbuild.sweeps), which checks it
    "targets": _TABLE,  # [targets.<name>]: one target's own keys (graphbuild.config.targets)
}
_QUANTIZATION: dict[str, OptionType] = {"preset": STR, "quantizer": STR}
# [cache]: dir (as cache_dir), url (a shared cache: redis://host:port/db), readonly (read the
# shared cache, or the directory when no url is given, and never write it), lease_seconds (how
# long a process that died while building a key keeps others from building it)
_SECONDS = OptionType(
    "a positive number of seconds",
    lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
)
_CACHE: dict[str, OptionType] = {
    "dir": STR,
    "url": STR,
    "readonly": BOOL,
    "lease_seconds": _SECONDS,
}
# [build]: jobs (stages at once: a count, or "auto", the default: one per core) and memory
# (the bytes the running stages may declare at once: a count, "8GiB"-style, or "auto": most of
# what is free)
_BUILD: dict[str, OptionType] = {
    "jobs": OptionType(
        'a positive integer or "auto"',
        lambda v: v == "auto" or isinstance(v, int) and not isinstance(v, bool) and v > 0,
    ),
    "memory": OptionType('a size ("8GiB", bytes) or "auto"', lambda v: _size_ok(v)),
}
_TABLES: dict[str, dict[str, OptionType]] = {
    "quantization": _QUANTIZATION,
    "cache": _CACHE,
    "build": _BUILD,
}


def _size_ok(value: Any) -> bool:
    from graphbuild.engine.sizes import parse_memory

    try:
        parse_memory(value)
    except ValueError:
        return False
    return True


def _top_keys() -> dict[str, OptionType]:
    """The top-level keys: graphbuild's own, and the options that targets let a config file
    set at its top level (``Target.top_level_options``; every target's, for a shared file)."""
    keys = dict(_TOP)
    for target in all_targets():
        for key in target.top_level_options:
            keys.setdefault(key, target.config_schema[key])
    return keys


def _option_targets(key: str) -> list[str]:
    """The targets whose ``[options]`` know ``key``."""
    return [t.name for t in all_targets() if key in t.config_schema]


def _suggest(key: str, known: Iterable[str], also: Iterable[str] = ()) -> str:
    """``; did you mean 'x'? Known keys: ...``: the closest of ``known`` and ``also`` (keys
    the message does not list, such as options a bare key may name), and ``known``."""
    known = sorted(known)
    close = difflib.get_close_matches(key, sorted({*known, *also}), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{hint} Known keys: {', '.join(known)}"


def _option_keys() -> set[str]:
    """Every target's ``[options]`` keys: what a bare ``--set`` key may name."""
    return {key for target in all_targets() for key in target.config_schema}


def _dotted_keys() -> list[str]:
    """Every key ``--set`` may name with a dot: ``quantization.preset``, ``options.opset``."""
    tables = [f"{t}.{k}" for t, schema in _TABLES.items() for k in schema]
    return tables + [f"options.{key}" for key in sorted(_option_keys())]


def _describe(value: Any) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}
    kinds.update({list: "a list", dict: "a table"})
    return f"{value!r} ({kinds.get(type(value), type(value).__name__)})"


def _validate(table: Mapping[str, Any], where: str, given: Iterable[str] = ()) -> None:
    """Unknown keys and wrong types, each a ConfigError naming the key and its table. The
    ``[options]`` table is checked against the configured target's schema; when the command
    line picked another target (``given``: the keys it set), a key of another target's from the
    file is accepted (the export skips it, with a warning). ``[targets.<name>]`` is checked against that target's keys."""
    given = set(given)
    top = _top_keys()
    for key, value in table.items():
        if key not in top:
            owners = _option_targets(key)
            if owners:
                raise ConfigError(
                    f"{where}: '{key}' is not a top-level key; it is an option of target(s) "
                    f"{', '.join(owners)}: put it in [options] ({key} = ...)"
                )
            hint = _suggest(key, top, [f"options.{k}" for k in _option_keys()])
            raise ConfigError(f"{where}: unknown top-level key '{key}'{hint}")
        _check_type(key, value, top[key], where)
    for key, value in table.items():  # tables once every key has its type ("target" a string)
        if key in _TABLES or key == "options":
            schema = _TABLES[key] if key != "options" else _target_schema(table, where)
            for sub, subvalue in value.items():
                expected = schema.get(sub)
                if expected is None and "target" in given and f"options.{sub}" not in given:
                    expected = _foreign_option(sub)  # the file's, for another target: skipped
                if expected is None:
                    raise ConfigError(
                        f"{where}: unknown key '{sub}' in [{key}]{_suggest(sub, schema)}"
                    )
                _check_type(f"{key}.{sub}", subvalue, expected, where)
        elif key == "targets":
            from graphbuild.config.targets import check_target_tables

            for name, schema in check_target_tables(value, where).items():
                for sub, subvalue in value[name].items():
                    if sub not in schema:
                        raise ConfigError(
                            f"{where}: unknown key '{sub}' in [targets.{name}]"
                            f"{_suggest(sub, schema)}"
                        )
                    _check_type(f"targets.{name}.{sub}", subvalue, schema[sub], where)


def _foreign_option(key: str) -> OptionType | None:
    """The type of ``key`` as the first target whose options know it declares it."""
    for target in all_targets():
        if key in target.config_schema:
            return target.config_schema[key]
    return None


def _target_schema(table: Mapping[str, Any], where: str) -> Mapping[str, OptionType]:
    name = table.get("target", DEFAULT_TARGET)
    try:
        return get_target(name).config_schema
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def _check_type(key: str, value: Any, expected: OptionType, where: str) -> None:
    if not expected.accepts(value):
        raise ConfigError(f"{where}: '{key}' must be {expected.label}, got {_describe(value)}")
