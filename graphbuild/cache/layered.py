"""A local cache in front of a shared one: local first, then the shared cache.

Hits are copied down as they are used: a blob read from the shared cache is written to the
local store, and a manifest once every blob it names is local, so the local cache stays
complete on its own (an export without the server finds no entry whose blobs are elsewhere).
A run's results go to both: blobs first, then the manifest, so the shared cache never names a
blob it does not hold. Only manifests (``m:``) are shared; explain records, placement stamps
and hit counters stay with the machine they describe. Leases are taken on the shared cache,
where every machine that could build the same key looks.

The shared cache is an optimisation, never a dependency: when it cannot be reached, refuses
the credentials or stops answering, the run goes on with the local cache after one warning
and asks it nothing more; a read-only one (a consumer, a CI job that must not publish, a
user whose ACL allows reads only) is read and never written.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from graphbuild.cache.base import (
    ActionIndex,
    BlobStore,
    CorruptBlob,
    StoreReadOnly,
    Stores,
    release_thread,
)
from graphbuild.cache.manifest import InvalidManifest, blob_refs, check_manifest
from graphbuild.errors import CacheError

SHARED = ("m:",)


@dataclass
class _Remote:
    """The shared half of a layered cache, and whether it is still in use."""

    location: str
    readonly: bool
    up: bool = True

    def failed(self, err: BaseException) -> None:
        """A question to the shared cache failed: a write this user may not make makes it a
        reader for the rest of the run (hits keep coming); anything else stops the run
        asking it (one timeout a run, never one a question)."""
        if isinstance(err, StoreReadOnly):
            if self.up and not self.readonly:
                warnings.warn(
                    f"graphbuild: the shared cache at {self.location} lets this user read, "
                    "not write: reading it, and keeping this run's results in the local "
                    "cache (--cache-readonly says so and skips this note)",
                    RuntimeWarning,
                    stacklevel=4,
                )
            self.readonly = True
            return
        if self.up:
            warnings.warn(
                f"graphbuild: the shared cache at {self.location} cannot be used ({err}); "
                "going on with the local cache",
                RuntimeWarning,
                stacklevel=4,
            )
        self.up = False

    @property
    def writable(self) -> bool:
        return self.up and not self.readonly


def _shared(key: str) -> bool:
    return key.startswith(SHARED)


class LayeredIndex:
    """Index rows from the local index, else (manifests only) from the shared one."""

    def __init__(
        self, local: ActionIndex, remote: ActionIndex, local_blobs: BlobStore, state: _Remote
    ):
        self.local, self.remote, self.local_blobs, self.state = local, remote, local_blobs, state
        self.readonly = local.readonly

    def _complete_locally(self, key: str, value: dict[str, Any]) -> bool:
        """True for a well-formed manifest whose blobs are all in the local store."""
        try:
            manifest = check_manifest(key[len("m:") :], value)
        except InvalidManifest:
            return False
        return all(self.local_blobs.has(d, s) for d, s in blob_refs(manifest["artifact"]))

    def get_json(self, key: str) -> dict[str, Any] | None:
        value = self.local.get_json(key)
        if value is not None or not _shared(key) or not self.state.up:
            return value
        try:
            value = self.remote.get_json(key)
        except OSError as err:
            self.state.failed(err)
            return None
        if value is not None and not self.local.readonly and self._complete_locally(key, value):
            with contextlib.suppress(OSError):
                self.local.set_json(key, value)  # copied down
        return value

    def set_json(self, key: str, value: dict[str, Any]) -> None:
        if not _shared(key) or self._complete_locally(key, value):
            self.local.set_json(key, value)
        if _shared(key) and self.state.writable:
            try:
                self.remote.set_json(key, value)  # pushed up, after its blobs
            except OSError as err:
                self.state.failed(err)

    def delete(self, key: str) -> bool:
        removed = self.local.delete(key)
        if _shared(key) and self.state.writable:
            try:
                removed = self.remote.delete(key) or removed
            except OSError as err:
                self.state.failed(err)
        return removed

    def keys(self, prefix: str) -> Iterator[str]:
        found = dict.fromkeys(self.local.keys(prefix))
        if _shared(prefix) and self.state.up:
            try:
                found.update(dict.fromkeys(self.remote.keys(prefix)))
            except OSError as err:
                self.state.failed(err)
        return iter(found)

    def incr(self, counter: str, delta: int = 1) -> None:
        self.local.incr(counter, delta)

    def counter(self, counter: str) -> int:
        return self.local.counter(counter)

    def clear(self) -> None:
        self.local.clear()
        if self.state.writable:
            try:
                self.remote.clear()
            except OSError as err:
                self.state.failed(err)

    # Leases live where the processes that share work meet: on the shared cache while it is
    # in use and writable, else on the local one (processes of one machine still agree).

    def _lease_store(self) -> ActionIndex:
        return self.remote if self.state.writable else self.local

    def _lease(self, op: str, *args: Any) -> Any:
        store = self._lease_store()
        try:
            return getattr(store, op)(*args)
        except OSError as err:
            if store is self.local:
                raise
            self.state.failed(err)
            return getattr(self.local, op)(*args)

    def acquire_lease(self, name: str, owner: str, seconds: float) -> bool:
        return bool(self._lease("acquire_lease", name, owner, seconds))

    def renew_lease(self, name: str, owner: str, seconds: float) -> bool:
        return bool(self._lease("renew_lease", name, owner, seconds))

    def release_lease(self, name: str, owner: str) -> bool:
        return bool(self._lease("release_lease", name, owner))

    def lease_holder(self, name: str) -> str | None:
        return self._lease("lease_holder", name)

    def close(self) -> None:
        self.local.close()
        self.remote.close()

    def release_thread(self) -> None:
        release_thread(self.local)
        release_thread(self.remote)


class LayeredBlobs:
    """Blobs from the local store, else from the shared one (and then kept locally)."""

    def __init__(self, local: BlobStore, remote: BlobStore, state: _Remote):
        self.local, self.remote, self.state = local, remote, state

    @property
    def readonly(self) -> bool:
        return self.local.readonly

    @readonly.setter
    def readonly(self, value: bool) -> None:
        self.local.readonly = value

    def _try(self, default: Any, op: str, *args: Any) -> Any:
        if not self.state.up:
            return default
        try:
            return getattr(self.remote, op)(*args)
        except OSError as err:
            self.state.failed(err)
            return default

    def has(self, digest: str, size: int) -> bool:
        return self.local.has(digest, size) or bool(self._try(False, "has", digest, size))

    def write(self, digest: str, data: bytes | bytearray | memoryview) -> bool:
        written = self.local.write(digest, data)
        if self.state.writable:
            written = bool(self._try(False, "write", digest, data)) or written
        return written

    def read(self, digest: str, size: int | None = None) -> bytes:
        try:
            return self.local.read(digest, size)
        except CorruptBlob as local_err:
            if not self.state.up:
                raise
            try:
                data = self.remote.read(digest, size)  # checked against its digest there
            except OSError as err:
                self.state.failed(err)
                raise local_err from err
        if not self.local.readonly:
            with contextlib.suppress(OSError):
                self.local.delete(digest)  # a damaged local copy of the same name
                self.local.write(digest, data)  # copied down
        return data

    def verify(self, digest: str) -> bool:
        """True when a good copy is at hand: the local one, else the shared one (a damaged
        local copy is replaced from the shared cache on the next read)."""
        return self.local.verify(digest) or bool(self._try(False, "verify", digest))

    def delete(self, digest: str) -> int | None:
        freed = self.local.delete(digest)
        if self.state.writable:
            remote = self._try(None, "delete", digest)
            if remote is not None:
                freed = max(freed or 0, remote)
        return freed

    def all(self) -> Iterator[tuple[str, int, float]]:
        found = {d: (d, s, t) for d, s, t in self.local.all()}
        for d, s, t in self._try([], "all"):
            found.setdefault(d, (d, s, t))
        return iter(found.values())

    def sweep(self, older_than: float) -> int:
        swept = self.local.sweep(older_than)
        if self.state.writable:
            swept += self._try(0, "sweep", older_than)
        return swept

    def clear(self) -> tuple[int, int]:
        removed, freed = self.local.clear()
        if self.state.writable:
            r, f = self._try((0, 0), "clear")
            removed, freed = max(removed, r), max(freed, f)
        return removed, freed

    def close(self) -> None:
        self.local.close()
        self.remote.close()


def layered(local: Stores, remote: Stores) -> Stores:
    """The local stores in front of the shared ones."""
    assert local.index is not None and remote.index is not None
    state = _Remote(remote.location, remote.readonly)
    return Stores(
        index=LayeredIndex(local.index, remote.index, local.blobs, state),
        blobs=LayeredBlobs(local.blobs, remote.blobs, state),
        location=f"{local.location} + {remote.location}",
        readonly=local.readonly,
        maintainable=local.maintainable,
        path=local.path,
        quarantined=local.quarantined,
        damage=local.damage,
        unwritable=local.unwritable,
        local=local,
    )


def in_front_of_shared(local: Stores, url: str, readonly: bool) -> Stores:
    """``local`` in front of the shared cache at ``url``; ``local`` alone, with a warning,
    when the server cannot be reached (the shared cache is an optimisation)."""
    from graphbuild.cache.remote import open_remote

    try:
        remote = open_remote(url, readonly=readonly)
    except OSError as err:
        warnings.warn(
            f"graphbuild: {err}; going on with the local cache", RuntimeWarning, stacklevel=4
        )
        return local
    except CacheError:
        local.close()
        raise
    return layered(local, remote)
