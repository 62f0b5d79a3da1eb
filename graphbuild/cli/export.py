"""``graphbuild export``: build the configured model for a target and format."""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text
from typer.core import TyperCommand

from graphbuild.cli.errors import handles_errors, stage_json
from graphbuild.cli.flags import flag_parameters, flag_sets
from graphbuild.cli.options import (
    CacheDirOpt,
    CacheReadonlyOpt,
    CacheUrlOpt,
    ConfigOpt,
    FormatOpt,
    JsonOpt,
    ModelOpt,
    NameOpt,
    NoCacheOpt,
    OutputOpt,
    SetOpt,
    TargetOpt,
    build_request,
    cli_overrides,
    load_cli_config,
    open_cache,
)
from graphbuild.cli.output import display_path, emit_json, make_console
from graphbuild.cli.progress import Progress
from graphbuild.cli.status import show_status
from graphbuild.errors import ConfigError, StageError

if TYPE_CHECKING:
    from typer._click import Context, Parameter

    from graphbuild.engine.pipeline import Pipeline

__all__ = ["ExportCommand", "export"]


class ExportCommand(TyperCommand):
    """``--force`` takes an optional value: a bare ``--force`` forces every stage. The
    targets' own flags (:mod:`graphbuild.cli.flags`) join the options, before ``--json``, when
    the command first parses or prints its help, and become ``--set`` pairs when it runs."""

    _with_target_flags = False

    def get_params(self, ctx: Context) -> list[Parameter]:
        if not self._with_target_flags:
            self._with_target_flags = True
            names = [p.name for p in self.params]
            at = names.index("as_json") if "as_json" in names else len(names)
            self.params[at:at] = flag_parameters({n for n in names if n})
        return super().get_params(ctx)

    def invoke(self, ctx: Context) -> Any:
        switched = flag_sets(ctx.params)
        if switched:
            ctx.params["sets"] = [*(ctx.params.get("sets") or []), *switched]
        return super().invoke(ctx)

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


@handles_errors
def export(
    target: TargetOpt = None,
    format: FormatOpt = None,
    config: ConfigOpt = None,
    model: ModelOpt = None,
    output_dir: OutputOpt = None,
    name: NameOpt = None,
    cache_dir: CacheDirOpt = None,
    cache_url: CacheUrlOpt = None,
    cache_readonly: CacheReadonlyOpt = False,
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
    jobs: Annotated[
        str | None,
        typer.Option(
            "--jobs",
            "-j",
            help="Stages built at once (an LLM's parts): a count (1: one at a time) or 'auto' "
            "(one per core; default: [build] jobs, else auto, within [build] memory). Formats "
            "that do not declare their stages safe to run at once build one at a time.",
            metavar="N",
        ),
    ] = None,
    executor: Annotated[
        str,
        typer.Option(
            "--executor",
            help="local (threads, -j) or ray: the stages as Ray tasks on a cluster that shares "
            "the cache (the ray extra; --cache-url for a shared Redis).",
        ),
    ] = "local",
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address", help="The Ray cluster (host:port, or auto); none: a local one."
        ),
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Only errors and the files written.")
    ] = False,
    sets: SetOpt = None,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            help="Export again whenever the config, the model's sources or a file its factory "
            "read changes, printing what changed (Ctrl-C stops).",
        ),
    ] = False,
    watch_runs: Annotated[
        int | None,
        typer.Option("--watch-runs", metavar="N", help="With --watch: stop after N exports."),
    ] = None,
) -> None:
    """Build the model named in graphbuild.toml (or --model) for a target and format."""
    if watch or watch_runs is not None:  # the graphbuild command runs the loop (a server's client)
        raise ConfigError(
            "--watch is run by the graphbuild command (graphbuild export --watch, or "
            "python -m graphbuild export --watch), not by the Typer application alone"
        )
    cfg = load_cli_config(
        config,
        target=target,
        format=format,
        model=model,
        output_dir=output_dir,
        name=name,
        sets=sets,
    )
    cfg.check()  # format, preset, model file: before the cache, the directory and torch
    cache = open_cache(cache_dir, no_cache, cfg, url=cache_url, readonly=cache_readonly)
    if dry_run:
        show_status(cfg, cache, as_json)
        return
    from graphbuild.output.directory import check_output_directory

    check_output_directory(cfg.output_dir, cfg.model_name)  # before the model is even loaded
    from graphbuild.api import export_with_pipeline
    from graphbuild.output.placement import json_safe

    console = make_console()
    progress = Progress(console, quiet=quiet or as_json)
    request, pipeline = build_request(cfg, cache, listeners=[] if as_json else [progress])
    request.force = _forced(force, pipeline)
    request.check_fingerprints = check_fingerprints
    request.jobs, request.memory = _jobs(jobs, cfg.build_jobs), cfg.build_memory
    quiet_stdout = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    t0 = time.perf_counter()
    try:
        with quiet_stdout, progress:
            if executor == "ray":
                flags = dict(target=target, format=format, model=model, name=name, sets=sets)
                overrides = cli_overrides(Path.cwd(), output_dir=output_dir, **flags)
                artifacts = _on_cluster(cfg, cache, cache_url, ray_address, progress, overrides)
            elif executor != "local":
                raise ConfigError(f"--executor must be local or ray, got {executor!r}")
            else:
                artifacts = export_with_pipeline(request)
    except StageError as err:
        report = getattr(err, "report", None)
        if report is not None and not as_json and not quiet:
            console.print(progress.summary(report, time.perf_counter() - t0))
        raise
    report = artifacts.report
    files = {kind: str(path) for kind, path in artifacts.files.items()}
    if as_json:
        emit_json(
            {
                "target": cfg.target,
                "format": cfg.format,
                "model_name": cfg.model_name,
                "output_dir": str(artifacts.output_directory),
                "seconds": report.seconds,
                "seconds_saved": report.seconds_saved,
                "stages": [stage_json(s) for s in report.stages],
                "timeline": report.timeline,
                "files": files,
                "reports": json_safe(report.extra),
            }
        )
        return
    if quiet:  # for scripts, like --json: absolute paths
        for path in files.values():
            console.print(path, markup=False)
        return
    console.print(progress.summary(report, report.seconds))
    for line in _report_lines(report.extra):
        console.print(Text(f"  {line}"))
    for kind, shown in _file_lines(files):
        console.print(Text(f"  {kind:<10} {shown}"))


