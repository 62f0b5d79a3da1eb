"""Action cache (key -> manifest) and content-addressed blob store, local or shared: bytes
and manifests only.

``base`` holds the two store protocols, ``local`` the cache directory, ``redis`` a Redis
server, ``layered`` the two together, ``manifest`` the checks on what is read back;
:class:`ByteCache` works over any pair and maintains it. Nothing here decodes an artifact:
the engine's :class:`~graphbuild.engine.artifact_store.Cache` (``graphbuild.Cache``) adds that.
"""

from graphbuild.cache.base import ActionIndex, BlobStore, CorruptBlob, Stores, StoreUnavailable
from graphbuild.cache.byte_store import (
    ByteCache,
    CacheEntry,
    CacheStats,
    CorruptEntry,
    MaintenanceReport,
)
from graphbuild.cache.local import FileBlobs, default_cache_dir

__all__ = [
    "ActionIndex",
    "BlobStore",
    "ByteCache",
    "CacheEntry",
    "CacheStats",
    "CorruptBlob",
    "CorruptEntry",
    "FileBlobs",
    "MaintenanceReport",
    "StoreUnavailable",
    "Stores",
    "default_cache_dir",
]
