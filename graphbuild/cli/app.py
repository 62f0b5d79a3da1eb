"""The command line: ``graphbuild export | status | explain | graph | targets | cache ...``.

Library code raises typed errors; this module alone turns them into messages and exit codes:
0 success, 1 a stage failed (or the build broke while running), 2 bad usage or configuration.
``--json`` on every command prints exactly one JSON document to stdout, errors included.
``GRAPHBUILD_DEBUG=1`` adds the traceback to any error.

Progress comes from the scheduler's :class:`~graphbuild.engine.scheduler.StageEvent` stream: on a
terminal a spinner while a stage runs and one line per stage as it finishes; elsewhere (a pipe,
a CI log) the same lines without spinners or colour. Torch and the export machinery are
imported only by the commands that need them, so ``graphbuild cache ...`` starts quickly.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import json
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperCommand

from graphbuild.config import Config, load_config
from graphbuild.errors import (
    CacheError,
    ConfigError,
    ExportError,
    GraphbuildError,
    PipelineError,
    StageError,
)

if TYPE_CHECKING:
    from graphbuild.api import ExportRequest
    from graphbuild.cache import Cache, MaintenanceReport
    from graphbuild.engine.pipeline import Pipeline
    from graphbuild.engine.scheduler import RunReport, StageEvent

__all__ = ["app", "main", "Progress", "human_size", "parse_size", "parse_age"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

app = typer.Typer(
    name="graphbuild",
    help="Incremental, content-addressed export of quantized PyTorch models to QNN.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(
    help="Inspect and maintain the build cache.", no_args_is_help=True, add_completion=False
)
app.add_typer(cache_app, name="cache")


def _quiet_libraries() -> None:
    """torch, torchao and onnxscript print deprecation notes and optional-package warnings
    that say nothing about the user's export; GRAPHBUILD_DEBUG=1 shows them."""
    if _debug():
        return
    import logging
    import warnings

    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings(
            "ignore", category=category, module=r"(torch|torchao|onnx|onnxscript|copyreg)"
        )
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for name in ("torchao", "onnxscript"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _quiet_torch() -> None:
    """torch sets its loggers' levels when it is imported: lower them after that."""
    if _debug():
        return
    import logging

    import torch  # noqa: F401 - the export needs it anyway

    logging.getLogger("torch").setLevel(logging.ERROR)


def main() -> None:
    """Console-script entry point (``graphbuild``, ``python -m graphbuild``)."""
    _quiet_libraries()
    app(prog_name="graphbuild")


# --------------------------------------------------------------------------- output


def _console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr); tests replace this to capture terminal output."""
    return Console(
        stderr=stderr,
        no_color=True if os.environ.get("NO_COLOR") else None,
        highlight=False,
        soft_wrap=True,
    )


def _debug() -> bool:
    return os.environ.get("GRAPHBUILD_DEBUG", "").lower() not in ("", "0", "false", "no")


def _emit_json(doc: Any) -> None:
    typer.echo(json.dumps(doc, indent=2, default=str))


def human_size(n: float) -> str:
    """``12.3 MiB``: binary units, one decimal above a KiB."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_AGE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """``500M``, ``2G``, ``1.5GiB``, ``1024`` (bytes) -> bytes; units are binary."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"{text!r} is not a size; use e.g. 500M, 2G or 1024 (bytes)")
    number, unit = float(match.group(1)), match.group(2).lower()
    size = number * 1024 ** " kmgt".index(unit or " ")
    if not math.isfinite(size) or size > 2**62:
        raise ConfigError(f"{text!r} is too large a size")
    return int(size)


def parse_age(text: str) -> float:
    """``30m``, ``12h``, ``7d``, ``2w``, ``90`` (seconds) -> seconds."""
    match = _AGE.match(text)
    if not match:
        raise ConfigError(f"{text!r} is not an age; use e.g. 30m, 12h or 7d")
    return float(match.group(1)) * _AGE_UNITS[match.group(2).lower()]


