"""The cache's two stores, as protocols: an action index and a blob store.

:class:`~graphbuild.cache.byte_store.ByteCache` works over any pair: the local directory
(:mod:`graphbuild.cache.local`), a Redis server (:mod:`graphbuild.cache.redis`), or the two
layered (:mod:`graphbuild.cache.layered`). The split follows Hamilton's caching stores: key ->
small JSON record in one store, digest -> bytes in the other, and nothing else in common.

What every backend promises (``tests/test_cache_contract.py`` checks each one):

- Whatever a store returns is untrusted data. The index returns JSON objects (or raises
  ``ValueError`` for a row that is not one); the blob store returns bytes only after checking
  them against their digest. Only 32 lowercase hex digits are a digest; anything else is
  refused before it names a path or a key.
- A store that cannot be reached or written raises ``OSError`` (:class:`StoreUnavailable` for
  a backend that is not a file system); a read that fails that way is a miss, a write that
  fails that way turns caching off for the run, with one warning. A write refused because
  this user may only read raises :class:`StoreReadOnly`: the store is then read, not
  written, for the rest of the run.
- Maintenance (``delete``, ``clear``, ``sweep``) removes only what the store itself writes.
- Leases (in-flight deduplication): an index hands out named leases with a timeout. Of the
  processes asking for one lease at the same moment exactly one gets it; its holder renews it
  while it works and gives it back when done; a holder that dies stops renewing, and the
  lease is free again once its time runs out, so a dead holder never blocks others for
  longer than that. A read-only index refuses leases with ``OSError``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from graphbuild.hashing import digest_bytes


class StoreUnavailable(OSError):
    """A store that cannot be reached, opened or written right now."""


class StoreReadOnly(StoreUnavailable):
    """A store this process may read and may not write (a server whose ACL lets this user
    read only): a reader, not a store that is gone."""


class CorruptBlob(Exception):
    """A blob that is missing, truncated or whose bytes do not match its digest."""

    def __init__(self, digest: str, why: str):
        self.digest = digest
        super().__init__(f"blob {str(digest)[:16]!s}... {why}")


def checked_blob(digest: str, data: bytes, size: int | None) -> bytes:
    """``data`` if it is the blob ``digest`` names (of ``size`` bytes when given); raises
    CorruptBlob. Every store reads through this, whatever it keeps the bytes in."""
    if size is not None and len(data) != size:
        raise CorruptBlob(digest, f"has {len(data)} bytes, expected {size}")
    if digest_bytes(data) != digest:
        raise CorruptBlob(digest, "does not match its digest")
    return data


def _memory_bytes() -> int:
    """This machine's physical memory (2**62 where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**62


def check_blob_size(digest: str, size: int) -> None:
    """CorruptBlob when a manifest says a blob holds more bytes than this machine has memory:
    reading it would only end in the kernel killing the process, so the entry is a miss."""
    if size > _memory_bytes():
        raise CorruptBlob(digest, f"claims {size} bytes, more than this machine's memory")


def read_only_error(where: str = "") -> OSError:
    """The error a read-only store raises on a write."""
    return OSError(errno.EROFS, os.strerror(errno.EROFS), where or None)


@runtime_checkable
class ActionIndex(Protocol):
    """Key -> JSON object (manifests, explain records, placement stamps), and counters."""

    readonly: bool

    def get_json(self, key: str) -> dict[str, Any] | None:
        """The object under ``key``; None when absent; ``ValueError`` (or another
        exception that is not ``OSError``) when the row is not a JSON object."""
        ...

    def set_json(self, key: str, value: dict[str, Any]) -> None: ...

    def delete(self, key: str) -> bool:
        """True when the key was there and is gone."""
        ...

    def keys(self, prefix: str) -> Iterator[str]: ...

    def incr(self, counter: str, delta: int = 1) -> None: ...

    def counter(self, counter: str) -> int:
        """A counter's value; 0 when absent or not a number."""
        ...

    def clear(self) -> None:
        """Remove every row the index wrote."""
        ...

    def acquire_lease(self, name: str, owner: str, seconds: float) -> bool:
        """Take lease ``name`` for ``owner`` for ``seconds`` unless another owner holds one
        that has not expired; True when taken. Atomic across processes and machines."""
        ...

    def renew_lease(self, name: str, owner: str, seconds: float) -> bool:
        """Extend ``owner``'s lease to ``seconds`` from now; False when ``owner`` no longer
        holds it (it expired, and perhaps another owner took it)."""
        ...

    def release_lease(self, name: str, owner: str) -> bool:
        """Give the lease back; False when ``owner`` did not hold it (nothing is changed)."""
        ...

    def lease_holder(self, name: str) -> str | None:
        """The owner holding lease ``name`` now; None when it is free."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class BlobStore(Protocol):
    """Digest -> bytes, content-addressed: a blob's name is the xxh3-128 of its bytes."""

    readonly: bool

    def has(self, digest: str, size: int) -> bool:
        """True when a blob of that size is stored (its bytes are checked on read)."""
        ...

    def write(self, digest: str, data: bytes | bytearray | memoryview) -> bool:
        """Store ``data`` under ``digest`` unless present; True when written. Atomic: a
        reader sees the whole blob or none."""
        ...

    def read(self, digest: str, size: int | None = None) -> bytes:
        """The blob's bytes, checked against its digest; raises :class:`CorruptBlob`."""
        ...

    def verify(self, digest: str) -> bool: ...

    def delete(self, digest: str) -> int | None:
        """The size freed; None when absent or when it could not be removed."""
        ...

    def all(self) -> Iterator[tuple[str, int, float]]:
        """Every blob as (digest, size, time written)."""
        ...

    def sweep(self, older_than: float) -> int:
        """Remove leftovers of writes that never finished, started before ``older_than``
        (a time.time()); the number removed."""
        ...

    def clear(self) -> tuple[int, int]:
        """Remove every blob the store wrote: (blobs removed, bytes freed)."""
        ...

    def close(self) -> None: ...


@dataclass
class Stores:
    """An index and a blob store that belong together, and what the cache should know about
    them: where they are (for messages), whether this process may write them, whether
    maintenance may remove things there, and what opening them repaired or found damaged."""

    index: ActionIndex | None
    blobs: BlobStore
    location: str
    readonly: bool = False
    maintainable: Callable[[], str | None] = field(default=lambda: None)
    path: Path | None = None
    quarantined: Path | None = None
    damage: str | None = None
    #: why this process cannot write stores it should (a full disk), when opening found out
    unwritable: str | None = None
    local: Stores | None = None  # a layered pair's local half (a size limit applies to it)

    def close(self) -> None:
        if self.index is not None:
            self.index.close()
        self.blobs.close()

    def release_thread(self) -> None:
        """Close what the calling thread alone holds open (an index's per-thread
        connection): a worker thread calls it before it ends."""
        release_thread(self.index)


def release_thread(index: ActionIndex | None) -> None:
    """``index.release_thread()`` where the index keeps something per thread."""
    release = getattr(index, "release_thread", None)
    if release is not None:
        release()
