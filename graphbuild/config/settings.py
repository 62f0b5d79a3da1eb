"""The validated configuration (:class:`Config`) and :func:`load_config`, which makes it.

A file's table and the command line's overrides are validated, then built into a frozen
:class:`Config` whose paths are absolute; its specs (the model factory, samples, calibration,
a quantizer) are imported only when asked for.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from graphbuild.config.files import CONFIG_FILE, PYPROJECT, _read_config, find_config
from graphbuild.config.overrides import _apply_override, parse_override
from graphbuild.config.schema import _suggest, _validate
from graphbuild.config.specs import (
    _call,
    _check_path_text,
    _is_file,
    _kind,
    _resolve,
    _split,
    _stem,
)
from graphbuild.config.targets import resolve_for_target, warn_ignored
from graphbuild.errors import ConfigError
from graphbuild.targets.registry import DEFAULT_TARGET, get_target

DEFAULT_OUTPUT_DIR = "graphbuild-out"

_EXAMPLE = f"""\
    # {CONFIG_FILE}
    model = "path/to/model.py:build"      # returns a module, or (module, sample_inputs)
    calibration = "path/to/model.py:calibration"   # optional: a list of batches
    [quantization]
    preset = "w8a16"                       # or quantizer = "module:attr"
"""


#: What belongs to the file's model: a model given on the command line (``--model``, or
#: ``--set model=...``) drops these from the file unless they are given there too.
_MODEL_KEYS = ("samples", "calibration", "model_name")

#: Who runs :meth:`Config.load_model`: None builds the model each time; the build server
#: (``graphbuild.server``) sets a loader that keeps built models between commands. It is
#: called with the config and the function that builds (model, samples, calibration).
model_loader: Callable[[Config, Callable[[], tuple[Any, Any, list[Any] | None]]], Any] | None = None


@dataclass(frozen=True)
class Config:
    """A validated configuration. Paths are absolute; specs are imported on demand.

    ``options`` holds the configured target's options, those given at the top level of the
    file (``Target.top_level_options``) included. ``dropped`` names the file's keys that
    belonged to its model (``samples``, ``calibration``, ``model_name``) and were left out
    because the command line named another model. ``sweep`` is the file's ``[sweep]`` table
    as written (``graphbuild sweep`` reads it)."""

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
    cache_lease_seconds: float | None = None
    #: ``[build]``: stages at once (None: unset, and 0: "auto", one per core) and
    #: their memory budget in bytes (None: "auto")
    build_jobs: int | None = None
    build_memory: int | None = None
    preset: str | None = None
    quantizer: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()
    #: what the exported target ignores of the file's shared keys, one message each (each
    #: also warned once when the configuration is loaded)
    ignored: tuple[str, ...] = ()
    #: keys the command line set (``--set`` and flags), as the table spells them
    overridden: frozenset[str] = frozenset()
    sweep: Mapping[str, Any] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        """The scheduler's run id for this export, as ``graphbuild.api`` forms it."""
        return f"{self.target}:{self.model_name}"

    @property
    def where(self) -> str:
        return str(self.source) if self.source else "command line"

    def where_of(self, key: str) -> str:
        """Where ``key``'s value came from: the file, or the file ``(with --set)`` when the
        command line set that key (or one inside it), so an error blames the right place."""
        given = any(k == key or k.startswith(f"{key}.") for k in self.overridden)
        return f"{self.where} (with --set)" if given and self.source else self.where

    # ----------------------------------------------------------------- imports

    def load_model(self) -> tuple[Any, Any, list[Any] | None]:
        """Import and call the model factory: ``(model, sample_inputs, calibration)``
        (through :data:`model_loader` when one is set)."""
        if model_loader is not None:
            return model_loader(self, self.build_model)
        return self.build_model()

    def build_model(self) -> tuple[Any, Any, list[Any] | None]:
        """Call the model factory and the calibration factory, every time."""
        model, samples = self.load_model_and_samples()
        return model, samples, self.load_calibration()

    def load_model_and_samples(self) -> tuple[Any, Any]:
        """Import and call the model factory: ``(model, sample_inputs)``."""
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
        return model, samples

    def load_calibration(self) -> list[Any] | None:
        """The calibration batches the config names (None when it names none)."""
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
        return calibration

    def _value(self, spec: str, key: str) -> Any:
        obj = _resolve(spec, self.root, key)
        return _call(obj, spec, key) if callable(obj) else obj

    def _imported(self, value: str | Mapping[str, str], key: str) -> Any:
        """What an ``imports`` option names: one spec's object, or a table of them."""
        if isinstance(value, str):
            return self._value(value, key)
        return {name: self._value(spec, f"{key}.{name}") for name, spec in value.items()}

    def check(self) -> None:
        """What can be checked before torch, the target's stages or the model are imported:
        the format, the quantization preset, and that the files the specs name exist. A
        typo is then an error in a fraction of a second, not after seconds of imports and
        the model's construction; the command line calls this first."""
        target = get_target(self.target)
        if self.format not in target.formats:
            hint = _suggest(str(self.format), target.formats).replace("Known keys", "Formats")
            raise ConfigError(
                f"{self.where_of('format')}: target '{target.name}' has no format "
                f"'{self.format}'{hint} (graphbuild targets)"
            )
        if self.preset is not None:
            self.checked_preset()
        for key in ("model", "samples", "calibration"):
            spec = getattr(self, key)
            if spec:
                self._check_file(spec, key)
        if self.quantizer:
            self._check_file(self.quantizer, "quantization.quantizer")

    def _check_file(self, spec: str, key: str) -> None:
        """A ``file.py:name`` spec's file exists (a module spec is found when imported)."""
        target, _ = _split(spec, key)
        if not _is_file(target):
            return
        _check_path_text(target)
        path = (self.root / Path(target).expanduser()).resolve()
        if not path.is_file():
            raise ConfigError(
                f"{self.where_of(key)}: no such {key.rpartition('.')[2]} file {path} "
                f"({key} = {spec!r}); give the path of an existing Python file"
            )

    def checked_preset(self) -> str | None:
        """The configured preset's name, once known to be the target's own or a registered
        one (neither torch nor torchao is imported); None when the target picks its own
        quantization instead of another target's preset."""
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
            # registered ones: none until something imported the registry (importing it
            # here would import graphbuild.frontend, and torch with it)
            presets = sys.modules.get("graphbuild.frontend.presets")
            known = {*builtin, *getattr(presets, "QUANTIZER_PRESETS", {})}
            if self.preset not in known:
                hint = _suggest(self.preset, known).replace("Known keys", "Known presets")
                raise ConfigError(
                    f"{self.where_of('quantization.preset')}: unknown quantization preset "
                    f"'{self.preset}'{hint}"
                )
            return self.preset
        return None

    def quantizer_object(self) -> Any:
        """The configured quantizer: a preset name, a torchao Quantizer, or None."""
        if self.preset is not None:
            return self.checked_preset()
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
            raise ConfigError(f"{self.where_of('options')}: [options] {err}") from err