def _ago(then: float) -> str:
    if not then:
        return "never"
    s = max(0.0, time.time() - then)
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= span:
            return f"{s / span:.0f} {unit} ago"
    return f"{s:.0f} s ago"


# --------------------------------------------------------------------------- errors


def _exit_code(err: BaseException) -> int:
    if isinstance(err, StageError):
        return EXIT_FAILED
    if isinstance(err, (ConfigError, ExportError, PipelineError, CacheError)):
        return EXIT_USAGE
    return EXIT_FAILED


def _report_error(err: BaseException, as_json: bool) -> int:
    code = _exit_code(err)
    known = isinstance(err, (GraphbuildError, OSError))
    if _debug():
        cause = err.cause if isinstance(err, StageError) else err
        traceback.print_exception(type(cause), cause, cause.__traceback__, file=sys.stderr)
    if as_json:
        doc: dict[str, Any] = {
            "error": {
                "type": type(err).__name__,
                "message": str(err),
                "exit_code": code,
                "stage": getattr(err, "stage", None),
            }
        }
        report = getattr(err, "report", None)
        if report is not None:
            doc["stages"] = [_stage_json(s) for s in report.stages]
        _emit_json(doc)
        return code
    message = Text("error: ", style="bold red")
    message.append(str(err) if known else f"unexpected {type(err).__name__}: {err}")
    if not _debug() and (isinstance(err, StageError) or not known):
        message.append("\n(set GRAPHBUILD_DEBUG=1 to see the traceback)", style="dim")
    _console(stderr=True).print(message)
    return code


def _cli_errors() -> tuple[type[BaseException], ...]:
    """Exceptions the command-line framework handles itself (usage errors, exits). typer
    0.29 vendors click; older releases use the click package."""
    errors: list[type[BaseException]] = [typer.Exit, typer.Abort]
    vendored = getattr(getattr(typer, "exceptions", None), "TyperException", None)
    if vendored is not None:
        errors.append(vendored)
    try:
        import click
    except ImportError:
        pass
    else:
        errors += [click.exceptions.ClickException, click.exceptions.Abort]
    return tuple(errors)


_CLI_ERRORS = _cli_errors()