def _on_cluster(
    cfg: Any, cache: Any, url: str | None, address: str | None, progress: Any, overrides: list
) -> Any:
    """The export's stages as Ray tasks (:mod:`graphbuild.sweeps.cluster`), then placed here."""
    from graphbuild.cli.options import resolve_cache_url
    from graphbuild.sweeps.cluster import export_on_cluster

    if cache is None:
        raise ConfigError("--executor ray hands artifacts over through the cache: drop --no-cache")
    done = export_on_cluster(
        cfg.source,
        Path.cwd(),
        overrides,
        cache,
        cache_url=resolve_cache_url(url, cfg),
        ray_address=address,
        listeners=[progress],
    )
    return done.artifacts


def _jobs(given: str | None, configured: int | None) -> int | None:
    """``-j`` (a count or ``auto``: 0, one per core) over ``[build] jobs``; None: neither
    says, what the machine allows (:func:`~graphbuild.engine.concurrent.build_resources`)."""
    if given is None:
        return configured
    if given == "auto":
        return 0
    if not given.isdigit() or int(given) < 1:
        raise ConfigError(f"--jobs must be a positive count or 'auto', got {given!r}")
    return int(given)


def _file_lines(files: Mapping[str, str]) -> list[tuple[str, str]]:
    """(kind, path as shown) per placed file; a model's ``per_tensor`` data files are one
    line, ``<name>.onnx.data.<0-N>``, however many there are."""
    data = [path for kind, path in files.items() if _PER_TENSOR.fullmatch(kind)]
    lines = []
    for kind, path in files.items():
        if not _PER_TENSOR.fullmatch(kind):
            lines.append((kind, display_path(path)))
        elif path == data[0]:
            stem = display_path(path).rpartition(".")[0]
            lines.append(("onnx.data", f"{stem}.<0-{len(data) - 1}> ({len(data)} files)"))
    return lines


_PER_TENSOR = re.compile(r"onnx\.data\.\d+")


def _report_lines(extra: Mapping[str, Any]) -> list[str]:
    """One line per report an export made (coverage, delegation, numerics), for people, and
    a warning line per degenerate calibrated range and per tensor in a known HTP defect."""
    lines = []
    outputs = extra.get("model_outputs")
    if isinstance(outputs, Mapping) and outputs.get("summary"):
        lines.append(f"outputs    {outputs['summary']}")
    coverage = extra.get("coverage")
    if isinstance(coverage, Mapping):
        lines.append(f"coverage   {coverage.get('summary', '')}")
        for entry in coverage.get("degenerate", []):
            lines.append(f"warning    '{entry.get('tensor')}': {entry.get('why')}")
        for entry in coverage.get("htp_defects", []):
            lines.append(
                f"warning    '{entry.get('tensor')}': {entry.get('reason')}; "
                f"reproduced by {entry.get('reproduction')}"
            )
    delegation = extra.get("delegation")
    if isinstance(delegation, Mapping):
        lines.append(
            f"delegation {delegation.get('delegated_ops', 0)} ops delegated in "
            f"{delegation.get('delegated_subgraphs', 0)} subgraph(s), "
            f"{delegation.get('portable_ops', 0)} on portable kernels"
        )
    htp = extra.get("htp")
    if isinstance(htp, Mapping):
        lines.append(f"htp        {htp.get('summary', '')}")
    numerics = extra.get("numerics")
    if isinstance(numerics, Mapping) and "outputs" not in numerics and "summary" in numerics:
        lines.append(f"numerics   {numerics['summary']}")  # a generation check (qnn/llm)
    elif isinstance(numerics, Mapping):
        against = numerics.get("reference")
        for out in numerics.get("outputs", []):
            line = f"numerics   {out.get('name')}: {_errors(out)}"
            if against:
                line += f" against the {against}"
            if "sqnr_db_vs_float" in out:
                line += f"; {_errors(out, '_vs_float')} against the float model"
            lines.append(line)
    return lines


def _errors(out: Mapping[str, Any], suffix: str = "") -> str:
    sqnr = out.get(f"sqnr_db{suffix}", float("nan"))
    error = out.get(f"max_abs_error{suffix}", float("nan"))
    return f"SQNR {sqnr:.1f} dB, max abs error {error:.3g}"
