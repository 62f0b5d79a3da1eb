"""Live progress of a run: one line per stage, from the scheduler's event stream.

On a terminal a spinner while a stage runs and a coloured line per finished stage; elsewhere (a
pipe, a CI log) the same lines without spinners or colour. A build with ``-j`` > 1 shows a
line per running stage (the stage names its part: ``p2.token.to_onnx``) with the worker that
runs it, and each finished line names its worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from graphbuild.cli.errors import first_line
from graphbuild.engine.status import StageStatus

if TYPE_CHECKING:
    from graphbuild.engine.events import RunReport, StageEvent

__all__ = ["Progress"]

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
        self._skipped: list[StageEvent] = []
        self._running: dict[str, str] = {}  # stage -> worker, for a build with jobs > 1

    def __enter__(self) -> Progress:
        if self.live:
            self._status = self.console.status("planning…", spinner="dots")
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._flush_skipped()
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
            if event.worker:
                self._running[event.stage] = event.worker
                self._spin(self._running_lines())
                return
            self._spin(f"[bold]{event.stage}[/] running…{_escape(why)}")
            return
        if kind != "loaded" and self._running.pop(event.stage, None) is not None:
            self._spin(self._running_lines() or "working…")
        if kind == "loaded":
            self._spin(f"loaded {event.stage} from the cache")
            return
        if kind == "waiting":  # another process holds the lease on this stage's key
            self._spin(f"[bold]{event.stage}[/] waiting…{_escape(f' ({event.reason})')}")
            return
        if self.quiet or kind not in _STYLES:
            return
        if kind == "skipped":
            self._skipped.append(event)
            return
        self._flush_skipped()
        self.console.print(self.line(event))
        self._spin(self._running_lines() or "working…")

    def _running_lines(self) -> str:
        """One line per running stage, with its worker."""
        return "\n".join(
            f"[bold]{stage}[/] running… [dim]on {_escape(worker)}[/]"
            for stage, worker in self._running.items()
        )

    def _flush_skipped(self) -> None:
        """Stages skipped after a failure, on one line: the failure is what matters."""
        events, self._skipped = self._skipped, []
        if len(events) == 1:
            self.console.print(self.line(events[0]))
        elif events:
            symbol, style = _STYLES["skipped"]
            text = Text(f"{symbol} " if self.live else "")
            text.append(f"{'(' + str(len(events)) + ' stages)':<16} ")
            text.append(f"{'skipped':<7}", style=style if self.live else "")
            names = ", ".join(e.stage for e in events)
            text.append(f"  upstream did not complete: {names}", style="dim" if self.live else "")
            self.console.print(text)

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
            if event.worker:
                text.append(f"  on {event.worker}", style="dim" if self.live else "")
        detail = event.reason
        if kind == "failed" and event.error is not None:
            detail = f"{type(event.error).__name__}: {first_line(event.error)[0]}"
        elif kind == "cutoff":
            detail = "early cutoff: upstream output unchanged"
        if detail:
            text.append(f"  {detail}", style="dim" if self.live else "")
        text.rstrip()
        return text

    def summary(self, report: RunReport, seconds: float) -> Text:
        cutoff = len(report.with_status(StageStatus.CUTOFF))
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