def _handles_errors(fn: Callable[..., None]) -> Callable[..., None]:
    """Run a command, turning expected errors into a message (or JSON) and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        as_json = bool(kwargs.get("as_json"))
        try:
            fn(*args, **kwargs)
        except _CLI_ERRORS:
            raise
        except Exception as err:
            raise typer.Exit(_report_error(err, as_json)) from None

    return wrapper


# --------------------------------------------------------------------------- shared options

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


def _load(
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
    _quiet_torch()
    cwd = Path.cwd()
    overrides: list[Any] = list(sets or [])
    if model is not None:
        overrides.append(("model", _absolute_spec(model, cwd)))
    for key, value in (("target", target), ("format", format), ("model_name", name)):
        if value is not None:
            overrides.append((key, value))
    if output_dir is not None:
        overrides.append(("output_dir", str((cwd / output_dir.expanduser()).resolve())))
    return load_config(config, cwd, overrides, required=required)


def _absolute_spec(spec: str, cwd: Path) -> str:
    target, sep, attr = spec.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target or "\\" in target):
        return f"{(cwd / Path(target).expanduser()).resolve()}:{attr}"
    return spec


def _cache_path(cache_dir: Path | None, cfg: Config | None) -> Path:
    from graphbuild.cache import default_cache_dir

    if cache_dir is not None:
        return cache_dir.expanduser().resolve()
    if cfg is not None and cfg.cache_dir is not None:
        return cfg.cache_dir
    return default_cache_dir()


def _open_cache(cache_dir: Path | None, no_cache: bool, cfg: Config | None) -> Cache | None:
    from graphbuild.cache import Cache

    if no_cache:
        if cache_dir is not None:
            raise ConfigError("--no-cache and --cache-dir contradict each other; give one")
        return None
    return Cache(_cache_path(cache_dir, cfg))


def _request(
    cfg: Config,
    cache: Cache | None,
    *,
    load_model: bool = True,
    force: Any = (),
    listeners: Sequence[Callable[[StageEvent], None]] = (),
) -> tuple[ExportRequest, Pipeline]:
    """The export request the config describes and its pipeline (built before anything runs,
    so an unknown target, format or option is a configuration error)."""
    from graphbuild.api import ExportRequest, build_pipeline

    if not cfg.model_name:
        raise ConfigError(
            f'no model configured in {cfg.where}: set model = "path/to/model.py:build" '
            "or pass --model path/to/model.py:build"
        )
    model, samples, calibration = cfg.load_model() if load_model else (None, None, None)
    request = ExportRequest(
        model,
        samples,
        cfg.output_dir,
        cfg.model_name,
        target=cfg.target,
        format=cfg.format,
        options=cfg.export_options(calibration),
        cache=cache if cache is not None else False,
        force=force,
        listeners=listeners,
    )
    pipeline = build_pipeline(request)
    return replace(request, pipeline_factory=lambda _request: pipeline), pipeline


def _stage_json(rec: Any) -> dict[str, Any]:
    return {
        "name": rec.name,
        "status": rec.status,
        "seconds": rec.seconds,
        "key": rec.key,
        "reason": rec.reason,
    }


# --------------------------------------------------------------------------- progress

_STYLES = {
    "hit": ("✓", "green"),
    "cutoff": ("≈", "cyan"),
    "ran": ("●", "yellow"),
    "failed": ("✗", "bold red"),
    "skipped": ("-", "dim"),
}


class Progress:
    """A run listener that shows each stage as it finishes.

    On a terminal: a spinner naming the running stage (and why it runs) and a coloured line
    per finished stage. Elsewhere: one plain line per stage. ``quiet``: nothing per stage."""

    def __init__(self, console: Console, quiet: bool = False):
        self.console = console
        self.quiet = quiet
        self.live = console.is_terminal and not quiet
        self._status: Any = None

    def __enter__(self) -> Progress:
        if self.live:
            self._status = self.console.status("planning…", spinner="dots")
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def _spin(self, text: str) -> None:
        if self._status is not None:
            self._status.update(text)

    def __call__(self, event: StageEvent) -> None:
        kind = event.kind.value
        if kind == "started":
            why = f" ({event.reason})" if event.reason else ""
            self._spin(f"[bold]{event.stage}[/] running…{_escape(why)}")
            return
        if kind == "loaded":
            self._spin(f"loaded {event.stage} from the cache")
            return
        if self.quiet or kind not in _STYLES:
            return
        self.console.print(self.line(event))
        self._spin("working…")

    def line(self, event: StageEvent) -> Text:
        """``capture          ran        2.31 s  ctx.quantizer: w8a16 -> w8a8``."""
        kind = event.kind.value
        symbol, style = _STYLES[kind]
        text = Text()
        if self.live:
            text.append(f"{symbol} ", style=style)
        text.append(f"{event.stage:<16} ")
        text.append(f"{kind:<7}", style=style if self.live else "")
        if kind in ("ran", "failed"):
            text.append(f" {event.seconds:7.2f} s")
        detail = event.reason
        if kind == "failed" and event.error is not None:
            detail = f"{type(event.error).__name__}: {event.error}"
        elif kind == "cutoff":
            detail = "early cutoff: upstream output unchanged"
        if detail:
            text.append(f"  {detail}", style="dim" if self.live else "")
        text.rstrip()
        return text

    def summary(self, report: RunReport, seconds: float) -> Text:
        cutoff = len(report.with_status("cutoff"))
        text = Text(
            f"{len(report.ran)} ran, {len(report.hits)} hit, saved {report.seconds_saved:.1f} s",
            style="bold" if self.live else "",
        )
        if cutoff:
            text.append(f" ({cutoff} early cutoff)")
        text.append(f" in {seconds:.2f} s")
        return text


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


# --------------------------------------------------------------------------- export


class _ExportCommand(TyperCommand):
    """``--force`` takes an optional value: a bare ``--force`` forces every stage."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        out = []
        for i, arg in enumerate(args):
            nxt = args[i + 1] if i + 1 < len(args) else None
            if arg == "--force" and (nxt is None or nxt.startswith("-")):
                out.append("--force=all")
            else:
                out.append(arg)
        return super().parse_args(ctx, out)


