"""Action cache (key -> manifest) and content-addressed blob store, local or shared.

``base`` holds the two store protocols, ``local`` the cache directory, ``redis`` a Redis
server, ``layered`` the two together; :class:`Cache` works over any pair.
"""

from graphbuild.cache.base import ActionIndex, BlobStore, CorruptBlob, Stores, StoreUnavailable
from graphbuild.cache.local import FileBlobs, default_cache_dir
from graphbuild.cache.store import (
    Cache,
    CacheEntry,
    CacheStats,
    CorruptEntry,
    MaintenanceReport,
)

__all__ = [
    "ActionIndex",
    "BlobStore",
    "Cache",
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
