"""The status of a stage in a run report or a plan: one enum for the scheduler, the planner,
the CLI and the tests.

A ``str`` enum: a status compares equal to its value (``StageStatus.HIT == "hit"``), formats
and serializes as the plain word, so JSON reports and cache records hold the same text as
before the enum existed.
"""

from __future__ import annotations

import enum

__all__ = ["StageStatus"]


class StageStatus(str, enum.Enum):
    """``PENDING`` before a stage is reached. A run ends each stage ``HIT`` (the cache held
    its output), ``CUTOFF`` (a hit whose upstream reran with an identical output), ``RAN``,
    ``FAILED`` or ``SKIPPED`` (upstream did not complete). A plan says ``HIT``, ``DIRTY``
    (will run, with the reason) or ``MAYBE`` (downstream of a dirty stage: runs unless the
    upstream output comes out unchanged)."""

    PENDING = "pending"
    HIT = "hit"
    CUTOFF = "cutoff"
    RAN = "ran"
    FAILED = "failed"
    SKIPPED = "skipped"
    DIRTY = "dirty"
    MAYBE = "maybe"

    # The plain word in f-strings, str() and repr() (a printed report reads as before the enum),
    # on every Python (3.11 changed Enum.__format__).
    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__