def _forced(force: Sequence[str] | None, pipeline: Pipeline) -> Any:
    if not force:
        return ()
    if any(f in ("all", "*") for f in force):
        return True
    stages = pipeline.order()
    unknown = [f for f in force if f not in stages]
    if unknown:
        raise ConfigError(
            f"cannot force unknown stage(s) {', '.join(unknown)}; "
            f"stages of {pipeline.name}: {', '.join(stages)}"
        )
    return list(force)


@app.command(cls=_ExportCommand)
@_handles_errors
def export(
    target: TargetOpt = None,
    format: FormatOpt = None,
    config: ConfigOpt = None,
    model: ModelOpt = None,
    output_dir: OutputOpt = None,
    name: NameOpt = None,
    cache_dir: CacheDirOpt = None,
    no_cache: NoCacheOpt = False,
    force: Annotated[
        list[str] | None,
        typer.Option(
            "--force",
            help="Rerun STAGE even on a hit (repeatable); a bare --force reruns every stage.",
            metavar="[STAGE]",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would run (like status).")
    ] = False,
    check_fingerprints: Annotated[
        bool,
        typer.Option(
            "--check-fingerprints",
            help="Recompute stages that hit and fail if any output differs from the cache.",
        ),
    ] = False,
    as_json: JsonOpt = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Only errors and the files written.")
    ] = False,
    sets: SetOpt = None,
) -> None:
    """Build the model named in graphbuild.toml (or --model) for a target and format."""
    cfg = _load(
        config,
        target=target,
        format=format,
        model=model,
        output_dir=output_dir,
        name=name,
        sets=sets,
    )
    cache = _open_cache(cache_dir, no_cache, cfg)
    if dry_run:
        _show_status(cfg, cache, as_json)
        return
    from graphbuild.api import export_with_pipeline

    console = _console()
    progress = Progress(console, quiet=quiet or as_json)
    request, pipeline = _request(cfg, cache, listeners=[] if as_json else [progress])
    request.force = _forced(force, pipeline)
    request.check_fingerprints = check_fingerprints
    quiet_stdout = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    t0 = time.perf_counter()
    try:
        with quiet_stdout, progress:
            artifacts = export_with_pipeline(request)
    except StageError as err:
        report = getattr(err, "report", None)
        if report is not None and not as_json and not quiet:
            console.print(progress.summary(report, time.perf_counter() - t0))
        raise
    report = artifacts.report
    files = {kind: str(path) for kind, path in artifacts.files.items()}
    if as_json:
        _emit_json(
            {
                "target": cfg.target,
                "format": cfg.format,
                "model_name": cfg.model_name,
                "output_dir": str(artifacts.output_directory),
                "seconds": report.seconds,
                "seconds_saved": report.seconds_saved,
                "stages": [_stage_json(s) for s in report.stages],
                "files": files,
                "reports": _json_safe(report.extra),
            }
        )
        return
    if quiet:
        for path in files.values():
            console.print(path, markup=False)
        return
    console.print(progress.summary(report, report.seconds))
    for line in _report_lines(report.extra):
        console.print(Text(f"  {line}"))
    for kind, path in files.items():
        console.print(Text(f"  {kind:<10} {path}"))


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as strings ("inf", "nan"): JSON has no spelling for
    them, and readers other than Python's reject ``Infinity``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _report_lines(extra: Mapping[str, Any]) -> list[str]:
    """One line per report an export made (delegation, numerics), for people."""
    lines = []
    delegation = extra.get("delegation")
    if isinstance(delegation, Mapping):
        lines.append(
            f"delegation {delegation.get('delegated_ops', 0)} ops delegated in "
            f"{delegation.get('delegated_subgraphs', 0)} subgraph(s), "
            f"{delegation.get('portable_ops', 0)} on portable kernels"
        )
    numerics = extra.get("numerics")
    if isinstance(numerics, Mapping):
        for out in numerics.get("outputs", []):
            lines.append(
                f"numerics   {out.get('name')}: SQNR {out.get('sqnr_db', float('nan')):.1f} dB, "
                f"max abs error {out.get('max_abs_error', float('nan')):.3g}"
            )
    return lines


