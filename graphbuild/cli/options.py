"""Options the commands share, and the config, cache and request they turn into."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from graphbuild.cli.output import debug_enabled
from graphbuild.config import Config, load_config
from graphbuild.errors import ConfigError

if TYPE_CHECKING:
    from graphbuild.api import ExportRequest
    from graphbuild.engine.artifact_store import Cache
    from graphbuild.engine.events import StageEvent
    from graphbuild.engine.pipeline import Pipeline

__all__ = [
    "CacheDirOpt",
    "CacheReadonlyOpt",
    "CacheUrlOpt",
    "ConfigOpt",
    "FormatOpt",
    "JsonOpt",
    "ModelOpt",
    "NameOpt",
    "NoCacheOpt",
    "OutputOpt",
    "SetOpt",
    "TargetOpt",
    "build_request",
    "cli_overrides",
    "load_cli_config",
    "open_cache",
    "quiet_torch",
    "resolve_cache_path",
    "resolve_cache_url",
]


def quiet_torch() -> None:
    """torch sets its loggers' levels when it is imported: lower them after that. Called by
    the commands that build a pipeline (which imports torch anyway), never by those that only
    read the config or the cache: they start without torch."""
    if debug_enabled():
        return
    import logging

    import torch  # noqa: F401 - its import sets the levels lowered here

    logging.getLogger("torch").setLevel(logging.ERROR)


JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document to stdout.")]
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="Config file (graphbuild.toml or pyproject.toml)."),
]
TargetOpt = Annotated[
    str | None,
    typer.Option("--target", "-t", help="Export target: qnn, executorch (graphbuild targets)."),
]
FormatOpt = Annotated[
    str | None,
    typer.Option(
        "--format", "-f", help="Target format, e.g. onnx, onnx_qdq, xnnpack (the target's first)."
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Model factory: path/to/file.py:build or pkg.mod:build."),
]
OutputOpt = Annotated[
    Path | None, typer.Option("--output-dir", "-o", help="Where the exported files go.")
]
NameOpt = Annotated[str | None, typer.Option("--name", help="Model name (file stem).")]
CacheDirOpt = Annotated[Path | None, typer.Option("--cache-dir", help="Cache directory.")]
CacheUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--cache-url",
        help="Shared cache in front of which the local one sits: redis://host:port/db "
        "(else [cache] url, else $GRAPHBUILD_CACHE_URL).",
    ),
]
CacheReadonlyOpt = Annotated[
    bool,
    typer.Option(
        "--cache-readonly",
        help="Read the shared cache (the directory without a URL) but never write to it.",
    ),
]
NoCacheOpt = Annotated[bool, typer.Option("--no-cache", help="Build without a cache.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="KEY=VALUE",
        help="Override a config key, e.g. options.opset=17 (repeatable).",
    ),
]


def load_cli_config(
    config: Path | None,
    *,
    target: str | None = None,
    format: str | None = None,
    model: str | None = None,
    output_dir: Path | None = None,
    name: str | None = None,
    sets: Sequence[str] | None = None,
    required: bool = True,
) -> Config:
    """The config file with command-line flags applied over it; paths given on the command
    line are relative to the working directory, those in the file to the file's directory."""
    cwd = Path.cwd()
    overrides = cli_overrides(
        cwd, target=target, format=format, model=model, output_dir=output_dir, name=name, sets=sets
    )
    cfg = load_config(config, cwd, overrides, required=required)
    if cfg.dropped:
        typer.echo(
            f"note: --model replaces the model of {cfg.where}, so its "
            f"{', '.join(cfg.dropped)} {'is' if len(cfg.dropped) == 1 else 'are'} not used"
            + (
                "; calibration falls back to the sample inputs (--set calibration=FILE.py:fn)"
                if "calibration" in cfg.dropped
                else ""
            ),
            err=True,
        )
    return cfg


def cli_overrides(
    cwd: Path,
    *,
    target: str | None = None,
    format: str | None = None,
    model: str | None = None,
    output_dir: Path | None = None,
    name: str | None = None,
    sets: Sequence[str] | None = None,
) -> list[Any]:
    """The config overrides the flags make (``--set`` pairs first, then the flags)."""
    overrides: list[Any] = list(sets or [])
    if model is not None:
        overrides.append(("model", absolute_spec(model, cwd)))
    for key, value in (("target", target), ("format", format), ("model_name", name)):
        if value is not None:
            overrides.append((key, value))
    if output_dir is not None:
        overrides.append(("output_dir", str((cwd / output_dir.expanduser()).resolve())))
    return overrides


def absolute_spec(spec: str, cwd: Path) -> str:
    target, sep, attr = spec.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target or "\\" in target):
        return f"{(cwd / Path(target).expanduser()).resolve()}:{attr}"
    return spec


def resolve_cache_path(cache_dir: Path | None, cfg: Config | None) -> Path:
    from graphbuild.cache import default_cache_dir

    if cache_dir is not None:
        return cache_dir.expanduser().resolve()
    if cfg is not None and cfg.cache_dir is not None:
        return cfg.cache_dir
    return default_cache_dir()


def resolve_cache_url(url: str | None, cfg: Config | None) -> str | None:
    """--cache-url, else ``[cache] url``, else ``$GRAPHBUILD_CACHE_URL``."""
    from graphbuild.cache.remote import default_cache_url

    if url:
        return url
    if cfg is not None and cfg.cache_url:
        return cfg.cache_url
    return default_cache_url()


def open_cache(
    cache_dir: Path | None,
    no_cache: bool,
    cfg: Config | None,
    *,
    url: str | None = None,
    readonly: bool = False,
) -> Cache | None:
    """The cache an export or a plan uses: the local directory, in front of the shared cache
    when a URL is given or configured. ``readonly`` (or ``[cache] readonly``) applies to the
    shared cache, or to the directory when there is none."""
    from graphbuild.engine.artifact_store import Cache

    if no_cache:
        if cache_dir is not None or url is not None:
            given = "--cache-dir" if cache_dir is not None else "--cache-url"
            raise ConfigError(f"--no-cache and {given} contradict each other; give one")
        return None
    shared = resolve_cache_url(url, cfg)
    readonly = readonly or (cfg is not None and cfg.cache_readonly)
    cache = Cache(
        resolve_cache_path(cache_dir, cfg),
        readonly=readonly and not shared,
        url=shared,
        remote_readonly=readonly,
    )
    if cfg is not None and cfg.cache_lease_seconds is not None:
        cache.lease_seconds = float(cfg.cache_lease_seconds)
    return cache


def build_request(
    cfg: Config,
    cache: Cache | None,
    *,
    load_model: bool = True,
    force: Any = (),
    listeners: Sequence[Callable[[StageEvent], None]] = (),
) -> tuple[ExportRequest, Pipeline]:
    """The export request the config describes and its pipeline (built before anything runs,
    so an unknown target, format or option is a configuration error), made as a sweep makes
    each variant's (:func:`graphbuild.config.request.export_request`)."""
    cfg.check()  # before torch is imported: a typo is answered at once
    quiet_torch()
    from graphbuild.config.request import export_request

    if not cfg.model_name:
        raise ConfigError(
            f'no model configured in {cfg.where}: set model = "path/to/model.py:build" '
            "or pass --model path/to/model.py:build"
        )
    model, samples, calibration = cfg.load_model() if load_model else (None, None, None)
    return export_request(
        cfg, model, samples, calibration, cache=cache, force=force, listeners=listeners
    )
