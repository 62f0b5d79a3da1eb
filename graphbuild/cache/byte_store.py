"""The cache as bytes: an action index (key -> manifest) over a content-addressed blob store.

:class:`ByteCache` works over any pair of stores (:mod:`graphbuild.cache.base`): the local
directory, a Redis server, or both layered. Reads verify every manifest against its own digest
and every blob against its digest; a corrupt or missing entry is counted, removed and treated
as a miss, never an error. Writes are atomic; a cache that cannot be written (full disk, an
unreachable server) warns once and the run goes on uncached; a read-only cache (a mounted team
cache, a CI runner, a consumer of a shared server) is read without a warning and gives hits.
Explain records and placement stamps are checked for shape: a malformed one is no record.

It knows manifests and blobs, never what an artifact decodes to: which blobs an entry holds
is read from its manifest (:func:`~graphbuild.cache.manifest.blob_refs`), so maintenance
(stats, prune, gc, verify) and every backend work without a codec. The engine's
:class:`~graphbuild.engine.artifact_store.Cache` adds the artifacts (encode on store, decode on load).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from graphbuild.cache.base import ActionIndex, Stores
from graphbuild.cache.layered import in_front_of_shared
from graphbuild.cache.local import cannot_write, open_local
from graphbuild.cache.manifest import (
    InvalidManifest,
    blob_refs,
    check_explain_record,
    check_manifest,
    check_memo_record,
    check_placement_stamp,
    check_run_record,
)
from graphbuild.errors import CacheError

__all__ = [
    "ByteCache",
    "CacheEntry",
    "CacheStats",
    "CorruptEntry",
    "MaintenanceReport",
]

_C = TypeVar("_C", bound="ByteCache")

_MANIFEST = "m:"
_LAST = "last:"
_PLACED = "placed:"
_MEMO = "memo:"
_TOUCH_EVERY = 60.0


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
    readonly: bool = False
    quarantined: str | None = None
    damaged: str | None = None

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
    checked_records: int = 0
    corrupt: list[str] | None = None
    quarantined: str | None = None
    notes: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ByteCache:
    """Action cache + blob store. ``ByteCache(path)``: the local directory at ``path``
    (default :func:`default_cache_dir`); with ``url``, layered over the shared cache there
    (local first, hits copied down, results pushed up; ``remote_readonly``: never push).
    :meth:`over` builds one over any pair of stores, :meth:`remote` over a shared cache alone
    (for maintenance)."""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        size_limit: int | None = None,
        *,
        readonly: bool = False,
        url: str | None = None,
        remote_readonly: bool = False,
        repair: bool = True,
    ):
        stores = open_local(path, readonly=readonly, repair=repair)
        if url and stores.index is not None:
            stores = in_front_of_shared(stores, url, remote_readonly)
        self._attach(stores, size_limit)

    @classmethod
    def over(cls: type[_C], stores: Stores, size_limit: int | None = None) -> _C:
        """A cache over ``stores`` (any index and blob store, :mod:`graphbuild.cache.base`)."""
        cache = cls.__new__(cls)
        cache._attach(stores, size_limit)
        return cache

    @classmethod
    def remote(cls: type[_C], url: str, *, readonly: bool = False) -> _C:
        """The shared cache at ``url`` alone (``graphbuild cache ... --cache-url``); a
        CacheError when it cannot be reached."""
        from graphbuild.cache.remote import open_remote

        try:
            return cls.over(open_remote(url, readonly=readonly))
        except OSError as err:
            raise CacheError(str(err)) from err

    def _attach(self, stores: Stores, size_limit: int | None) -> None:
        self.stores = stores
        self.path: Path | None = stores.path
        self.location = stores.location
        self.size_limit = size_limit
        self.blobs = stores.blobs
        self._index = stores.index
        self.readonly = stores.readonly
        self._writable = not stores.readonly and stores.index is not None
        self.quarantined, self.damage = stores.quarantined, stores.damage
        self.unwritable = stores.unwritable

    @property
    def marked(self) -> bool:
        """True when maintenance may remove things here (a local directory carries
        graphbuild's marker; a server's keys are all graphbuild's own)."""
        return self.stores.maintainable() is None

    # ----------------------------------------------------------------- internals

    @property
    def index(self) -> ActionIndex:
        if self._index is None:
            why = f": {self.damage}" if self.damage else ""
            raise CacheError(f"the cache index at {self.location} cannot be opened{why}")
        return self._index

    def _maintainable(self, what: str) -> ActionIndex:
        """The index, for maintenance that removes things: only in a marked, writable cache."""
        if self.readonly or not self._writable:
            raise CacheError(f"cannot {what} the cache at {self.location}: it is read-only")
        refusal = self.stores.maintainable()
        if refusal is not None:
            raise CacheError(f"refusing to {what} {self.location}: {refusal}")
        return self.index

    @property
    def writable(self) -> bool:
        return self._writable

    def _write_failed(self, err: BaseException) -> None:
        if self._writable:
            self.unwritable = cannot_write(err, self.path) if self.path else str(err)
            warnings.warn(
                f"graphbuild: cannot write to the cache at {self.location} ({self.unwritable}); "
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
        except OSError as err:
            self._write_failed(err)

    def _manifest(self, key: str) -> dict[str, Any] | None:
        if self._index is None:
            return None
        try:
            manifest = self._index.get_json(_MANIFEST + key)
        except OSError:
            return None  # the index is unreachable (locked, a server down): a miss
        except Exception:  # a damaged row: pickled, not JSON, dangling value file...
            self._discard(key)
            return None
        if manifest is None:
            return None
        try:
            return check_manifest(key, manifest)
        except InvalidManifest:  # another key's entry, a digest that does not match, ...
            self._discard(key)
            return None

    def _discard(self, key: str) -> None:
        """Forget a corrupt entry: count it and drop the manifest."""
        self._count("corrupt")
        if self._index is not None and self._writable:
            try:
                self._index.delete(_MANIFEST + key)
            except OSError as err:
                self._write_failed(err)

    # ----------------------------------------------------------------- the run's API

    def lookup(self, key: str, *, count: bool = True) -> dict[str, Any] | None:
        """The manifest under ``key`` if every blob it names is present at its size."""
        manifest = self._manifest(key)
        if manifest is None:
            return None
        blobs = blob_refs(manifest["artifact"])
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
        except OSError as err:
            self._write_failed(err)

    def count_miss(self) -> None:
        self._count("misses")

    def drop_corrupt(self, manifest: dict[str, Any], digest: str) -> None:
        """Forget an entry whose blob ``digest`` read back corrupt: with it, every blob of the
        entry that fails its digest (so a rebuild rewrites them all)."""
        if self._writable:
            for d, _ in blob_refs(manifest["artifact"]):
                if d == digest or not self.blobs.verify(d):
                    self.blobs.delete(d)
        self._discard(manifest["key"])

    def discard(self, manifest: dict[str, Any]) -> None:
        """Forget an entry whose bytes are intact but useless (undecodable, a foreign format)."""
        self._discard(manifest["key"])

    def put(
        self,
        key: str,
        artifact: dict[str, Any],
        blobs: Iterable[tuple[str, bytes | bytearray | memoryview]],
        record: dict[str, Any],
    ) -> bool:
        """Write ``blobs`` ((digest, bytes) of every part ``artifact`` describes), then the
        manifest; False (with one warning) when the cache is not writable."""
        if not self._writable or self._index is None:
            return False
        now = time.time()
        manifest = {
            **record,
            "key": key,
            "artifact": artifact,
            "bytes": sum(size for _, size in blob_refs(artifact)),
            "created": now,
            "last_used": now,
        }
        try:
            for digest, data in blobs:
                self.blobs.write(digest, data)
            self._index.set_json(_MANIFEST + key, manifest)
        except OSError as err:
            self._write_failed(err)
            return False
        return True

    def last_run(self, pipeline: str, stage: str) -> dict[str, Any] | None:
        """What a stage read the last time it ran for ``pipeline`` (for ``explain``)."""
        return check_run_record(self._record(f"{_LAST}{pipeline}:{stage}"))

    def record_run(self, pipeline: str, stage: str, record: dict[str, Any]) -> None:
        self._set_record(f"{_LAST}{pipeline}:{stage}", record)

    def placement(self, key: str) -> dict[str, Any] | None:
        """The stamp of what an export last placed in an output directory, as stored: the
        placement checks it against the files its pipeline declares before using it."""
        return self._record(f"{_PLACED}{key}")

    def record_placement(self, key: str, stamp: dict[str, Any]) -> None:
        self._set_record(f"{_PLACED}{key}", stamp)

    def memo(self, key: str) -> dict[str, Any] | None:
        """A record a new process would otherwise recompute (``engine.source_memo``)."""
        return self._record(f"{_MEMO}{key}")

    def record_memo(self, key: str, value: dict[str, Any]) -> None:
        """Keep a memo record; one the cache cannot take only costs the time it saves."""
        if self._writable and self._index is not None:
            with contextlib.suppress(OSError):
                self._index.set_json(f"{_MEMO}{key}", value)

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
        except OSError as err:
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

    def show(self, key_prefix: str) -> list[dict[str, Any]]:
        """Every valid manifest whose key starts with ``key_prefix``, for ``cache show``."""
        return [m for m in self._manifests() if m["key"].startswith(key_prefix)]

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
            path=self.location,
            size_limit=self.size_limit,
            readonly=self.readonly,
            quarantined=str(self.quarantined) if self.quarantined else None,
            damaged=self.damage,
        )

    def size(self) -> int:
        return sum(s for _, s, _ in self.blobs.all())

    def _report(self, **fields: Any) -> MaintenanceReport:
        report = MaintenanceReport(**fields)
        if self.quarantined is not None:
            report.quarantined = str(self.quarantined)
            report.notes = [
                f"the index was damaged: moved to {self.quarantined} and started afresh; "
                "blobs are kept until an export has rebuilt the index"
            ]
        return report

    def prune(
        self, max_bytes: int | None = None, older_than: float | None = None
    ) -> MaintenanceReport:
        """Drop entries least recently used first until the blobs they reference fit in
        ``max_bytes``; drop entries unused for ``older_than`` seconds; then free their blobs."""
        index = self._maintainable("prune")
        report = self._report()
        manifests = sorted(self._manifests(), key=lambda m: float(m.get("last_used", 0)))
        refs: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for m in manifests:
            for d, s in blob_refs(m["artifact"]):
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
            if not index.delete(_MANIFEST + m["key"]):
                continue  # gone already (another process pruned it)
            report.removed_entries += 1
            for d, _ in blob_refs(m["artifact"]):
                refs[d] -= 1
                if refs[d] == 0:
                    total -= sizes[d]
        gc = self.gc(grace=0.0)
        report.removed_blobs, report.freed_bytes = gc.removed_blobs, gc.freed_bytes
        return report

    def gc(self, grace: float = 600.0) -> MaintenanceReport:
        """Remove blobs no manifest references (older than ``grace`` seconds, so a
        concurrent writer's fresh blobs survive) and stale temporary files. Only blobs
        actually removed are counted."""
        self._maintainable("collect garbage in")
        report = self._report()
        if self.quarantined is not None:
            return report  # an empty fresh index references nothing: keep the blobs for now
        referenced = {d for m in self._manifests() for d, _ in blob_refs(m["artifact"])}
        now = time.time()
        for digest, _size, mtime in list(self.blobs.all()):
            if digest not in referenced and now - mtime >= grace:
                freed = self.blobs.delete(digest)
                if freed is not None:
                    report.freed_bytes += freed
                    report.removed_blobs += 1
        self.blobs.sweep(now - max(grace, 3600.0))
        return report

    def verify(self, repair: bool = True) -> MaintenanceReport:
        """Re-hash every blob and check every manifest; with ``repair``, delete corrupt blobs
        and the entries that reference them or fail their own checks (they become misses).
        A read-only cache is checked and reported on, never repaired."""
        report = self._report(corrupt=[])
        report.notes = report.notes or []
        assert report.corrupt is not None and report.notes is not None
        why = self.unwritable or "it is read-only"
        if repair and self.readonly:  # a full disk too: report, and repair another time
            repair = False
            report.notes.append(f"cannot write to {self.location} ({why}): reported only")
        if repair:
            self._maintainable("repair")
        if self._index is None:  # unreadable on a full disk: not known to be corrupt
            to = report.notes if self.unwritable and not self.damage else report.corrupt
            to.append(f"index ({self.damage or 'cannot be opened'})")
        index = self._index
        bad: set[str] = set()
        for digest, _size, _ in list(self.blobs.all()):
            report.checked_blobs += 1
            if not self.blobs.verify(digest):
                bad.add(digest)
                report.corrupt.append(f"blob {digest}")
                if repair:
                    freed = self.blobs.delete(digest)
                    if freed is not None:
                        report.freed_bytes += freed
                        report.removed_blobs += 1
        for k in list(index.keys(_MANIFEST)) if index is not None else []:
            key = k[len(_MANIFEST) :]
            report.checked_entries += 1
            try:
                raw = index.get_json(k)
                m = check_manifest(key, raw)
            except Exception as err:
                report.corrupt.append(f"entry {key[:80]} ({_why(err)})")
                if repair and self._remove_entry(k):
                    report.removed_entries += 1
                continue
            blobs = blob_refs(m["artifact"])
            broken = [d for d, s in blobs if d in bad or not self.blobs.has(d, s)]
            if broken:
                report.corrupt.append(f"entry {m['key']} ({m.get('stage', '?')})")
                if repair and self._remove_entry(k):
                    report.removed_entries += 1
        if index is not None:
            self._verify_records(index, report, repair)
        return report

    def _verify_records(self, index: ActionIndex, report: MaintenanceReport, repair: bool) -> None:
        """Check every side record the store holds (explain records, placement stamps, memo
        records) for the shape their readers accept; with ``repair`` remove those that fail
        (each only costs what it would have saved)."""
        assert report.corrupt is not None
        for prefix, check in _RECORD_CHECKS.items():
            for k in list(index.keys(prefix)):
                report.checked_records += 1
                try:
                    record = index.get_json(k)
                    if record is not None:  # None: removed since it was listed
                        check(record)
                except OSError:
                    raise
                except Exception as err:
                    report.corrupt.append(f"record {k[:80]} ({_why(err)})")
                    if repair:
                        try:
                            index.delete(k)
                        except OSError:
                            continue

    def _remove_entry(self, index_key: str) -> bool:
        self._count("corrupt")
        try:
            return self.index.delete(index_key)
        except OSError:
            return False

    def clear(self) -> MaintenanceReport:
        """Remove everything the store wrote: entries, blobs, counters and explain records.
        Files the store never writes stay where they are."""
        index = self._maintainable("clean")
        report = self._report(removed_entries=sum(1 for _ in index.keys(_MANIFEST)))
        index.clear()
        report.removed_blobs, report.freed_bytes = self.blobs.clear()
        return report

    def enforce_limit(self) -> MaintenanceReport | None:
        """Prune to ``size_limit`` when the store has grown past it; in front of a shared
        cache, the local one only (a machine's limit never prunes the team's cache)."""
        if self.size_limit is None or not self._writable or not self.marked:
            return None
        if self.stores.local is not None:
            return ByteCache.over(self.stores.local, self.size_limit).enforce_limit()
        if self.size() <= self.size_limit:
            return None
        return self.prune(max_bytes=self.size_limit)

    def close(self) -> None:
        self.stores.close()

    def release_thread(self) -> None:
        """Close what the calling thread holds open of the stores (see
        :meth:`Stores.release_thread`); the cache stays usable, from any thread."""
        self.stores.release_thread()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"


_RECORD_CHECKS = {
    _LAST: check_explain_record,
    _PLACED: check_placement_stamp,
    _MEMO: check_memo_record,
}


def _why(err: BaseException) -> str:
    if isinstance(err, InvalidManifest):
        return str(err)
    return f"unreadable: {type(err).__name__}"
