"""What a run reports: events as they happen, and the report at the end.

:class:`StageEvent` (with an :class:`EventKind`) is one thing that happened to one stage; the
CLI's progress, ``status``, ``explain`` and the tests all consume the same events.
:class:`RunReport` holds one :class:`StageRecord` per stage, with the reason it ran and what
changed (:class:`Change`).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from graphbuild.engine.status import StageStatus


class EventKind(enum.Enum):
    STARTED = "started"
    HIT = "hit"
    CUTOFF = "cutoff"
    RAN = "ran"
    LOADED = "loaded"
    WAITING = "waiting"  # another process holds the lease on this key: its entry is awaited
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class StageEvent:
    """One thing that happened to one stage; progress displays and tests consume these."""

    kind: EventKind
    stage: str
    key: str | None = None
    seconds: float = 0.0
    reason: str | None = None
    error: BaseException | None = None
    #: where it happened, ``pid/thread`` (``pid/main``: the calling thread), or a cluster
    #: worker's name; empty from a sequential run
    worker: str = ""


@dataclass(frozen=True)
class Change:
    """One read (or the code, or an upstream output) that differs from the last run."""

    read: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.read}: {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class StageRecord:
    """The run report's line for one stage."""

    name: str
    status: StageStatus = StageStatus.PENDING
    key: str | None = None
    seconds: float = 0.0
    bytes: int = 0
    reason: str | None = None
    changes: list[Change] = field(default_factory=list)
    digest: str | None = None
    saved_seconds: float = 0.0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["changes"] = [{"read": c.read, "old": c.old, "new": c.new} for c in self.changes]
        return out


@dataclass
class RunReport:
    run_id: str
    stages: list[StageRecord]
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    #: where and when each stage settled: ``stage``, ``worker``, ``start`` and ``end`` (seconds
    #: from the run's start) and ``status``, by start time
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def __getitem__(self, name: str) -> StageRecord:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def statuses(self) -> dict[str, StageStatus]:
        return {s.name: s.status for s in self.stages}

    def with_status(self, *statuses: StageStatus | str) -> list[str]:
        return [s.name for s in self.stages if s.status in statuses]

    @property
    def ran(self) -> list[str]:
        return self.with_status(StageStatus.RAN)

    @property
    def hits(self) -> list[str]:
        return self.with_status(StageStatus.HIT, StageStatus.CUTOFF)

    @property
    def seconds_saved(self) -> float:
        return sum(s.saved_seconds for s in self.stages)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "seconds": self.seconds,
            "stages": [s.to_json() for s in self.stages],
            "timeline": list(self.timeline),
            **self.extra,
        }
