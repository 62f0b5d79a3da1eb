"""The cache a run uses: artifacts over the byte cache.

:class:`Cache` is :class:`~graphbuild.cache.store.ByteCache` (manifests, blobs, records,
maintenance) plus what only the engine knows: how a stage output is encoded into blobs and a
manifest (:mod:`graphbuild.engine.codecs`), and how a hit is decoded back, each blob verified
as it is read. An entry that cannot be decoded is removed and becomes a miss
(:class:`~graphbuild.cache.store.CorruptEntry`), never an error.
"""

from __future__ import annotations

from typing import Any

from graphbuild.cache.base import CorruptBlob
from graphbuild.cache.manifest import without_bytes
from graphbuild.cache.store import (
    ByteCache,
    CacheEntry,
    CacheStats,
    CorruptEntry,
    MaintenanceReport,
)
from graphbuild.engine.codecs import Encoded, decode

__all__ = ["Cache", "CacheEntry", "CacheStats", "CorruptEntry", "MaintenanceReport"]


class Cache(ByteCache):
    """Action cache + blob store holding stage outputs. ``Cache(path)``: the local directory
    at ``path`` (default :func:`~graphbuild.cache.local.default_cache_dir`); with ``url``,
    layered over the shared cache there (local first, hits copied down, results pushed up;
    ``remote_readonly``: never push). :meth:`over` builds one over any pair of stores,
    :meth:`remote` over a shared cache alone (for maintenance)."""

    def load(self, manifest: dict[str, Any]) -> Any:
        """Decode an entry's artifact, verifying every blob; raises CorruptEntry."""
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
