"""What a sweep varies: axes over config keys, crossed (grid) or zipped (list), and the
``[sweep]`` table of ``graphbuild.toml``.

An axis is a config key and its values, as ``--vary quantization.preset=w8a16,w8a8,w4a16`` or
``--vary options.opset=17,21`` gives it (each value a TOML value, else a plain string; commas
inside quotes, brackets or braces belong to the value). ``calibration`` takes the names of
calibration sets (``[sweep.calibrations]``: name = "file.py:factory") or specs. A variant is
one value of each axis; its name (the directory it is exported into) is made of its values.

```toml
[sweep]
mode = "grid"                                   # or "list": the axes zipped, one variant each
output_dir = "sweep-out"
vary = { "quantization.preset" = ["w8a16", "w8a8", "w4a16"], calibration = ["default", "large"] }
# variants = [{ "quantization.preset" = "w8a8", "options.opset" = 17 }, ...]   # an explicit list

[sweep.calibrations]
default = "examples/tiny_decoder.py:calibration"
large = "examples/tiny_decoder.py:calibration_large"
```

Nothing here imports torch: a sweep's variants are checked before any model is built.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from graphbuild.errors import ConfigError

__all__ = [
    "Axis",
    "SweepSettings",
    "Variant",
    "parse_vary",
    "split_values",
    "sweep_settings",
]

MODES = ("grid", "list")
#: Keys a variant may not set: the sweep places each variant itself, in one cache.
_FIXED = ("output_dir", "cache_dir", "cache", "cache.dir", "cache.url", "cache.readonly")
_KEYS = {
    "mode",
    "output_dir",
    "vary",
    "variants",
    "calibrations",
    "jobs",
    "executor",
    "ray_address",
}
_NAME = re.compile(r"[^A-Za-z0-9._]+")


@dataclass(frozen=True)
class Axis:
    """One config key and the values a sweep gives it."""

    key: str
    values: tuple[Any, ...]


@dataclass(frozen=True)
class Variant:
    """One export of a sweep: its name (a directory name), the values it gives each varied
    key as a person reads them (a calibration set's name), and the config overrides that
    make it (``(key, value)``, as ``--set`` gives them)."""

    name: str
    values: tuple[tuple[str, Any], ...]
    overrides: tuple[tuple[str, Any], ...]

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={_show(v)}" for k, v in self.values) or "(the configuration)"


@dataclass(frozen=True)
class SweepSettings:
    """A sweep as configured: axes (or an explicit list of variants), how they combine, the
    named calibration sets, and the defaults the command line may override."""

    axes: tuple[Axis, ...] = ()
    mode: str = "grid"
    listed: tuple[Mapping[str, Any], ...] = ()
    calibrations: Mapping[str, str] = field(default_factory=dict)
    output_dir: str | None = None
    jobs: int | None = None
    executor: str | None = None
    ray_address: str | None = None

    def variants(self) -> list[Variant]:
        """Every variant, in order: the grid (the first axis slowest) or the zipped list,
        then the explicit ones."""
        for axis in self.axes:
            _check_key(axis.key)
            if not axis.values:
                raise ConfigError(f"sweep: '{axis.key}' has no values")
        rows: list[tuple[tuple[str, Any], ...]] = []
        if self.axes and self.mode == "grid":
            for combo in itertools.product(*(a.values for a in self.axes)):
                rows.append(tuple((a.key, v) for a, v in zip(self.axes, combo, strict=True)))
        elif self.axes:
            lengths = {a.key: len(a.values) for a in self.axes}
            if len(set(lengths.values())) > 1:
                shown = ", ".join(f"{k}: {n}" for k, n in lengths.items())
                raise ConfigError(
                    f"sweep: mode 'list' zips the axes, which need as many values each ({shown})"
                )
            for combo in zip(*(a.values for a in self.axes), strict=True):
                rows.append(tuple((a.key, v) for a, v in zip(self.axes, combo, strict=True)))
        for entry in self.listed:
            for key in entry:
                _check_key(key)
            rows.append(tuple(entry.items()))
        if not rows:
            raise ConfigError(
                "sweep: nothing to vary; give --vary KEY=V1,V2 (repeatable) or a [sweep] "
                "table with vary = {...} or variants = [...]"
            )
        out, names = [], set()
        for row in rows:
            overrides = tuple((k, self._value(k, v)) for k, v in row)
            name = _unique(_variant_name(row), names)
            out.append(Variant(name, row, overrides))
        if len({json.dumps(v.overrides, sort_keys=True, default=str) for v in out}) != len(out):
            raise ConfigError("sweep: two variants set the same values; each must differ")
        return out

    def _value(self, key: str, value: Any) -> Any:
        """A calibration set's name as its spec; every other value as it is."""
        if key != "calibration":
            return value
        if isinstance(value, str) and value in self.calibrations:
            return self.calibrations[value]
        if isinstance(value, str) and ":" in value:
            return value  # a spec given directly
        known = ", ".join(sorted(self.calibrations)) or "none ([sweep.calibrations] is empty)"
        raise ConfigError(
            f"sweep: calibration {value!r} is neither a named calibration set (known: {known}) "
            "nor a 'file.py:factory' spec"
        )


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise ConfigError(f"sweep: {key!r} is not a config key")
    if key in _FIXED or key.startswith("cache."):
        raise ConfigError(
            f"sweep: '{key}' cannot vary: the sweep places every variant under its own "
            "output directory and shares one cache (--output-dir, --cache-dir, --cache-url)"
        )


def _show(value: Any) -> str:
    return value if isinstance(value, str) else _toml(value)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f'"{k}" = {_toml(v)}' for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def _variant_name(row: Sequence[tuple[str, Any]]) -> str:
    """A directory name from the values: ``w8a16-large``; a table value by its entries."""
    parts = []
    for _, value in row:
        if isinstance(value, Mapping):
            text = "_".join(f"{k}-{_show(v)}" for k, v in value.items()) or "none"
        else:
            text = _show(value)
        text = _NAME.sub("_", text.rpartition(":")[2] if ":" in text else text).strip("._")
        parts.append(text or "x")
    return "-".join(parts)[:80] or "base"


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}-{n}", n + 1
    taken.add(candidate)
    return candidate


