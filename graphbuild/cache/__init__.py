"""Action cache (key -> manifest) and content-addressed blob store."""

from graphbuild.cache.blobs import BlobStore, CorruptBlob
from graphbuild.cache.store import (
    Cache,
    CacheEntry,
    CacheStats,
    CorruptEntry,
    MaintenanceReport,
    default_cache_dir,
)

__all__ = [
    "BlobStore",
    "Cache",
    "CacheEntry",
    "CacheStats",
    "CorruptBlob",
    "CorruptEntry",
    "MaintenanceReport",
    "default_cache_dir",
]
