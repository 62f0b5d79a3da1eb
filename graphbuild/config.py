"""``graphbuild.toml`` / ``[tool.graphbuild]`` loading and validation.

The configuration names what to export (a model factory, its sample inputs and calibration
batches), how (target, format, quantization, the target's options) and where (output and cache
directories). It is found from the working directory upward: in each directory a
``graphbuild.toml`` wins over a ``pyproject.toml`` with a ``[tool.graphbuild]`` table, and the
first directory with either wins. Relative paths in it are relative to its own directory.

Loading only parses and validates; nothing is imported until :meth:`Config.load_model`, so
``graphbuild cache ...`` and ``graphbuild --help`` stay quick. Every problem is a
:class:`~graphbuild.errors.ConfigError` that names the key, what was expected and what was
found; only the CLI turns it into an exit code.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from graphbuild.errors import ConfigError
from graphbuild.targets.base import BOOL, STR, OptionType
from graphbuild.targets.registry import DEFAULT_TARGET, all_targets, get_target

__all__ = [
    "CONFIG_FILE",
    "Config",
    "find_config",
    "load_config",
    "parse_override",
]

CONFIG_FILE = "graphbuild.toml"
PYPROJECT = "pyproject.toml"
DEFAULT_OUTPUT_DIR = "graphbuild-out"

_EXAMPLE = f"""\
    # {CONFIG_FILE}
    model = "path/to/model.py:build"      # returns a module, or (module, sample_inputs)
    calibration = "path/to/model.py:calibration"   # optional: a list of batches
    [quantization]
    preset = "w8a16"                       # or quantizer = "module:attr"
"""


# --------------------------------------------------------------------------- schema


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
}
_QUANTIZATION: dict[str, OptionType] = {"preset": STR, "quantizer": STR}
# [cache]: dir (as cache_dir), url (a shared cache: redis://host:port/db), readonly (read the
# shared cache, or the directory when no url is given, and never write it)
_CACHE: dict[str, OptionType] = {"dir": STR, "url": STR, "readonly": BOOL}
_TABLES: dict[str, dict[str, OptionType]] = {"quantization": _QUANTIZATION, "cache": _CACHE}

#: What belongs to the file's model: a model given on the command line (``--model``, or
#: ``--set model=...``) drops these from the file unless they are given there too.
_MODEL_KEYS = ("samples", "calibration", "model_name")


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


def _suggest(key: str, known: Iterable[str]) -> str:
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{hint} Known keys: {', '.join(known)}"


def _describe(value: Any) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}
    kinds.update({list: "a list", dict: "a table"})
    return f"{value!r} ({kinds.get(type(value), type(value).__name__)})"


def _validate(table: Mapping[str, Any], where: str) -> None:
    """Unknown keys and wrong types, each a ConfigError naming the key and its table. The
    ``[options]`` table is checked against the configured target's schema."""
    top = _top_keys()
    for key, value in table.items():
        if key not in top:
            owners = _option_targets(key)
            if owners:
                raise ConfigError(
                    f"{where}: '{key}' is not a top-level key; it is an option of target(s) "
                    f"{', '.join(owners)}: put it in [options] ({key} = ...)"
                )
            raise ConfigError(f"{where}: unknown top-level key '{key}'{_suggest(key, top)}")
        _check_type(key, value, top[key], where)
    for key, value in table.items():  # tables once every key has its type ("target" a string)
        if key in _TABLES or key == "options":
            schema = _TABLES[key] if key != "options" else _target_schema(table, where)
            for sub, subvalue in value.items():
                if sub not in schema:
                    raise ConfigError(
                        f"{where}: unknown key '{sub}' in [{key}]{_suggest(sub, schema)}"
                    )
                _check_type(f"{key}.{sub}", subvalue, schema[sub], where)


def _target_schema(table: Mapping[str, Any], where: str) -> Mapping[str, OptionType]:
    name = table.get("target", DEFAULT_TARGET)
    try:
        return get_target(name).config_schema
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def _check_type(key: str, value: Any, expected: OptionType, where: str) -> None:
    if not expected.accepts(value):
        raise ConfigError(f"{where}: '{key}' must be {expected.label}, got {_describe(value)}")