# --------------------------------------------------------------------------- parsing


def split_values(text: str) -> list[str]:
    """``a,b,"c,d",[1,2],{x = 1}`` -> the five values' texts: commas inside quotes,
    brackets and braces belong to the value."""
    out, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    out.append(text[start:].strip())
    return out


def _value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_vary(text: str) -> Axis:
    """``"quantization.preset=w8a16,w8a8"`` -> an Axis; values are TOML values (numbers,
    booleans, quoted strings, lists, inline tables), else plain strings."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not raw.strip():
        raise ConfigError(f"--vary expects KEY=V1,V2,... (e.g. options.opset=17,21), got {text!r}")
    values = [_value(v) for v in split_values(raw)]
    if any(v == "" for v in values):
        raise ConfigError(f"--vary {text!r}: an empty value")
    return Axis(key, tuple(values))


def sweep_settings(
    table: Mapping[str, Any] | None,
    vary: Iterable[str | Axis] = (),
    *,
    mode: str | None = None,
    where: str = "[sweep]",
) -> SweepSettings:
    """The ``[sweep]`` table with the command line's ``--vary`` axes (which replace the
    table's axes when given) and mode."""
    table = dict(table or {})
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {sorted(_KEYS)}")
    axes = [parse_vary(a) if isinstance(a, str) else a for a in vary]
    if not axes:
        raw = table.get("vary", {})
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: vary must be a table of key = [values]")
        for key, values in raw.items():
            if not isinstance(values, list):
                raise ConfigError(f"{where}: vary.{key} must be a list of values")
            axes.append(Axis(key, tuple(values)))
    listed = table.get("variants", []) if not vary else []
    if not isinstance(listed, list) or not all(isinstance(v, Mapping) for v in listed):
        raise ConfigError(f"{where}: variants must be a list of tables (key = value)")
    calibrations = table.get("calibrations", {})
    if not isinstance(calibrations, Mapping) or not all(
        isinstance(v, str) for v in calibrations.values()
    ):
        raise ConfigError(f"{where}: calibrations must be a table of name = 'file.py:factory'")
    chosen = mode or table.get("mode", "grid")
    if chosen not in MODES:
        raise ConfigError(f"{where}: mode must be one of {', '.join(MODES)}, not {chosen!r}")
    for key, kind in (("output_dir", str), ("executor", str), ("ray_address", str), ("jobs", int)):
        if key in table and not isinstance(table[key], kind):
            raise ConfigError(f"{where}: {key} must be a {kind.__name__}")
    return SweepSettings(
        axes=tuple(axes),
        mode=chosen,
        listed=tuple(dict(v) for v in listed),
        calibrations=dict(calibrations),
        output_dir=table.get("output_dir"),
        jobs=table.get("jobs"),
        executor=table.get("executor"),
        ray_address=table.get("ray_address"),
    )