def load_config(
    path: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
    overrides: Iterable[str | tuple[str, Any]] = (),
    *,
    required: bool = True,
    search: bool = True,
) -> Config:
    """Find, read, override and validate the configuration.

    ``path`` names the file (``graphbuild.toml`` or a ``pyproject.toml``); without it the
    first one from ``cwd`` upward is used (``search=False``: none is). ``overrides`` are
    ``"key=value"`` strings (as ``--set`` gives them; dotted keys reach into tables) or
    ``(key, value)`` pairs. With no file, a ``model`` override, or ``required=False``, stands
    in for one, rooted at ``cwd``.
    """
    here = Path(cwd or os.getcwd()).resolve()
    pairs = [parse_override(o) if isinstance(o, str) else tuple(o) for o in overrides]
    if path is not None:
        source: Path | None = (here / Path(path).expanduser()).resolve()
        if not source.is_file():
            raise ConfigError(f"config file {source} does not exist")
    else:
        source = find_config(here) if search else None
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
    file_target = table.get("target", DEFAULT_TARGET)
    dropped = _drop_model_keys(table, pairs, root)
    overridden = frozenset(_apply_override(table, key, value) for key, value in pairs)
    _validate(table, f"{where} (with --set)" if pairs else where, overridden)
    table, ignored = resolve_for_target(table, where, overridden, file_target)
    warn_ignored(ignored)
    return replace(
        _build(table, root, source, dropped), overridden=overridden, ignored=tuple(ignored)
    )


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
    from graphbuild.engine.sizes import parse_memory  # checked by _validate

    cache = table.get("cache", {})
    build = table.get("build", {})
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
        cache_lease_seconds=cache.get("lease_seconds"),
        build_jobs=0 if build.get("jobs") == "auto" else build.get("jobs"),
        build_memory=parse_memory(build.get("memory", "auto")),
        preset=quant.get("preset"),
        quantizer=quant.get("quantizer"),
        options=options,
        dropped=dropped,
        sweep=dict(table.get("sweep", {})),
    )


def _path(root: Path, value: str | os.PathLike) -> Path:
    _check_path_text(value)
    return (root / Path(value).expanduser()).resolve()