# --------------------------------------------------------------------------- finding & reading


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


# --------------------------------------------------------------------------- overrides


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


def _apply_override(table: dict[str, Any], key: str, value: Any) -> None:
    head, dot, tail = key.partition(".")
    top = _top_keys()
    if not dot and head not in top and _option_targets(head):
        head, dot, tail = "options", ".", head  # unambiguous: no top-level key has its name
    if not dot:
        if head not in top:
            raise ConfigError(f"--set: unknown top-level key '{head}'{_suggest(head, top)}")
        table[head] = value
        return
    if head not in _TABLES and head != "options":
        known = [f"{t}.{k}" for t, schema in _TABLES.items() for k in schema] + list(top)
        raise ConfigError(f"--set: unknown key '{key}'{_suggest(key, known)}")
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
        tail = entry
    sub[tail] = value


# --------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class Config:
    """A validated configuration. Paths are absolute; specs are imported on demand.

    ``options`` holds the configured target's options, those given at the top level of the
    file (``Target.top_level_options``) included. ``dropped`` names the file's keys that
    belonged to its model (``samples``, ``calibration``, ``model_name``) and were left out
    because the command line named another model."""

    root: Path
    source: Path | None = None
    model: str | None = None
    samples: str | None = None
    calibration: str | None = None
    target: str = DEFAULT_TARGET
    format: str | None = None
    model_name: str | None = None
    output_dir: Path = Path(DEFAULT_OUTPUT_DIR)
    cache_dir: Path | None = None
    cache_url: str | None = None
    cache_readonly: bool = False
    preset: str | None = None
    quantizer: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()

    @property
    def run_id(self) -> str:
        """The scheduler's run id for this export, as ``graphbuild.api`` forms it."""
        return f"{self.target}:{self.model_name}"

    @property
    def where(self) -> str:
        return str(self.source) if self.source else "command line"

    # ----------------------------------------------------------------- imports

    def load_model(self) -> tuple[Any, Any, list[Any] | None]:
        """Import and call the model factory: ``(model, sample_inputs, calibration)``."""
        import torch

        if not self.model:
            raise ConfigError(
                f'no model configured in {self.where}: set model = "path/to/model.py:build" '
                "or pass --model path/to/model.py:build"
            )
        factory = _resolve(self.model, self.root, "model")
        if not callable(factory):
            raise ConfigError(
                f"model {self.model!r} is {type(factory).__name__}, not a callable factory"
            )
        result = _call(factory, self.model, "model factory")
        samples: Any = None
        if isinstance(result, torch.nn.Module):
            model = result
        elif (
            isinstance(result, (tuple, list))
            and len(result) == 2
            and isinstance(result[0], torch.nn.Module)
        ):
            model, samples = result
        else:
            raise ConfigError(
                f"model factory {self.model!r} returned {_kind(result)}; expected a "
                "torch.nn.Module or a (module, sample_inputs) tuple"
            )
        if self.samples:
            samples = self._value(self.samples, "samples")
        elif samples is None:
            raise ConfigError(
                f"model factory {self.model!r} returned only a module; return "
                '(module, sample_inputs) or set samples = "file.py:fn"'
            )
        calibration = None
        if self.calibration:
            calibration = self._value(self.calibration, "calibration")
            if isinstance(calibration, (str, bytes, Mapping)) or not isinstance(
                calibration, Iterable
            ):
                raise ConfigError(
                    f"calibration {self.calibration!r} gave {_kind(calibration)}; expected a "
                    "list of batches (each a tuple of positional inputs or a tensor)"
                )
            calibration = list(calibration)
        return model, samples, calibration

    def _value(self, spec: str, key: str) -> Any:
        obj = _resolve(spec, self.root, key)
        return _call(obj, spec, key) if callable(obj) else obj

    def _imported(self, value: str | Mapping[str, str], key: str) -> Any:
        """What an ``imports`` option names: one spec's object, or a table of them."""
        if isinstance(value, str):
            return self._value(value, key)
        return {name: self._value(spec, f"{key}.{name}") for name, spec in value.items()}

    def quantizer_object(self) -> Any:
        """The configured quantizer: a preset name, a torchao Quantizer, or None."""
        target = get_target(self.target)
        if self.preset is not None and not target.presets and self.quantizer is None:
            own = target.quantization_option
            if own is not None and self.options.get(own) is not None:
                return None  # the preset is another target's; this one picks its own
            raise ConfigError(
                f"{self.where}: target '{target.name}' has no quantization presets "
                f"('{self.preset}' is another target's); "
                + (
                    f'set {own} = "..." (see graphbuild targets)'
                    if own is not None
                    else "set [quantization] quantizer instead"
                )
            )
        if self.preset is not None:
            builtin = target.presets
            if self.preset in builtin:
                return self.preset  # known without importing torchao
            from graphbuild.frontend.presets import QUANTIZER_PRESETS

            known = {*builtin, *QUANTIZER_PRESETS}
            if self.preset not in known:
                hint = _suggest(self.preset, known).replace("Known keys", "Known presets")
                raise ConfigError(
                    f"{self.where}: unknown quantization preset '{self.preset}'{hint}"
                )
            return self.preset
        if self.quantizer is None:
            return None
        from torchao.quantization.pt2e.quantizer import Quantizer

        obj = _resolve(self.quantizer, self.root, "quantizer")
        if not isinstance(obj, Quantizer) and callable(obj):
            obj = _call(obj, self.quantizer, "quantizer factory")
        if not isinstance(obj, Quantizer):
            raise ConfigError(
                f"quantizer {self.quantizer!r} gave {_kind(obj)}; expected a torchao "
                "Quantizer (torchao.quantization.pt2e.quantizer.Quantizer) or a zero-argument "
                "factory returning one"
            )
        return obj

    def export_options(self, calibration: list[Any] | None = None) -> Any:
        """Options for ``graphbuild.api``: the target's options dataclass, built from
        ``[options]``, the quantizer and the calibration batches."""
        target = get_target(self.target)
        options = dict(self.options)
        for key, value in options.items():
            kind = target.config_schema.get(key)
            if kind is not None and kind.imports:
                options[key] = self._imported(value, f"options.{key}")
        for key in ("input_names", "output_names"):
            if options.get(key) is not None:
                options[key] = tuple(options[key])
        quantizer = self.quantizer_object()
        names = target.option_names()
        for key, value in (("quantizer", quantizer), ("calibration", calibration)):
            if key in names:
                options[key] = value
            elif value is not None:
                raise ConfigError(
                    f"{self.where}: target '{target.name}' takes no {key}; see its options "
                    f"({', '.join(names)})"
                )
        try:
            return target.make_options(options)
        except ConfigError as err:
            raise ConfigError(f"{self.where}: [options] {err}") from err


