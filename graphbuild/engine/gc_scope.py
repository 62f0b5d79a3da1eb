"""The garbage collector during a run: what existed before it is left alone."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collecting_what_the_run_allocates"]


@contextlib.contextmanager
def collecting_what_the_run_allocates() -> Iterator[None]:
    """While the run lasts, the garbage collector leaves alone the objects that existed before
    it (``gc.freeze``) and collects what the run allocates as usual. A process that imported
    torch and transformers and built a model holds millions of objects; each full collection
    the run's allocations set off would walk them all, for nothing (a warm run's keys are
    small objects that die young): in a fresh CLI process that was most of a warm export's own
    time. Afterwards everything is collectable again. A process that freezes objects itself
    is left to do so."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