# --------------------------------------------------------------------------- status


def _show_status(cfg: Config, cache: Cache | None, as_json: bool) -> None:
    from graphbuild.api import status

    request, _ = _request(cfg, cache)
    report = status(request)
    dirty = report.with_status("dirty")
    if as_json:
        _emit_json(
            {
                "target": cfg.target,
                "format": cfg.format,
                "model_name": cfg.model_name,
                "run_id": report.run_id,
                "cache": str(cache.path) if cache is not None else None,
                "up_to_date": not dirty,
                "dirty": dirty,
                "stages": [
                    {
                        "name": s.name,
                        "status": s.status,
                        "key": s.key,
                        "reason": s.reason,
                        "changes": [asdict(c) for c in s.changes],
                    }
                    for s in report.stages
                ],
            }
        )
        return
    console = _console()
    styles = {"hit": "green", "dirty": "yellow", "maybe": "cyan"}
    for s in report.stages:
        line = Text(f"{s.name:<16} ")
        line.append(f"{s.status:<6}", style=styles.get(s.status, ""))
        if s.reason:
            line.append(f"  {s.reason}")
        console.print(line)
    counts = {k: len(report.with_status(k)) for k in ("dirty", "maybe", "hit")}
    if not dirty:
        console.print(Text("up to date: an export would run nothing", style="bold"))
    else:
        console.print(
            Text(", ".join(f"{n} {k}" for k, n in counts.items() if n), style="bold"),
        )


@app.command()
@_handles_errors
def status(
    target: TargetOpt = None,
    format: FormatOpt = None,
    config: ConfigOpt = None,
    model: ModelOpt = None,
    name: NameOpt = None,
    cache_dir: CacheDirOpt = None,
    no_cache: NoCacheOpt = False,
    as_json: JsonOpt = False,
    sets: SetOpt = None,
) -> None:
    """What an export would run, and why; nothing is executed."""
    cfg = _load(config, target=target, format=format, model=model, name=name, sets=sets)
    _show_status(cfg, _open_cache(cache_dir, no_cache, cfg), as_json)


# --------------------------------------------------------------------------- explain


@app.command()
@_handles_errors
def explain(
    stage: Annotated[str | None, typer.Argument(help="Only this stage.")] = None,
    target: TargetOpt = None,
    format: FormatOpt = None,
    config: ConfigOpt = None,
    model: ModelOpt = None,
    name: NameOpt = None,
    cache_dir: CacheDirOpt = None,
    as_json: JsonOpt = False,
    sets: SetOpt = None,
) -> None:
    """What changed since the last run, stage by stage (reads with old and new values)."""
    cfg = _load(config, target=target, format=format, model=model, name=name, sets=sets)
    cache = _open_cache(cache_dir, False, cfg)
    request, pipeline = _request(cfg, cache)
    if stage is not None and stage not in pipeline:
        raise ConfigError(
            f"no stage named '{stage}' in {pipeline.name}; stages: {', '.join(pipeline.order())}"
        )
    from graphbuild.engine.plan import explain_plan

    stages = explain_plan(
        pipeline,
        request.model,
        request.data,
        context=request.context(),
        cache=cache,  # type: ignore[arg-type]
        run_id=request.run_id(),
        only=stage,
    )
    if as_json:
        _emit_json({"run_id": request.run_id(), "cache": str(cache.path), "stages": stages})
        return
    console = _console()
    for s in stages:
        head = Text(f"{s['name']:<16} ", style="bold")
        head.append(f"{s['status']:<6}")
        last = s["last_run"]
        if last:
            head.append(f"  last run {_ago(last['when'] or 0)}: {last['status']}", style="dim")
        console.print(head)
        for c in s["changes"]:
            console.print(Text(f"    {c['read']}: {_short(c['old'])} -> {_short(c['new'])}"))
        pending = ", ".join(s["dirty_upstream"])
        if not s["changes"] or pending:
            note = s["reason"] if not s["changes"] else f"also downstream of dirty {pending}"
            console.print(Text(f"    {note}", style="dim"))


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 100 else text[:97] + "..."


