"""The cache a run uses: artifacts over the byte cache.

:class:`Cache` is :class:`~graphbuild.cache.byte_store.ByteCache` (manifests, blobs, records,
maintenance) plus what only the engine knows: how a stage output is encoded into blobs and a
manifest (:mod:`graphbuild.engine.codecs`), and how a hit is decoded back, each blob verified
as it is read. An entry that cannot be decoded is removed and becomes a miss
(:class:`~graphbuild.cache.byte_store.CorruptEntry`), never an error.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from graphbuild.cache.base import CorruptBlob
from graphbuild.cache.byte_store import (
    ByteCache,
    CacheEntry,
    CacheStats,
    CorruptEntry,
    MaintenanceReport,
)
from graphbuild.cache.leases import LeaseHolding
from graphbuild.cache.manifest import without_bytes
from graphbuild.engine.codecs import Encoded, decode

__all__ = ["Cache", "CacheEntry", "CacheStats", "CorruptEntry", "MaintenanceReport"]


class _Values:
    """Decoded stage outputs by artifact digest, the least recently used dropped first once
    they pass ``max_bytes`` (their encoded sizes)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.total = 0
        self.lock = threading.Lock()

    def get(self, digest: str) -> tuple[bool, Any]:
        with self.lock:
            item = self.items.get(digest)
            if item is None:
                return False, None
            self.items.move_to_end(digest)
            return True, item[0]

    def put(self, digest: str, value: Any, size: int) -> None:
        if size > self.max_bytes:
            return
        with self.lock:
            if digest in self.items:
                self.items.move_to_end(digest)
                return
            self.items[digest] = (value, size)
            self.total += size
            while self.total > self.max_bytes:
                _, (_, dropped) = self.items.popitem(last=False)
                self.total -= dropped


class Cache(ByteCache, LeaseHolding):
    """Action cache + blob store holding stage outputs. ``Cache(path)``: the local directory
    at ``path`` (default :func:`~graphbuild.cache.local.default_cache_dir`); with ``url``,
    layered over the shared cache there (local first, hits copied down, results pushed up;
    ``remote_readonly``: never push). :meth:`over` builds one over any pair of stores,
    :meth:`remote` over a shared cache alone (for maintenance). Leases on keys let the
    processes sharing it build each key once at a time (:class:`LeaseHolding`)."""

    _values: _Values | None = None

    def keep_values(self, max_bytes: int | None) -> None:
        """Keep up to ``max_bytes`` of decoded outputs in this process, by artifact digest, so
        that a later run reading the same artifact takes it from memory (one export keeps its
        values for its own run anyway; many runs over one cache, a sweep's jobs, reread
        them). Sound because artifacts are content-addressed and read-only (docs/design.md,
        invariant 9). Only what was decoded is kept, never a value as a stage returned it:
        every reader gets the artifact in the one form a load gives, whichever process made
        it. None: keep none (the default)."""
        self._values = _Values(max_bytes) if max_bytes else None

    def load(self, manifest: dict[str, Any]) -> Any:
        """Decode an entry's artifact, verifying every blob; raises CorruptEntry."""
        digest = manifest["artifact"].get("digest") if self._values is not None else None
        if digest is not None:
            found, value = self._values.get(digest)  # type: ignore[union-attr]
            if found:
                return value
        value = self._decode(manifest)
        if digest is not None:
            self._values.put(digest, value, int(manifest.get("bytes", 0)))  # type: ignore[union-attr]
        return value

    def _decode(self, manifest: dict[str, Any]) -> Any:
        try:
            return decode(manifest["artifact"], self.blobs.read)
        except CorruptBlob as err:
            self.drop_corrupt(manifest, err.digest)
            raise CorruptEntry(f"{manifest.get('stage', '?')}: {err}") from err
        except Exception as err:  # bytes intact but undecodable (an old or foreign format)
            self.discard(manifest)
            raise CorruptEntry(
                f"{manifest.get('stage', '?')}: cannot decode ({type(err).__name__}: {err})"
            ) from err

    def store(
        self, key: str, encoded: Encoded, record: dict[str, Any], keep_bytes: bool = True
    ) -> bool:
        """Write the encoded value's blobs then its manifest; False (with one warning) when
        the cache is not writable. Without ``keep_bytes`` only the manifest is written: the
        entry gives the output's digest (a hit, early cutoff) and the run that needs the value
        recomputes it (a stage that rematerializes its output)."""
        if not keep_bytes:
            return self.put(key, without_bytes(encoded.describe()), (), record)
        blobs = ((part.digest, part.data) for part in encoded.all_parts())
        return self.put(key, encoded.describe(), blobs, record)
