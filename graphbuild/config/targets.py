"""Per-target tables: one configuration file for every target.

``[targets.<name>]`` holds what only target ``<name>`` uses: its ``format``, its quantization
(``preset`` or ``quantizer``), its ``calibration`` and ``output_dir``, and its options by their
bare names (``opset = 21`` under ``[targets.qnn]``, ``recipe = "..."`` under
``[targets.executorch]``). Exporting a target resolves the file for it: the target's own table
over the shared keys (top level, ``[quantization]``, ``[options]``), the command line over both.

A shared key the exported target cannot take (another target's preset or format, calibration
for a target that takes none, an ``[options]`` key of another target) is left out and said,
once, as a :class:`~graphbuild.errors.IgnoredConfigWarning` naming the key and where to put
it; never silently. The same key given on the command line stays an error: what was asked for
there is not dropped. Nothing here imports torch: this is the fast path the CLI validates on.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping
from typing import Any

from graphbuild.errors import ConfigError, IgnoredConfigWarning
from graphbuild.targets.base import STR, OptionType
from graphbuild.targets.registry import DEFAULT_TARGET, all_targets, get_target

#: the keys of ``[targets.<name>]`` besides the target's options
OWN_KEYS: dict[str, OptionType] = {
    "format": STR,
    "preset": STR,
    "quantizer": STR,
    "calibration": STR,
    "output_dir": STR,
}


def target_table_schema(name: str) -> dict[str, OptionType]:
    """The keys ``[targets.<name>]`` may hold: :data:`OWN_KEYS` and the target's options."""
    return {**get_target(name).config_schema, **OWN_KEYS}


def resolve_for_target(
    table: Mapping[str, Any],
    where: str,
    given: Collection[str] = (),
    file_target: str = DEFAULT_TARGET,
) -> tuple[dict[str, Any], list[str]]:
    """The file's table as target ``table["target"]`` reads it, and what it ignores (one
    message per key). ``given`` are the keys the command line set (``--set``, flags);
    ``file_target`` is the file's own target, whose shared keys stay strict: another target's
    key there is the file's mistake (an error), not something to skip."""
    name = table.get("target", DEFAULT_TARGET)
    target = get_target(name)
    out = {k: v for k, v in table.items() if k != "targets"}
    own = dict(table.get("targets", {}).get(name, {}))
    ignored: list[str] = []

    def from_file(key: str) -> bool:
        """The key's value is the file's, and the export is for another target than the
        file's own: a shared key it cannot take is skipped (said), not refused."""
        return name != file_target and not any(k == key or k.startswith(f"{key}.") for k in given)

    def own_wins(key: str) -> bool:
        return not any(k == key or k.startswith(f"{key}.") for k in given)

    # the target's own table over the shared keys (the command line over both)
    for key in ("format", "calibration", "output_dir"):
        if key in own and own_wins(key):
            out[key] = own.pop(key)
        own.pop(key, None)
    quant = dict(out.get("quantization", {}))
    if ("preset" in own or "quantizer" in own) and own_wins("quantization"):
        quant = {k: own[k] for k in ("preset", "quantizer") if k in own}
    own.pop("preset", None)
    own.pop("quantizer", None)
    options = dict(out.get("options", {}))
    for key, value in own.items():
        if own_wins(f"options.{key}"):
            options[key] = value
    for key in target.top_level_options:  # ``recipe = ...`` beside ``model``, or options.recipe
        _one_spelling(key, out, options, own, given)

    # shared keys this target cannot take
    fmt = out.get("format")
    if fmt is not None and fmt not in target.formats and from_file("format"):
        owners = [t.name for t in all_targets() if fmt in t.formats]
        if owners:
            del out["format"]
            ignored.append(
                f"format '{fmt}' ({_of(owners)}; it exports its default "
                f"'{target.default_format}', [targets.{name}] format = ... picks another)"
            )
    preset = quant.get("preset")
    if preset is not None and preset not in target.presets and from_file("quantization"):
        owners = [t.name for t in all_targets() if preset in t.presets]
        if owners:
            del quant["preset"]
            how = (
                f"[targets.{name}] preset = ..."
                if target.presets
                else f"[targets.{name}] {target.quantization_option} = ..."
                if target.quantization_option
                else f"[targets.{name}] quantizer = ..."
            )
            ignored.append(f"[quantization] preset '{preset}' ({_of(owners)}; {how} sets its own)")
    names = target.option_names()
    if "calibration" in out and "calibration" not in names and from_file("calibration"):
        del out["calibration"]
        ignored.append("calibration (it takes no calibration batches)")
    foreign: dict[str, list[str]] = {}  # owner -> its keys, said in one line per owner
    for key in list(options):
        if key in target.config_schema or not from_file(f"options.{key}"):
            continue
        owners = [t.name for t in all_targets() if key in t.config_schema]
        if owners:
            del options[key]
            foreign.setdefault(owners[0], []).append(key)
    for owner, keys in foreign.items():
        ignored.append(
            f"[options] {', '.join(keys)} ({owner}'s; [targets.{owner}] keeps "
            f"{'it' if len(keys) == 1 else 'them'} there)"
        )
    for key in _top_level_options_of_others(name):  # said for the file's own target too
        if key in out and own_wins(key):
            del out[key]
            owners = [t.name for t in all_targets() if key in t.top_level_options]
            ignored.append(
                f"'{key}' ({_of(owners)} option; [targets.{owners[0]}] {key} = ... keeps it there)"
            )
    if quant:
        out["quantization"] = quant
    else:
        out.pop("quantization", None)
    if options or "options" in out:
        out["options"] = options
    return out, [f"{where}: {name} ignores {text}" for text in ignored]