# --------------------------------------------------------------------------- graph & targets


class GraphStyle(str, enum.Enum):
    text = "text"
    dot = "dot"
    mermaid = "mermaid"


def _graph_doc(pipeline: Pipeline) -> dict[str, Any]:
    products = set(pipeline.products)
    return {
        "pipeline": pipeline.name,
        "stages": [
            {
                "name": s.name,
                "depends_on": pipeline.dependencies(s.name),
                "reads": list(s.reads) if s.reads is not None else None,
                "product": s.name in products,
            }
            for s in pipeline.stages
        ],
    }


def _reads_label(reads: list[str] | None) -> str:
    if reads is None:
        return "everything (undeclared)"
    return ", ".join(reads) or "upstream outputs only"


def _render_graph(doc: dict[str, Any], style: str) -> str:
    stages = doc["stages"]
    if style == "dot":
        lines = [f'digraph "{doc["pipeline"]}" {{', "  rankdir=LR;", "  node [shape=box];"]
        for s in stages:
            label = f"{s['name']}\\n{_reads_label(s['reads'])}"
            shape = ", peripheries=2" if s["product"] else ""
            lines.append(f'  "{s["name"]}" [label="{label}"{shape}];')
        for s in stages:
            lines += [f'  "{d}" -> "{s["name"]}";' for d in s["depends_on"]]
        return "\n".join([*lines, "}"])
    if style == "mermaid":
        lines = ["flowchart LR"]
        for s in stages:
            label = f"{s['name']}<br/><small>{_reads_label(s['reads'])}</small>"
            lines.append(f'  {s["name"]}["{label}"]')
        for s in stages:
            lines += [f"  {d} --> {s['name']}" for d in s["depends_on"]]
        return "\n".join(lines)
    width = max(len(s["name"]) for s in stages) + 2
    lines = [f"{doc['pipeline']}: {len(stages)} stages"]
    for s in stages:
        after = ", ".join(s["depends_on"]) or "(model input)"
        mark = " *" if s["product"] else ""
        lines.append(f"  {s['name'] + mark:<{width}} after {after}")
        lines.append(f"  {'':<{width}} reads {_reads_label(s['reads'])}")
    lines.append("  (* placed in the output directory)")
    return "\n".join(lines)


@app.command()
@_handles_errors
def graph(
    style: Annotated[
        GraphStyle, typer.Option("--format", "-f", help="Output: text, dot or mermaid.")
    ] = GraphStyle.text,
    target: TargetOpt = None,
    export_format: Annotated[
        str | None, typer.Option("--export-format", help="Export format: onnx or onnx_qdq.")
    ] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    sets: SetOpt = None,
) -> None:
    """The pipeline DAG with each stage's declared reads."""
    cfg = _load(config, target=target, format=export_format, sets=sets, required=False)
    if not cfg.model_name:
        cfg = replace(cfg, model_name="model")  # the graph does not depend on the model
    _, pipeline = _request(cfg, None, load_model=False)
    doc = {"target": cfg.target, "format": cfg.format, **_graph_doc(pipeline)}
    if as_json:
        _emit_json(doc)
    else:
        typer.echo(_render_graph(doc, style.value))


