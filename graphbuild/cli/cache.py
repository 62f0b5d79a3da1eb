"""``graphbuild cache ...``: look after the build cache (path, stats, ls, show, clean, prune,
gc, verify). Nothing here imports torch, so these commands start quickly.

Each command works on the local cache directory, or with ``--cache-url`` on the shared cache
alone (given explicitly: ``[cache] url`` and ``$GRAPHBUILD_CACHE_URL`` are for exports, so a
``clean`` never reaches the team's cache by accident). ``stats``, ``ls``, ``show`` and
``verify --no-repair`` only look: a damaged index is reported, not moved aside."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from graphbuild.cli.errors import handles_errors
from graphbuild.cli.options import (
    CacheDirOpt,
    CacheUrlOpt,
    ConfigOpt,
    JsonOpt,
    load_cli_config,
    resolve_cache_path,
)
from graphbuild.cli.output import ago, emit_json, human_size, make_console, parse_age, parse_size
from graphbuild.config import Config
from graphbuild.errors import ConfigError

if TYPE_CHECKING:
    from graphbuild.engine.artifact_store import Cache, CacheStats, MaintenanceReport

__all__ = ["cache_app"]

cache_app = typer.Typer(
    help="Inspect and maintain the build cache.", no_args_is_help=True, add_completion=False
)


def _cache_cfg(config: Path | None) -> Config:
    return load_cli_config(config, required=False)


def _maintenance(
    command: str, cache: Cache, run: Callable[[], MaintenanceReport], as_json: bool
) -> MaintenanceReport:
    """Run one maintenance operation and report it; the size before it is only listed when
    a person reads the summary (a listing of every blob, on a shared cache every key)."""
    before = None if as_json else cache.size()
    report = run()
    stats = cache.stats()
    if as_json:
        emit_json({"command": command, **report.to_json(), "stats": stats.to_json()})
        return report
    console = make_console()
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
            f"cache {stats.path}: {human_size(before or 0)} -> {human_size(stats.bytes)}, "
            f"{stats.entries} entries",
            style="dim",
        )
    )
    return report


CacheConfigOpt = ConfigOpt


@cache_app.command("path")
@handles_errors
def cache_path(
    cache_dir: CacheDirOpt = None, config: CacheConfigOpt = None, as_json: JsonOpt = False
) -> None:
    """Where the cache is."""
    path = resolve_cache_path(cache_dir, None if cache_dir else _cache_cfg(config))
    if as_json:
        emit_json({"path": str(path)})
    else:
        typer.echo(str(path))


def _cache(
    cache_dir: Path | None, config: Path | None, url: str | None = None, *, repair: bool = True
) -> Cache:
    """The local cache, or with ``url`` the shared one; ``repair=False``: look only."""
    from graphbuild.engine.artifact_store import Cache

    if url is not None:
        if cache_dir is not None:
            raise ConfigError("--cache-dir and --cache-url name two caches; give one")
        return Cache.remote(url)
    cfg = None if cache_dir else _cache_cfg(config)
    return Cache(resolve_cache_path(cache_dir, cfg), repair=repair)


@cache_app.command("stats")
@handles_errors
def cache_stats(
    cache_dir: CacheDirOpt = None,
    cache_url: CacheUrlOpt = None,
    config: CacheConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Size, entries, hits and misses, time saved."""
    stats = _cache(cache_dir, config, cache_url, repair=False).stats()
    if as_json:
        emit_json(stats.to_json())
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
    if stats.damaged:
        typer.echo(
            f"damaged       {stats.damaged} (graphbuild cache verify moves it aside and starts "
            "a fresh index)"
        )


