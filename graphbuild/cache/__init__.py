"""Action cache (key -> manifest) and content-addressed blob store."""

from .blobs import BlobStore, CorruptBlob
from .key import stage_key
from .store import Cache, CacheEntry, CacheStats, CorruptEntry, MaintenanceReport, default_cache_dir

__all__ = [
    "BlobStore",
    "Cache",
    "CacheEntry",
    "CacheStats",
    "CorruptBlob",
    "CorruptEntry",
    "MaintenanceReport",
    "default_cache_dir",
    "stage_key",
]
