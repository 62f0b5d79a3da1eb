"""The rebuilder's one decision: does the cache entry under a stage's key serve, or must the
stage run?

Build Systems à la Carte splits a build system into a scheduler (which stage next) and a
rebuilder (given a stage's key: take its entry, or run it). The scheduler
(:mod:`~graphbuild.engine.scheduler`), the planner (:mod:`~graphbuild.engine.plan`) and the
batch (:mod:`~graphbuild.engine.batch`) each schedule differently, and all of them ask
:func:`decide`, so the three cannot disagree on what is up to date.

An entry serves when the cache holds it under the key and every codec that wrote it is the
codec registered under that name now (the two-part rule of
:func:`~graphbuild.engine.key.stage_key`): ``hit``; no entry is a ``miss``; an entry written
by a codec that changed since is ``stale``, rebuilt with the reason.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphbuild.engine.explain import stale_reason
from graphbuild.engine.toolchain import codec_names

if TYPE_CHECKING:
    from graphbuild.engine.artifact_store import Cache
    from graphbuild.engine.keying import Keys

__all__ = ["Freshness", "Verdict", "decide", "stale_codecs"]


class Freshness(str, enum.Enum):
    """What the cache holds under a stage's key."""

    HIT = "hit"
    MISS = "miss"
    STALE = "stale"

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass(frozen=True)
class Verdict:
    """:func:`decide`'s answer: ``manifest`` is the entry (a hit or a stale one), ``reason``
    says why a stale entry does not serve."""

    freshness: Freshness
    manifest: dict[str, Any] | None = None
    reason: str | None = None

    @property
    def hit(self) -> bool:
        return self.freshness is Freshness.HIT


_MISS = Verdict(Freshness.MISS)


def decide(cache: Cache | None, key: str | None, keys: Keys, *, count: bool = True) -> Verdict:
    """Whether the entry under ``key`` serves stage outputs of this run: ``hit``, ``miss`` (no entry, no cache, or no key: an
    uncacheable stage) or ``stale`` (its codecs changed since it was written). ``keys``
    knows this run's codec versions; ``count``: count an entry found in the cache's
    statistics."""
    if cache is None or key is None:
        return _MISS
    manifest = cache.lookup(key, count=count)
    if manifest is None:
        return _MISS
    stale = stale_codecs(manifest, keys)
    if stale:
        return Verdict(Freshness.STALE, manifest, stale_reason(stale))
    return Verdict(Freshness.HIT, manifest)


def stale_codecs(manifest: Mapping[str, Any], keys: Keys) -> list[str]:
    """Codecs that wrote this entry and have changed since (a registration, an edit); ``?``
    for an entry that does not say which wrote it."""
    try:
        names = codec_names(manifest["artifact"])
        recorded = manifest.get("codecs") or {}
    except (KeyError, TypeError, AttributeError):
        return ["?"]
    current = keys.codec_versions(names)
    return [n for n in sorted(names) if recorded.get(n) != current[n]]