@cache_app.command("ls")
@handles_errors
def cache_ls(
    cache_dir: CacheDirOpt = None,
    cache_url: CacheUrlOpt = None,
    config: CacheConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every cache entry, most recently used first."""
    cache = _cache(cache_dir, config, cache_url, repair=False)
    entries = cache.entries()
    if as_json:
        emit_json({"path": cache.location, "entries": [asdict(e) for e in entries]})
        return
    for e in entries:
        typer.echo(
            f"{e.key[:16]}  {e.stage:<16} {e.pipeline:<20} {human_size(e.bytes):>10} "
            f"{e.seconds:7.2f} s  used {ago(e.last_used)}"
        )
    typer.echo(_ls_total(entries, cache.stats()))


def _ls_total(entries: list, stats: CacheStats) -> str:
    """The listing's total, beside what ``cache stats`` reports: entries that share an
    output (the same blob) each count it, the blob store holds it once."""
    listed = sum(e.bytes for e in entries)
    line = f"{len(entries)} entries, {human_size(listed)} of outputs"
    if listed == stats.bytes:
        return line
    why = (
        "an output several entries share is stored once"
        if listed > stats.bytes
        else "it also holds blobs no entry uses, until graphbuild cache gc removes them"
    )
    return f"{line}; the cache holds {human_size(stats.bytes)} in {stats.blobs} blobs: {why}"


@cache_app.command("show")
@handles_errors
def cache_show(
    key: Annotated[str, typer.Argument(help="A key or a unique prefix of one.")],
    cache_dir: CacheDirOpt = None,
    cache_url: CacheUrlOpt = None,
    config: CacheConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """One entry's manifest: stage, reads, output digests, sizes, timings."""
    cache = _cache(cache_dir, config, cache_url, repair=False)
    matches = cache.show(key)
    if len(matches) != 1:
        found = "no entry" if not matches else f"{len(matches)} entries"
        raise ConfigError(f"{found} in the cache at {cache.location} with a key starting '{key}'")
    manifest = matches[0]
    if as_json:
        emit_json(manifest)
        return
    typer.echo(json.dumps(manifest, indent=2, default=str))


@cache_app.command("clean")
@handles_errors
def cache_clean(
    cache_dir: CacheDirOpt = None,
    cache_url: CacheUrlOpt = None,
    config: CacheConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove everything: entries, blobs, counters and last-run records."""
    cache = _cache(cache_dir, config, cache_url)
    _maintenance("clean", cache, lambda: cache.clear(), as_json)


@cache_app.command("prune")
@handles_errors
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
    cache_url: CacheUrlOpt = None,
    config: CacheConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Evict entries by size (LRU) and/or age, then free their blobs."""
    if max_size is None and older_than is None:
        raise ConfigError("cache prune needs --max-size SIZE and/or --older-than AGE")
    max_bytes = parse_size(max_size) if max_size is not None else None
    age = parse_age(older_than) if older_than is not None else None
    cache = _cache(cache_dir, config, cache_url)
    _maintenance("prune", cache, lambda: cache.prune(max_bytes=max_bytes, older_than=age), as_json)


@cache_app.command("gc")
@handles_errors
def cache_gc(
    grace: Annotated[
        str, typer.Option("--grace", help="Keep unreferenced blobs younger than AGE.")
    ] = "10m",
    cache_dir: CacheDirOpt = None,
    cache_url: CacheUrlOpt = None,
    config: CacheConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove blobs that no entry references."""
    seconds = parse_age(grace)
    cache = _cache(cache_dir, config, cache_url)
    _maintenance("gc", cache, lambda: cache.gc(grace=seconds), as_json)


@cache_app.command("verify")
@handles_errors
def cache_verify(
    repair: Annotated[
        bool, typer.Option("--repair/--no-repair", help="Remove what is corrupt.")
    ] = True,
    cache_dir: CacheDirOpt = None,
    cache_url: CacheUrlOpt = None,
    config: CacheConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-hash every blob and check every entry and record; what is corrupt is removed (a
    miss from then on). Exits 1 when it found anything corrupt, so a script notices."""
    cache = _cache(cache_dir, config, cache_url, repair=repair)
    report = _maintenance("verify", cache, lambda: cache.verify(repair=repair), as_json)
    if report.corrupt:
        raise typer.Exit(1)
