"""The cache: an action cache (key -> manifest) over a content-addressed blob store.

Reads verify every blob against its digest; a corrupt or missing entry is counted, removed and
treated as a miss, never an error. Writes are atomic; a cache that cannot be written (read-only
directory, full disk) warns once and the run goes on uncached.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from graphbuild.cache.blobs import BlobStore, CorruptBlob
from graphbuild.cache.index import ActionIndex
from graphbuild.engine.codecs import Encoded, blob_digests, decode
from graphbuild.errors import CacheError

_MANIFEST = "m:"
_LAST = "last:"
_PLACED = "placed:"
_TOUCH_EVERY = 60.0


def default_cache_dir() -> Path:
    """``$GRAPHBUILD_CACHE_DIR``, else the platform's user cache directory."""
    env = os.environ.get("GRAPHBUILD_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "graphbuild"


class CorruptEntry(Exception):
    """A cache entry that failed verification; it has been removed."""


@dataclass(frozen=True)
class CacheStats:
    entries: int
    blobs: int
    bytes: int
    hits: int
    misses: int
    corrupt: int
    bytes_saved: int
    seconds_saved: float
    path: str
    size_limit: int | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CacheEntry:
    key: str
    stage: str
    pipeline: str
    bytes: int
    seconds: float
    created: float
    last_used: float


@dataclass
class MaintenanceReport:
    """What prune, gc, verify or clear did."""

    removed_entries: int = 0
    removed_blobs: int = 0
    freed_bytes: int = 0
    checked_entries: int = 0
    checked_blobs: int = 0
    corrupt: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Cache:
    """Action cache + blob store at ``path`` (default: :func:`default_cache_dir`)."""

    def __init__(self, path: str | os.PathLike | None = None, size_limit: int | None = None):
        self.path = Path(path).expanduser() if path is not None else default_cache_dir()
        self.size_limit = size_limit
        self.blobs = BlobStore(self.path / "blobs")
        self._writable = True
        self._index: ActionIndex | None = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._index = ActionIndex(self.path / "index")
        except (OSError, sqlite3.Error) as err:
            if not self.path.exists():
                raise CacheError(f"cannot create the cache at {self.path}: {err}") from err
            self._write_failed(err)

    # ----------------------------------------------------------------- internals

    @property
    def index(self) -> ActionIndex:
        if self._index is None:
            raise CacheError(f"the cache index at {self.path} cannot be opened")
        return self._index

    @property
    def writable(self) -> bool:
        return self._writable

    def _write_failed(self, err: BaseException) -> None:
        if self._writable:
            warnings.warn(
                f"graphbuild: cannot write to the cache at {self.path} ({err}); "
                "going on without caching",
                RuntimeWarning,
                stacklevel=3,
            )
        self._writable = False

    def _count(self, counter: str, delta: int = 1) -> None:
        if not self._writable or self._index is None:
            return
        try:
            self._index.incr(counter, delta)
        except (OSError, sqlite3.Error) as err:
            self._write_failed(err)

    def _manifest(self, key: str) -> dict[str, Any] | None:
        if self._index is None:
            return None
        try:
            manifest = self._index.get_json(_MANIFEST + key)
        except (OSError, sqlite3.OperationalError):
            return None  # the index is unreachable (locked, missing): a miss, not corruption
        except Exception:  # a damaged row: pickled, not JSON, dangling value file...
            self._discard(key)
            return None
        if manifest is not None and manifest.get("key") != key:
            self._discard(key)  # a row holding another entry's manifest
            return None
        return manifest

    def _discard(self, key: str) -> None:
        """Forget a corrupt entry: count it and drop the manifest."""
        self._count("corrupt")
        if self._index is not None and self._writable:
            try:
                self._index.delete(_MANIFEST + key)
            except (OSError, sqlite3.Error) as err:
                self._write_failed(err)

    # ----------------------------------------------------------------- the run's API

    def lookup(self, key: str, *, count: bool = True) -> dict[str, Any] | None:
        """The manifest under ``key`` if every blob it names is present at its size."""
        manifest = self._manifest(key)
        if manifest is None:
            return None
        try:
            blobs = blob_digests(manifest["artifact"])
        except (KeyError, TypeError, ValueError):
            self._discard(key)
            return None
        if not all(self.blobs.has(d, s) for d, s in blobs):
            self._discard(key)
            return None
        if count:
            self._count("hits")
            self._count("bytes_saved", int(manifest.get("bytes", 0)))
            self._count("ms_saved", int(1000 * float(manifest.get("seconds", 0.0))))
            self._touch(key, manifest)
        return manifest

    def _touch(self, key: str, manifest: dict[str, Any]) -> None:
        now = time.time()
        if now - float(manifest.get("last_used", 0)) < _TOUCH_EVERY or not self._writable:
            return
        manifest["last_used"] = now
        try:
            self.index.set_json(_MANIFEST + key, manifest)
        except (OSError, sqlite3.Error) as err:
            self._write_failed(err)

    def count_miss(self) -> None:
        self._count("misses")

    def load(self, manifest: dict[str, Any]) -> Any:
        """Decode an entry's artifact, verifying every blob; raises CorruptEntry."""
        try:
            return decode(manifest["artifact"], self.blobs.read)
        except CorruptBlob as err:
            for digest, _ in blob_digests(manifest["artifact"]):
                if digest == err.digest or not self.blobs.verify(digest):
                    self.blobs.delete(digest)  # every bad part, so a rebuild rewrites them
            self._discard(manifest["key"])
            raise CorruptEntry(f"{manifest.get('stage', '?')}: {err}") from err
        except Exception as err:  # bytes intact but undecodable (an old or foreign format)
            self._discard(manifest["key"])
            raise CorruptEntry(
                f"{manifest.get('stage', '?')}: cannot decode ({type(err).__name__}: {err})"
            ) from err

    def store(self, key: str, encoded: Encoded, record: dict[str, Any]) -> bool:
        """Write blobs then the manifest; False (with one warning) when the cache is not
        writable."""
        if not self._writable or self._index is None:
            return False
        now = time.time()
        manifest = {
            **record,
            "key": key,
            "artifact": encoded.describe(),
            "bytes": encoded.size,
            "created": now,
            "last_used": now,
        }
        try:
            for part in encoded.all_parts():
                self.blobs.write(part.digest, part.data)
            self._index.set_json(_MANIFEST + key, manifest)
        except (OSError, sqlite3.Error) as err:
            self._write_failed(err)
            return False
        return True

    def last_run(self, pipeline: str, stage: str) -> dict[str, Any] | None:
        """What a stage read the last time it ran for ``pipeline`` (for ``explain``)."""
        return self._record(f"{_LAST}{pipeline}:{stage}")

    def record_run(self, pipeline: str, stage: str, record: dict[str, Any]) -> None:
        self._set_record(f"{_LAST}{pipeline}:{stage}", record)

    def placement(self, key: str) -> dict[str, Any] | None:
        """The stamp of what an export last placed in an output directory."""
        return self._record(f"{_PLACED}{key}")

    def record_placement(self, key: str, stamp: dict[str, Any]) -> None:
        self._set_record(f"{_PLACED}{key}", stamp)

    def _record(self, key: str) -> dict[str, Any] | None:
        """A side record (explain, placement); a damaged one only costs what it saves."""
        if self._index is None:
            return None
        try:
            return self._index.get_json(key)
        except Exception:
            return None

    def _set_record(self, key: str, value: dict[str, Any]) -> None:
        if not self._writable or self._index is None:
            return
        try:
            self._index.set_json(key, value)
        except (OSError, sqlite3.Error) as err:
            self._write_failed(err)

    # ----------------------------------------------------------------- maintenance

    def _manifests(self) -> Iterator[dict[str, Any]]:
        if self._index is None:
            return
        for k in list(self._index.keys(_MANIFEST)):
            m = self._manifest(k[len(_MANIFEST) :])
            if m is not None:
                yield m

    def entries(self) -> list[CacheEntry]:
        """Every action-cache entry, most recently used first."""
        out = [
            CacheEntry(
                m["key"],
                m.get("stage", "?"),
                m.get("pipeline", ""),
                int(m.get("bytes", 0)),
                float(m.get("seconds", 0.0)),
                float(m.get("created", 0.0)),
                float(m.get("last_used", 0.0)),
            )
            for m in self._manifests()
        ]
        out.sort(key=lambda e: e.last_used, reverse=True)
        return out

    def show(self, key_prefix: str) -> dict[str, Any] | None:
        """The manifest whose key starts with ``key_prefix`` (unique), for ``cache show``."""
        matches = [m for m in self._manifests() if m["key"].startswith(key_prefix)]
        return matches[0] if len(matches) == 1 else None

    def stats(self) -> CacheStats:
        blobs = list(self.blobs.all())
        idx = self._index
        return CacheStats(
            entries=sum(1 for _ in idx.keys(_MANIFEST)) if idx else 0,
            blobs=len(blobs),
            bytes=sum(s for _, s, _ in blobs),
            hits=idx.counter("hits") if idx else 0,
            misses=idx.counter("misses") if idx else 0,
            corrupt=idx.counter("corrupt") if idx else 0,
            bytes_saved=idx.counter("bytes_saved") if idx else 0,
            seconds_saved=(idx.counter("ms_saved") / 1000.0) if idx else 0.0,
            path=str(self.path),
            size_limit=self.size_limit,
        )

    def size(self) -> int:
        return sum(s for _, s, _ in self.blobs.all())

    def prune(
        self, max_bytes: int | None = None, older_than: float | None = None
    ) -> MaintenanceReport:
        """Drop entries least recently used first until the blobs they reference fit in
        ``max_bytes``; drop entries unused for ``older_than`` seconds; then free their blobs."""
        report = MaintenanceReport()
        manifests = sorted(self._manifests(), key=lambda m: float(m.get("last_used", 0)))
        refs: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for m in manifests:
            for d, s in blob_digests(m["artifact"]):
                refs[d] = refs.get(d, 0) + 1
                sizes[d] = s
        on_disk = {d: s for d, s, _ in self.blobs.all()}
        total = sum(on_disk.values())
        for d in set(on_disk) - set(refs):  # orphans go first
            total -= on_disk[d]
        cutoff = time.time() - older_than if older_than is not None else None
        for m in manifests:
            too_big = max_bytes is not None and total > max_bytes
            too_old = cutoff is not None and float(m.get("last_used", 0)) < cutoff
            if not (too_big or too_old):
                continue
            self.index.delete(_MANIFEST + m["key"])
            report.removed_entries += 1
            for d, _ in blob_digests(m["artifact"]):
                refs[d] -= 1
                if refs[d] == 0:
                    total -= sizes[d]
        gc = self.gc(grace=0.0)
        report.removed_blobs, report.freed_bytes = gc.removed_blobs, gc.freed_bytes
        return report

    def gc(self, grace: float = 600.0) -> MaintenanceReport:
        """Remove blobs no manifest references (older than ``grace`` seconds, so a
        concurrent writer's fresh blobs survive) and stale temporary files."""
        report = MaintenanceReport()
        referenced = {d for m in self._manifests() for d, _ in blob_digests(m["artifact"])}
        now = time.time()
        for digest, _size, mtime in list(self.blobs.all()):
            if digest not in referenced and now - mtime >= grace:
                report.freed_bytes += self.blobs.delete(digest)
                report.removed_blobs += 1
        for tmp in self.blobs.stale_temps(now - max(grace, 3600.0)):
            tmp.unlink(missing_ok=True)
        return report

    def verify(self, repair: bool = True) -> MaintenanceReport:
        """Re-hash every blob; with ``repair``, delete corrupt blobs and the entries that
        reference them (they become misses)."""
        report = MaintenanceReport(corrupt=[])
        bad: set[str] = set()
        for digest, _size, _ in list(self.blobs.all()):
            report.checked_blobs += 1
            if not self.blobs.verify(digest):
                bad.add(digest)
                report.corrupt.append(f"blob {digest}")
                if repair:
                    report.freed_bytes += self.blobs.delete(digest)
                    report.removed_blobs += 1
        for m in list(self._manifests()):
            report.checked_entries += 1
            blobs = blob_digests(m["artifact"])
            broken = [d for d, s in blobs if d in bad or not self.blobs.has(d, s)]
            if broken:
                report.corrupt.append(f"entry {m['key']} ({m.get('stage', '?')})")
                if repair:
                    self._discard(m["key"])
                    report.removed_entries += 1
        return report

    def clear(self) -> MaintenanceReport:
        """Remove everything: entries, blobs, counters and explain records."""
        report = MaintenanceReport(
            removed_entries=sum(1 for _ in self.index.keys(_MANIFEST)),
        )
        blobs = list(self.blobs.all())
        report.removed_blobs = len(blobs)
        report.freed_bytes = sum(s for _, s, _ in blobs)
        self.index.clear()
        self.blobs.clear()
        return report

    def enforce_limit(self) -> MaintenanceReport | None:
        """Prune to ``size_limit`` when the store has grown past it."""
        if self.size_limit is None or not self._writable:
            return None
        if self.size() <= self.size_limit:
            return None
        return self.prune(max_bytes=self.size_limit)

    def close(self) -> None:
        if self._index is not None:
            self._index.close()

    def __repr__(self) -> str:
        return f"Cache({str(self.path)!r})"
