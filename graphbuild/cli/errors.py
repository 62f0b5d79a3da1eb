"""Errors for people: library exceptions become a message (or a JSON document) and an exit code.

Exit codes: 0 success, 1 a stage failed (or the build broke while running), 2 bad usage or
configuration. ``GRAPHBUILD_DEBUG=1`` adds the traceback to any error.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable
from typing import Any

import typer
from rich.text import Text

from graphbuild.cli.output import (
    debug_enabled,
    display_path,
    emit_json,
    make_console,
    warnings_as_lines,
)
from graphbuild.errors import (
    CacheError,
    ConfigError,
    ExportError,
    GraphbuildError,
    PipelineError,
    StageError,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "brief_failure",
    "first_line",
    "handles_errors",
    "report_error",
    "stage_json",
    "user_frame",
]

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
    if isinstance(err, StageError) and not debug_enabled():
        text, frame, more = brief_failure(err)
        message.append(text)
        if frame:
            message.append("\n" + "\n".join(frame))
        hint = "the rest of its message and the traceback" if more else "the traceback"
        message.append(f"\n(set GRAPHBUILD_DEBUG=1 to see {hint})", style="dim")
    else:
        message.append(str(err) if known else f"unexpected {type(err).__name__}: {err}")
        if not debug_enabled() and not known:
            message.append("\n(set GRAPHBUILD_DEBUG=1 to see the traceback)", style="dim")
    make_console(stderr=True).print(message)
    return code


def first_line(err: BaseException) -> tuple[str, bool]:
    """A foreign exception's first non-empty line (torch's one-line reason), and whether more
    follows; graphbuild's own errors are written for people and kept whole."""
    if isinstance(err, GraphbuildError):
        return str(err), False
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else ""), len(lines) > 1


def brief_failure(err: StageError) -> tuple[str, list[str], bool]:
    """A failed stage for people: the message with the cause's first line, the frame of the
    user's code where it was raised (``File "...", line N, in fn`` and the line), and whether
    GRAPHBUILD_DEBUG=1 has more to show."""
    head, more = first_line(err.cause)
    frame = user_frame(err.cause) if not isinstance(err.cause, GraphbuildError) else None
    lines = []
    if frame is not None:
        lines.append(f'  File "{display_path(frame[0])}", line {frame[1]}, in {frame[2]}')
        if frame[3]:
            lines.append(f"    {frame[3]}")
    return err.describe(head), lines, more


#: The toolchain: a frame in one of these is never "the user's code" (transformers is: a
#: model's forward lives there).
_LIBRARY_PACKAGES = (
    "graphbuild",
    "torch",
    "functorch",
    "torchao",
    "sympy",
    "onnx",
    "onnxscript",
    "onnx_ir",
    "onnxruntime",
    "numpy",
)
_FRAME_IN_TEXT = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def user_frame(err: BaseException) -> tuple[str, int, str, str] | None:
    """Where the user's code raised ``err`` (or the exception it chains to): the innermost
    frame outside the standard library, torch and graphbuild, as (file, line, function,
    source). Failing that, the last ``File "...", line N`` frame torch quotes in its
    message. None when there is neither."""
    skipped = [sysconfig.get_paths()["stdlib"]]
    for name in _LIBRARY_PACKAGES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            skipped.append(os.path.dirname(module.__file__))
    found = None
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame in traceback.extract_tb(current.__traceback__):
            path = os.path.abspath(frame.filename)
            if frame.filename.startswith("<frozen") or any(
                path.startswith(root + os.sep) for root in skipped
            ):
                continue
            found = (frame.filename, frame.lineno or 0, frame.name, (frame.line or "").strip())
        current = current.__cause__ or current.__context__
    if found is not None:
        return found
    quoted = _FRAME_IN_TEXT.findall(str(err))
    if quoted:
        path, line, name, source = quoted[-1]
        return path, int(line), name, source.strip()
    return None


def _cli_errors() -> tuple[type[BaseException], ...]:
    """Exceptions the command-line framework handles itself (usage errors, exits). typer
    0.29 vendors click; older releases use the click package."""
    errors: list[type[BaseException]] = [typer.Exit, typer.Abort]
    vendored = getattr(getattr(typer, "exceptions", None), "TyperException", None)
    if vendored is not None:
        errors.append(vendored)
    click = sys.modules.get("click")  # typer imported it if it uses it; else not needed
    if click is not None:
        errors += [click.exceptions.ClickException, click.exceptions.Abort]
    return tuple(errors)


_CLI_ERRORS = _cli_errors()


def handles_errors(fn: Callable[..., None]) -> Callable[..., None]:
    """Run a command, turning expected errors into a message (or JSON) and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        as_json = bool(kwargs.get("as_json"))
        try:
            with warnings_as_lines():
                fn(*args, **kwargs)
        except _CLI_ERRORS:
            raise
        except BrokenPipeError:  # `graphbuild cache ls | head`: the reader has what it wanted
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(EXIT_OK) from None
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