def load_config(
    path: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
    overrides: Iterable[str | tuple[str, Any]] = (),
    *,
    required: bool = True,
) -> Config:
    """Find, read, override and validate the configuration.

    ``path`` names the file (``graphbuild.toml`` or a ``pyproject.toml``); without it the
    first one from ``cwd`` upward is used. ``overrides`` are ``"key=value"`` strings (as
    ``--set`` gives them; dotted keys reach into tables) or ``(key, value)`` pairs. With no
    file, a ``model`` override, or ``required=False``, stands in for one, rooted at ``cwd``.
    """
    here = Path(cwd or os.getcwd()).resolve()
    pairs = [parse_override(o) if isinstance(o, str) else tuple(o) for o in overrides]
    if path is not None:
        source: Path | None = (here / Path(path).expanduser()).resolve()
        if not source.is_file():
            raise ConfigError(f"config file {source} does not exist")
    else:
        source = find_config(here)
    if source is None:
        if required and not any(k == "model" for k, _ in pairs):
            raise ConfigError(
                f"no {CONFIG_FILE} (or [tool.graphbuild] in {PYPROJECT}) found in {here} or "
                f"any parent directory. Create {here / CONFIG_FILE}, for example:\n\n{_EXAMPLE}"
                "\nor pass --model path/to/model.py:build (or --config FILE)."
            )
        table: dict[str, Any] = {}
        root = here
    else:
        table = copy.deepcopy(_read_config(source))
        root = source.parent
    where = str(source) if source else "command line"
    _validate(table, where)
    dropped = _drop_model_keys(table, pairs, root)
    for key, value in pairs:
        _apply_override(table, key, value)
    _validate(table, f"{where} (with --set)" if pairs else where)
    return _build(table, root, source, dropped)


