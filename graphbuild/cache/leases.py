"""Leases on stage keys: in-flight deduplication between processes that share a cache.

Two processes (two exports, two sweep workers, two Ray tasks on different machines) that
need the same stage key at the same moment should not both build it. Before running a stage
a process takes the lease named by the stage's key on the cache's index
(:meth:`~graphbuild.cache.base.ActionIndex.acquire_lease`); the others see it held and wait
for the entry to appear. The holder renews the lease from a background thread while it
works and releases it once the entry is written (or the stage failed). A holder that dies
(killed, its machine gone) stops renewing, so the lease expires after :data:`DEFAULT_SECONDS`
and a waiter takes it over: a dead holder never blocks anyone for longer than that.

Leases only save work; correctness never depends on them. Where the index cannot hold one
(a read-only cache, an unreachable server), every process builds what it needs, as before.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graphbuild.cache.base import ActionIndex

__all__ = ["DEFAULT_SECONDS", "Lease", "LeaseHolding", "new_owner", "owner_pid"]

#: How long a lease lasts without renewal: how long a dead holder can make others wait.
DEFAULT_SECONDS = 30.0


def new_owner() -> str:
    """A lease owner name, unique to one lease: ``host:pid:token`` (shown to waiters)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def owner_pid(owner: str) -> tuple[str, int] | None:
    """(host, pid) of an owner name :func:`new_owner` made; None for another shape."""
    parts = owner.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


class Lease:
    """A lease this process holds (or, where the index holds none, a stand-in that lets it
    build without one). Renewed every third of its time until :meth:`release`."""

    def __init__(
        self,
        index: ActionIndex | None,
        name: str,
        owner: str,
        seconds: float,
    ):
        self.index, self.name, self.owner, self.seconds = index, name, owner, seconds
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if index is not None:
            self._thread = threading.Thread(
                target=self._renew, name=f"graphbuild-lease-{name[:8]}", daemon=True
            )
            self._thread.start()

    @classmethod
    def unheld(cls, name: str) -> Lease:
        """Leave to build without a lease (the index cannot hold one)."""
        return cls(None, name, "", 0.0)

    @property
    def held(self) -> bool:
        return self.index is not None and not self.lost

    def _renew(self) -> None:
        assert self.index is not None
        while not self._stop.wait(self.seconds / 3):
            try:
                kept = self.index.renew_lease(self.name, self.owner, self.seconds)
            except OSError:
                kept = False
            if not kept:  # expired (a stall longer than its time) or the store is gone
                self.lost = True
                return

    def release(self) -> None:
        """Stop renewing and give the lease back (idempotent; never raises)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self.index is not None and not self.lost:
            with contextlib.suppress(OSError):  # else it expires by itself
                self.index.release_lease(self.name, self.owner)
            self.lost = True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LeaseHolding:
    """Leases on keys for a cache over an index (a :class:`~.byte_store.ByteCache`; the engine's
    ``Cache`` is one): ``lease_seconds`` is how long a lease lasts without renewal."""

    lease_seconds: float = DEFAULT_SECONDS
    _index: ActionIndex | None
    _writable: bool

    def try_lease(self, key: str) -> Lease | None:
        """The lease on building ``key``: a :class:`Lease` when this process may build it
        (taken, or not held at all where the index cannot hold leases: a read-only or
        unreachable cache), None while another process holds it."""
        if not self._writable or self._index is None:
            return Lease.unheld(key)
        owner = new_owner()
        try:
            taken = self._index.acquire_lease(key, owner, self.lease_seconds)
        except OSError:
            return Lease.unheld(key)
        return Lease(self._index, key, owner, self.lease_seconds) if taken else None

    def lease_holder(self, key: str) -> str | None:
        """Who holds the lease on building ``key`` (``host:pid:token``); None when free."""
        if self._index is None:
            return None
        try:
            return self._index.lease_holder(key)
        except OSError:
            return None
