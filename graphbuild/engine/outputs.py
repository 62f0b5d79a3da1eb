"""What a run gives back: its outputs, loaded from the cache only when asked for."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from graphbuild.engine.events import RunReport
from graphbuild.engine.status import StageStatus

__all__ = ["LazyOutputs", "RunResult"]


class LazyOutputs(Mapping[str, Any]):
    """Stage outputs by name, loaded from the cache only when asked for."""

    def __init__(self, run: Any, names: Iterable[str]):
        self._run = run
        self._names = [
            n
            for n in names
            if run.states[n].record.status in (StageStatus.RAN, StageStatus.HIT, StageStatus.CUTOFF)
        ]

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        return self._run.load(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass
class RunResult:
    """What ``Pipeline.run`` returns: lazily loaded ``outputs`` of every stage, the
    ``captured`` ones (``capture_stage_output=True``), and the ``report``. A run with
    ``background_writes`` may still be storing outputs: :meth:`wait_for_cache` waits for
    that (and raises what a write raised)."""

    outputs: Mapping[str, Any]
    captured: Mapping[str, Any]
    report: RunReport
    _finish: Callable[[], None] | None = field(default=None, repr=False)

    def wait_for_cache(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