@app.command()
@_handles_errors
def targets(as_json: JsonOpt = False) -> None:
    """The export targets, their formats (the first is the default) and options."""
    from graphbuild.targets.registry import all_targets

    found = all_targets()
    if as_json:
        _emit_json(
            {
                "targets": [
                    {
                        "target": t.name,
                        "formats": list(t.formats),
                        "default_format": t.default_format,
                        "description": t.description,
                        "options": list(t.config_schema),
                        "presets": list(t.presets),
                    }
                    for t in found
                ]
            }
        )
        return
    for t in found:
        typer.echo(f"{t.name}: {t.description}")
        typer.echo(f"  formats: {', '.join(t.formats)} (default {t.default_format})")
        typer.echo(f"  [options]: {', '.join(t.config_schema) or 'none'}")
        if t.presets:
            typer.echo(f"  presets: {', '.join(t.presets)}")


# --------------------------------------------------------------------------- cache


def _cache_cfg(config: Path | None) -> Config:
    return _load(config, required=False)


def _maintenance(
    command: str, cache: Cache, report: MaintenanceReport, as_json: bool, before: int
) -> None:
    stats = cache.stats()
    if as_json:
        _emit_json({"command": command, **report.to_json(), "stats": stats.to_json()})
        return
    console = _console()
    for problem in report.corrupt or []:
        console.print(Text(f"corrupt: {problem}", style="red"))
    for note in report.notes or []:
        console.print(Text(note, style="yellow"))
    parts = [f"freed {human_size(report.freed_bytes)}"]
    parts.append(f"removed {report.removed_entries} entries and {report.removed_blobs} blobs")
    if command == "verify":
        parts.insert(
            0, f"checked {report.checked_blobs} blobs and {report.checked_entries} entries"
        )
        parts.insert(1, f"{len(report.corrupt or [])} corrupt")
    console.print(Text(", ".join(parts)))
    console.print(
        Text(
            f"cache {stats.path}: {human_size(before)} -> {human_size(stats.bytes)}, "
            f"{stats.entries} entries",
            style="dim",
        )
    )


CacheConfigOpt = ConfigOpt


@cache_app.command("path")
@_handles_errors
def cache_path(
    cache_dir: CacheDirOpt = None, config: CacheConfigOpt = None, as_json: JsonOpt = False
) -> None:
    """Where the cache is."""
    path = _cache_path(cache_dir, None if cache_dir else _cache_cfg(config))
    if as_json:
        _emit_json({"path": str(path)})
    else:
        typer.echo(str(path))


def _cache(cache_dir: Path | None, config: Path | None) -> Cache:
    cache = _open_cache(cache_dir, False, None if cache_dir else _cache_cfg(config))
    assert cache is not None
    return cache


@cache_app.command("stats")
@_handles_errors
def cache_stats(
    cache_dir: CacheDirOpt = None, config: CacheConfigOpt = None, as_json: JsonOpt = False
) -> None:
    """Size, entries, hits and misses, time saved."""
    stats = _cache(cache_dir, config).stats()
    if as_json:
        _emit_json(stats.to_json())
        return
    lookups = stats.hits + stats.misses
    rate = f" ({100 * stats.hits / lookups:.0f}% hits)" if lookups else ""
    limit = f" of {human_size(stats.size_limit)}" if stats.size_limit else ""
    for line in (
        f"path          {stats.path}",
        f"size          {human_size(stats.bytes)}{limit} in {stats.blobs} blobs",
        f"entries       {stats.entries}",
        f"hits/misses   {stats.hits}/{stats.misses}{rate}",
        f"corrupt       {stats.corrupt}",
        f"saved         {stats.seconds_saved:.1f} s, {human_size(stats.bytes_saved)} not rebuilt",
    ):
        typer.echo(line)