def _drop_model_keys(table: dict[str, Any], pairs: list[Any], root: Path) -> tuple[str, ...]:
    """When ``pairs`` name a model other than the file's, drop the file's keys that belong to
    its model (its calibration batches would not fit another model) unless ``pairs`` give them
    too; the names of the keys dropped."""
    models = [value for key, value in pairs if key == "model"]
    if not models or "model" not in table or _same_spec(models[-1], table["model"], root):
        return ()
    given = {key for key, _ in pairs}
    dropped = tuple(k for k in _MODEL_KEYS if k in table and k not in given)
    for key in dropped:
        del table[key]
    return dropped


def _same_spec(override: Any, spec: Any, root: Path) -> bool:
    """Whether two ``file.py:attr`` / ``module:attr`` specs name the same object (a file in
    the config file relative to its directory, on the command line absolute)."""
    if not isinstance(override, str) or not isinstance(spec, str):
        return False

    def normal(text: str) -> str:
        target, _, attr = text.rpartition(":")
        if _is_file(target) and "\0" not in target:
            target = str((root / Path(target).expanduser()).resolve())
        return f"{target}:{attr}"

    return normal(override) == normal(spec)


def _build(
    table: dict[str, Any], root: Path, source: Path | None, dropped: tuple[str, ...] = ()
) -> Config:
    where = str(source) if source else "command line"
    quant = table.get("quantization", {})
    if "preset" in quant and "quantizer" in quant:
        raise ConfigError(
            f"{where}: [quantization] sets both 'preset' and 'quantizer'; keep one of them"
        )
    for key in ("model", "samples", "calibration"):
        if key in table:
            _split(table[key], key)
    if "quantizer" in quant:
        _split(quant["quantizer"], "quantization.quantizer")
    model = table.get("model")
    name = table.get("model_name") or (_stem(model) if model else None)
    cache = table.get("cache", {})
    cache_dir = table.get("cache_dir")
    if cache_dir is not None and cache.get("dir", cache_dir) != cache_dir:
        raise ConfigError(
            f"{where}: 'cache_dir' and 'cache.dir' disagree ({cache_dir!r} and "
            f"{cache['dir']!r}); keep one"
        )
    cache_dir = cache.get("dir", cache_dir)
    target = table.get("target", DEFAULT_TARGET)
    options = dict(table.get("options", {}))
    for key in get_target(target).top_level_options:  # other targets' top-level keys: ignored
        if key not in table:
            continue
        if options.get(key, table[key]) != table[key]:
            raise ConfigError(
                f"{where}: '{key}' and 'options.{key}' disagree ({table[key]!r} and "
                f"{options[key]!r}); keep one"
            )
        options[key] = table[key]
    return Config(
        root=root,
        source=source,
        model=model,
        samples=table.get("samples"),
        calibration=table.get("calibration"),
        target=target,
        format=table.get("format") or get_target(target).default_format,
        model_name=name,
        output_dir=_path(root, table.get("output_dir", DEFAULT_OUTPUT_DIR)),
        cache_dir=_path(root, cache_dir) if cache_dir else None,
        cache_url=cache.get("url") or None,
        cache_readonly=cache.get("readonly", False),
        preset=quant.get("preset"),
        quantizer=quant.get("quantizer"),
        options=options,
        dropped=dropped,
    )


def _path(root: Path, value: str | os.PathLike) -> Path:
    _check_path_text(value)
    return (root / Path(value).expanduser()).resolve()


def _check_path_text(value: str | os.PathLike) -> None:
    if "\0" in os.fspath(value):
        raise ConfigError(f"the path {os.fspath(value)!r} contains a NUL character")


# --------------------------------------------------------------------------- specs


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