def warn_ignored(messages: list[str]) -> None:
    """Say each key the exported target ignores, once, as graphbuild's warning line."""
    for text in messages:
        warnings.warn(f"graphbuild: {text}", IgnoredConfigWarning, stacklevel=3)


def check_target_tables(tables: Any, where: str) -> dict[str, dict[str, OptionType]]:
    """``[targets]`` names registered targets only, each a table; the schema of each."""
    from graphbuild.config.schema import _describe, _suggest

    if not isinstance(tables, dict):
        raise ConfigError(f"{where}: [targets] must be a table, got {_describe(tables)}")
    known = [t.name for t in all_targets()]
    schemas = {}
    for name, sub in tables.items():
        if name not in known:
            hint = _suggest(name, known).replace("Known keys", "Targets")
            raise ConfigError(f"{where}: [targets.{name}] names no target{hint}")
        if not isinstance(sub, dict):
            raise ConfigError(f"{where}: [targets.{name}] must be a table, got {_describe(sub)}")
        schemas[name] = target_table_schema(name)
    return schemas


def _one_spelling(
    key: str,
    out: dict[str, Any],
    options: dict[str, Any],
    own: Mapping[str, Any],
    given: Collection[str],
) -> None:
    """Keep one spelling of the target's top-level option ``key`` (``key`` and
    ``options.key``) where the precedence picks one: the command line over the target's
    table over the shared top level. Both spellings from the same place (the command line,
    or the file's shared keys) are left for the config to refuse when they disagree."""
    top_given = key in given
    option_given = any(k == f"options.{key}" or k == "options" for k in given)
    if top_given and not option_given:
        options.pop(key, None)  # the command line's key over the table's and [options]
    elif option_given and not top_given:
        out.pop(key, None)  # the command line's options.key over the file's top level
    elif not top_given and key in own:
        out.pop(key, None)  # the target's table over the shared top level


def _of(owners: list[str]) -> str:
    """``qnn's``, ``qnn and gguf's``: whose a key is."""
    return f"{' and '.join(owners)}'s" if len(owners) < 3 else "other targets'"


def _top_level_options_of_others(name: str) -> list[str]:
    own = set(get_target(name).top_level_options)
    return sorted({k for t in all_targets() for k in t.top_level_options} - own)
