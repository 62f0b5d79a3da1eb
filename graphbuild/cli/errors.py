"""Errors for people: library exceptions become a message (or a JSON document) and an exit code.

Exit codes: 0 success, 1 a stage failed (or the build broke while running), 2 bad usage or
configuration. ``GRAPHBUILD_DEBUG=1`` adds the traceback to any error.
"""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable
from typing import Any

import typer
from rich.text import Text

from graphbuild.cli.output import debug_enabled, emit_json, make_console
from graphbuild.errors import (
    CacheError,
    ConfigError,
    ExportError,
    GraphbuildError,
    PipelineError,
    StageError,
)

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "handles_errors", "report_error", "stage_json"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _exit_code(err: BaseException) -> int:
    if isinstance(err, StageError):
        return EXIT_FAILED
    if isinstance(err, (ConfigError, ExportError, PipelineError, CacheError)):
        return EXIT_USAGE
    return EXIT_FAILED


def report_error(err: BaseException, as_json: bool) -> int:
    code = _exit_code(err)
    known = isinstance(err, (GraphbuildError, OSError))
    if debug_enabled():
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
            doc["stages"] = [stage_json(s) for s in report.stages]
        emit_json(doc)
        return code
    message = Text("error: ", style="bold red")
    message.append(str(err) if known else f"unexpected {type(err).__name__}: {err}")
    if not debug_enabled() and (isinstance(err, StageError) or not known):
        message.append("\n(set GRAPHBUILD_DEBUG=1 to see the traceback)", style="dim")
    make_console(stderr=True).print(message)
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


def handles_errors(fn: Callable[..., None]) -> Callable[..., None]:
    """Run a command, turning expected errors into a message (or JSON) and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        as_json = bool(kwargs.get("as_json"))
        try:
            fn(*args, **kwargs)
        except _CLI_ERRORS:
            raise
        except Exception as err:
            raise typer.Exit(report_error(err, as_json)) from None

    return wrapper


def stage_json(rec: Any) -> dict[str, Any]:
    return {
        "name": rec.name,
        "status": rec.status,
        "seconds": rec.seconds,
        "key": rec.key,
        "reason": rec.reason,
    }
