"""What the command line prints: consoles, JSON documents, sizes and ages for people."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

import typer
from rich.console import Console

from graphbuild.errors import ConfigError

__all__ = [
    "ago",
    "debug_enabled",
    "display_path",
    "emit_json",
    "human_size",
    "make_console",
    "parse_age",
    "parse_size",
    "warnings_as_lines",
]


def make_console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr); tests replace this to capture terminal output."""
    return Console(
        stderr=stderr,
        no_color=True if os.environ.get("NO_COLOR") else None,
        highlight=False,
        soft_wrap=True,
    )


def display_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a person reads it: relative to the working directory when it lies inside
    it (``graphbuild-out/convnet.onnx``), else as given."""
    text = os.fspath(path)
    try:
        cwd = os.getcwd()
        absolute = os.path.abspath(text)
    except OSError:
        return text
    if absolute == cwd or not absolute.startswith(cwd.rstrip(os.sep) + os.sep):
        return text
    return os.path.relpath(absolute, cwd)


def debug_enabled() -> bool:
    """``GRAPHBUILD_DEBUG`` is set: show tracebacks and library warnings."""
    return os.environ.get("GRAPHBUILD_DEBUG", "").lower() not in ("", "0", "false", "no")


@contextlib.contextmanager
def warnings_as_lines() -> Iterator[None]:
    """While a command runs, each warning prints once, as one ``warning: ...`` line on stderr
    (never Python's two lines with a source location); a warning the run's report carries
    (:class:`~graphbuild.errors.ReportedWarning`) is left to the report. With
    ``GRAPHBUILD_DEBUG`` set the line also names the category and where it was raised."""
    from graphbuild.errors import ReportedWarning

    shown: set[str] = set()

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if issubclass(category, ReportedWarning):
            return
        text = " ".join(str(message).split())
        text = text.removeprefix("graphbuild: ")
        if text in shown:
            return
        shown.add(text)
        where = f" ({category.__name__} at {filename}:{lineno})" if debug_enabled() else ""
        typer.echo(f"warning: {text}{where}", err=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def emit_json(doc: Any) -> None:
    """Print ``doc`` as the command's one JSON document."""
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


def ago(then: float) -> str:
    """``3 min ago``, ``never``."""
    if not then:
        return "never"
    s = max(0.0, time.time() - then)
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= span:
            return f"{s / span:.0f} {unit} ago"
    return f"{s:.0f} s ago"
