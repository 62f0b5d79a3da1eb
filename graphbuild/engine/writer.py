"""The background cache writer: a run's outputs stored on one thread, in the order they ran."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphbuild.engine.artifact_store import Cache


class CacheWriter:
    """Stores stage outputs in the cache on one background thread, in the order they ran, so
    writing a large artifact overlaps the stages after it (and the placing of the files).

    Each store is what ``Cache.store`` makes it (blobs, then the manifest, each atomic); a
    value is stored as encoded when its stage returned (its parts are views of the value,
    which no later stage may change: invariant 9). :meth:`finish` waits for every store and
    raises the first error one raised (a cache that cannot be written is a warning, as
    before, not an error)."""

    def __init__(self, cache: Cache):
        self.cache = cache
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done = threading.Condition()
        self._submitted = self._stored = 0

    def submit(
        self,
        key: str,
        encoded: Any,
        record: dict[str, Any],
        after: Callable[[], None] | None = None,
        *,
        keep_bytes: bool = True,
    ) -> None:
        """Store ``encoded`` under ``key`` (without its bytes when not ``keep_bytes``: the
        manifest and digest only); then call ``after`` (whatever happened: it releases the
        lease on the key, which waiters in other processes watch)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._work, name="graphbuild-cache-writer", daemon=True
            )
            self._thread.start()
        with self._done:
            self._submitted += 1
        self._queue.put((key, encoded, record, after, keep_bytes))

    def wait(self) -> None:
        """Wait until every store submitted so far was attempted (an error it raised is still
        :meth:`finish`'s to raise)."""
        with self._done:
            target = self._submitted
            self._done.wait_for(lambda: self._stored >= target)

    def _work(self) -> None:
        try:
            self._store_each()
        finally:
            self.cache.release_thread()  # this thread's index connection ends with it

    def _store_each(self) -> None:
        while (item := self._queue.get()) is not None:
            key, encoded, record, after, keep_bytes = item
            try:
                if self._error is None:  # after a failure, nothing more is stored
                    self.cache.store(key, encoded, record, keep_bytes)
            except BaseException as err:  # surfaced by finish(), in the caller's thread
                self._error = err
            finally:
                del item, encoded  # the value's bytes go as soon as they are stored
                if after is not None:
                    after()
                with self._done:
                    self._stored += 1
                    self._done.notify_all()

    def finish(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
