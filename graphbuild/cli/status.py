"""``graphbuild status`` and ``graphbuild explain``: what would run, what changed, and why."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from graphbuild.cli.errors import handles_errors
from graphbuild.cli.options import (
    CacheDirOpt,
    CacheUrlOpt,
    ConfigOpt,
    FormatOpt,
    JsonOpt,
    ModelOpt,
    NameOpt,
    NoCacheOpt,
    SetOpt,
    TargetOpt,
    build_request,
    load_cli_config,
    open_cache,
)
from graphbuild.cli.output import ago, emit_json, make_console
from graphbuild.config import Config
from graphbuild.engine.status import StageStatus
from graphbuild.errors import ConfigError

if TYPE_CHECKING:
    from graphbuild.engine.artifact_store import Cache

__all__ = ["explain", "show_status", "status"]


def show_status(cfg: Config, cache: Cache | None, as_json: bool) -> None:
    from graphbuild.api import status

    request, _ = build_request(cfg, cache)
    report = status(request)
    dirty = report.with_status(StageStatus.DIRTY)
    if as_json:
        emit_json(
            {
                "target": cfg.target,
                "format": cfg.format,
                "model_name": cfg.model_name,
                "run_id": report.run_id,
                "cache": cache.location if cache is not None else None,
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
    console = make_console()
    styles = {StageStatus.HIT: "green", StageStatus.DIRTY: "yellow", StageStatus.MAYBE: "cyan"}
    for s in report.stages:
        line = Text(f"{s.name:<16} ")
        line.append(f"{s.status:<6}", style=styles.get(s.status, ""))
        if s.reason:
            line.append(f"  {s.reason}")
        console.print(line)
    counts = {
        k: len(report.with_status(k))
        for k in (StageStatus.DIRTY, StageStatus.MAYBE, StageStatus.HIT)
    }
    if not dirty:
        console.print(Text("up to date: an export would run nothing", style="bold"))
    else:
        console.print(
            Text(", ".join(f"{n} {k}" for k, n in counts.items() if n), style="bold"),
        )


@handles_errors
def status(
    target: TargetOpt = None,
    format: FormatOpt = None,
    config: ConfigOpt = None,
    model: ModelOpt = None,
    name: NameOpt = None,
    cache_dir: CacheDirOpt = None,
    cache_url: CacheUrlOpt = None,
    no_cache: NoCacheOpt = False,
    as_json: JsonOpt = False,
    sets: SetOpt = None,
) -> None:
    """What an export would run, and why; nothing is executed."""
    cfg = load_cli_config(config, target=target, format=format, model=model, name=name, sets=sets)
    show_status(cfg, open_cache(cache_dir, no_cache, cfg, url=cache_url), as_json)


@handles_errors
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
    cfg = load_cli_config(config, target=target, format=format, model=model, name=name, sets=sets)
    cache = open_cache(cache_dir, False, cfg)
    request, pipeline = build_request(cfg, cache)
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
        emit_json({"run_id": request.run_id(), "cache": cache.location, "stages": stages})
        return
    console = make_console()
    for s in stages:
        head = Text(f"{s['name']:<16} ", style="bold")
        head.append(f"{s['status']:<6}")
        last = s["last_run"]
        if last:
            head.append(f"  last run {ago(last['when'] or 0)}: {last['status']}", style="dim")
        console.print(head)
        for c in s["changes"]:
            console.print(Text(f"    {c['read']}: {_short(c['old'])} -> {_short(c['new'])}"))
        pending = ", ".join(s["dirty_upstream"])
        if not s["changes"] or pending:
            note = s["reason"] if not s["changes"] else f"also downstream of dirty {pending}"
            console.print(Text(f"    {note}", style="dim"))
        if last and last.get("changes"):
            console.print(Text("    why that run ran:", style="dim"))
            for c in last["changes"]:
                console.print(Text(f"      {c['read']}: {_short(c['old'])} -> {_short(c['new'])}"))


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 100 else text[:97] + "..."