@cache_app.command("ls")
@_handles_errors
def cache_ls(
    cache_dir: CacheDirOpt = None, config: CacheConfigOpt = None, as_json: JsonOpt = False
) -> None:
    """Every cache entry, most recently used first."""
    cache = _cache(cache_dir, config)
    entries = cache.entries()
    if as_json:
        _emit_json({"path": str(cache.path), "entries": [asdict(e) for e in entries]})
        return
    for e in entries:
        typer.echo(
            f"{e.key[:16]}  {e.stage:<16} {e.pipeline:<20} {human_size(e.bytes):>10} "
            f"{e.seconds:7.2f} s  used {_ago(e.last_used)}"
        )
    typer.echo(f"{len(entries)} entries, {human_size(sum(e.bytes for e in entries))}")


@cache_app.command("show")
@_handles_errors
def cache_show(
    key: Annotated[str, typer.Argument(help="A key or a unique prefix of one.")],
    cache_dir: CacheDirOpt = None,
    config: CacheConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """One entry's manifest: stage, reads, output digests, sizes, timings."""
    cache = _cache(cache_dir, config)
    matches = [e.key for e in cache.entries() if e.key.startswith(key)]
    if len(matches) != 1:
        found = "no entry" if not matches else f"{len(matches)} entries"
        raise ConfigError(f"{found} in the cache at {cache.path} with a key starting '{key}'")
    manifest = cache.show(matches[0])
    if as_json:
        _emit_json(manifest)
        return
    typer.echo(json.dumps(manifest, indent=2, default=str))


@cache_app.command("clean")
@_handles_errors
def cache_clean(
    cache_dir: CacheDirOpt = None, config: CacheConfigOpt = None, as_json: JsonOpt = False
) -> None:
    """Remove everything: entries, blobs, counters and last-run records."""
    cache = _cache(cache_dir, config)
    before = cache.size()
    _maintenance("clean", cache, cache.clear(), as_json, before)


@cache_app.command("prune")
@_handles_errors
def cache_prune(
    max_size: Annotated[
        str | None,
        typer.Option(
            "--max-size", help="Evict least recently used entries down to SIZE (500M, 2G)."
        ),
    ] = None,
    older_than: Annotated[
        str | None,
        typer.Option("--older-than", help="Evict entries unused for AGE (30m, 12h, 7d)."),
    ] = None,
    cache_dir: CacheDirOpt = None,
    config: CacheConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Evict entries by size (LRU) and/or age, then free their blobs."""
    if max_size is None and older_than is None:
        raise ConfigError("cache prune needs --max-size SIZE and/or --older-than AGE")
    max_bytes = parse_size(max_size) if max_size is not None else None
    age = parse_age(older_than) if older_than is not None else None
    cache = _cache(cache_dir, config)
    before = cache.size()
    _maintenance("prune", cache, cache.prune(max_bytes=max_bytes, older_than=age), as_json, before)


@cache_app.command("gc")
@_handles_errors
def cache_gc(
    grace: Annotated[
        str, typer.Option("--grace", help="Keep unreferenced blobs younger than AGE.")
    ] = "10m",
    cache_dir: CacheDirOpt = None,
    config: CacheConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove blobs that no entry references."""
    seconds = parse_age(grace)
    cache = _cache(cache_dir, config)
    before = cache.size()
    _maintenance("gc", cache, cache.gc(grace=seconds), as_json, before)


@cache_app.command("verify")
@_handles_errors
def cache_verify(
    repair: Annotated[
        bool, typer.Option("--repair/--no-repair", help="Remove what is corrupt.")
    ] = True,
    cache_dir: CacheDirOpt = None,
    config: CacheConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-hash every blob; corrupt blobs and the entries using them are removed (misses)."""
    cache = _cache(cache_dir, config)
    before = cache.size()
    _maintenance("verify", cache, cache.verify(repair=repair), as_json, before)
