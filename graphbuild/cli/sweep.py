"""``graphbuild sweep``: N variants of the configured export as one build.

The variants come from ``--vary KEY=V1,V2`` (repeatable; crossed, or zipped with ``--list``)
or the config's ``[sweep]`` table. Progress shows the jobs as they finish (each distinct stage
key once) and each variant as its files are placed; then the table, the summary and the
report files. Torch and the sweep machinery are imported only when the command runs.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from graphbuild.cli.errors import EXIT_FAILED, handles_errors
from graphbuild.cli.options import (
    CacheDirOpt,
    CacheUrlOpt,
    ConfigOpt,
    FormatOpt,
    JsonOpt,
    ModelOpt,
    NameOpt,
    SetOpt,
    TargetOpt,
    cli_overrides,
    load_cli_config,
    quiet_torch,
    resolve_cache_path,
    resolve_cache_url,
)
from graphbuild.cli.output import display_path, emit_json, make_console
from graphbuild.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from graphbuild.sweeps.runner import SweepEvent, SweepResult

__all__ = ["sweep"]


class SweepProgress:
    """A sweep listener: one line per job that ran or failed and per variant placed; on a
    terminal a spinner with what is running."""

    def __init__(self, console: Console, quiet: bool = False):
        self.console, self.quiet = console, quiet
        self.live = console.is_terminal and not quiet
        self.running: dict[tuple[str, str], str] = {}
        self.counts = {"ran": 0, "hit": 0, "shared": 0, "failed": 0}
        self._status: Any = None

    def __enter__(self) -> SweepProgress:
        if self.live:
            self._status = self.console.status("planning the variants…", spinner="dots")
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def __call__(self, event: SweepEvent) -> None:
        kind = event.kind
        if kind == "queued":
            self.running[(event.variant, event.stage)] = event.stage
        elif kind in self.counts:
            self.counts[kind] += 1
            self.running.pop((event.variant, event.stage), None)
            if kind in ("ran", "failed") and not self.quiet:
                self._line(kind, f"{event.stage:<16} {event.variant:<22}", event)
        elif kind == "placed" and not self.quiet:
            self._line("placed", f"{event.variant:<39}", event)
        elif kind == "variant_failed" and not self.quiet:
            self._line("failed", f"{event.variant:<39}", event)
        self._spin()

    def _line(self, kind: str, what: str, event: SweepEvent) -> None:
        style = {"ran": "yellow", "failed": "bold red", "placed": "green"}.get(kind, "")
        text = Text()
        text.append(f"{kind:<7} ", style=style if self.live else "")
        text.append(what)
        if event.seconds:
            text.append(f" {event.seconds:7.2f} s")
        if event.worker:
            text.append(f"  {event.worker}", style="dim" if self.live else "")
        if event.detail and kind == "failed":
            text.append(f"  {event.detail}")
        self.console.print(text)

    def _spin(self) -> None:
        if self._status is None:
            return
        stages = sorted(set(self.running.values()))
        shown = ", ".join(stages[:4]) + ("…" if len(stages) > 4 else "")
        c = self.counts
        self._status.update(
            f"running {len(self.running)} job(s): {shown or '-'}  "
            f"[dim]({c['ran']} ran, {c['shared']} shared, {c['hit']} hit)[/]"
        )


@handles_errors
def sweep(
    vary: Annotated[
        list[str] | None,
        typer.Option(
            "--vary",
            "-V",
            metavar="KEY=V1,V2",
            help="A config key and its values, e.g. quantization.preset=w8a16,w8a8 "
            "(repeatable; the axes are crossed).",
        ),
    ] = None,
    as_list: Annotated[
        bool, typer.Option("--list", help="Zip the --vary axes instead of crossing them.")
    ] = False,
    config: ConfigOpt = None,
    model: ModelOpt = None,
    target: TargetOpt = None,
    format: FormatOpt = None,
    name: NameOpt = None,
    output_dir: Annotated[
        Path | None,
        typer.Option(
            "--output-dir", "-o", help="Where the variants go, one directory each (sweep-out)."
        ),
    ] = None,
    cache_dir: CacheDirOpt = None,
    cache_url: CacheUrlOpt = None,
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            "-j",
            help="Local worker processes (default: the CPUs, at most 8 and one per variant; "
            "1: none, the jobs run in this process).",
        ),
    ] = None,
    executor: Annotated[
        str | None,
        typer.Option("--executor", help="local (a process pool) or ray (the ray extra)."),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address", help="The Ray cluster (host:port, or auto); none: a local one."
        ),
    ] = None,
    no_numerics: Annotated[
        bool, typer.Option("--no-numerics", help="Skip the numerics check (no SQNR column).")
    ] = False,
    as_json: JsonOpt = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Only errors and the report files.")
    ] = False,
    sets: SetOpt = None,
) -> None:
    """Export many variants of the configured model (presets, calibration sets, options) as
    one build: each distinct stage runs once."""
    cfg = load_cli_config(config, target=target, format=format, model=model, name=name, sets=sets)
    cwd = Path.cwd()
    overrides = cli_overrides(cwd, target=target, format=format, model=model, name=name, sets=sets)
    cache_path = resolve_cache_path(cache_dir, cfg)
    url = resolve_cache_url(cache_url, cfg)
    if cfg.cache_readonly:
        raise ConfigError(
            "a sweep writes its results to the cache (it is how its workers hand them over): "
            "drop [cache] readonly for it"
        )
    from graphbuild.sweeps import sweep as run

    console = make_console()
    progress = SweepProgress(console, quiet=quiet or as_json)
    quiet_torch()  # here and, at its level, in the pool's workers
    quiet_stdout = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    with quiet_stdout, progress:
        result = run(
            vary or (),
            config=cfg.source,
            cwd=cwd,
            overrides=overrides,
            mode="list" if as_list else None,
            output_dir=output_dir,
            cache=cache_path,
            cache_url=url,
            executor=executor,
            jobs=jobs,
            ray_address=ray_address,
            check_numerics=not no_numerics,
            listeners=[progress],
        )
    _show(result, console, as_json, quiet)
    if result.failed:  # the report says which and why; exit as a failed stage does
        if not as_json:
            first = next(r for r in result.rows if r["status"] != "ok")
            message = Text("error: ", style="bold red")
            message.append(
                f"{len(result.failed)} of {len(result.rows)} variants failed; "
                f"{first['variant']}: {first.get('error')}"
            )
            make_console(stderr=True).print(message)
        raise typer.Exit(EXIT_FAILED)


def _show(result: SweepResult, console: Console, as_json: bool, quiet: bool) -> None:
    from graphbuild.sweeps.report import rich_table

    files = {kind: str(path) for kind, path in result.files.items()}
    if as_json:
        emit_json({"sweep": result.summary, "variants": result.rows, "files": files})
        return
    files = {kind: display_path(path) for kind, path in files.items()}
    if quiet:
        for path in files.values():
            console.print(path, markup=False)
        return
    table = rich_table(result.rows, result.keys)
    if not console.is_terminal:  # a pipe or a log gets the whole table, never cut short
        wide = console.options.update_width(10_000)
        console.width = max(console.width, console.measure(table, options=wide).maximum)
    console.print(table)
    s = result.summary
    runs = ", ".join(f"{stage} {n}" for stage, n in s["stage_runs"].items())
    ran = f"{s['jobs_run']} stage runs ({runs})" if runs else "every stage was in the cache"
    console.print(
        Text(
            f"{s['variants']} variants, {ran}, in {s['seconds']:.1f} s on "
            f"{len(s['workers']) or 1} worker(s) ({s['executor']})"
        )
    )
    if "plot" in s:
        console.print(Text(f"  plot       {s['plot']}"))
    for kind, path in files.items():
        console.print(Text(f"  {kind:<10} {path}"))
