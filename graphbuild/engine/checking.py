"""Check mode (``--check-fingerprints``) for code that reuses earlier results.

Where graphbuild takes a value or digest from an earlier computation instead of computing it
(bind's tensors of an earlier call, a tensor digest of an earlier run), it asks
:func:`checking`: in check mode it computes afresh, and :func:`reused_mismatch` fails loudly
when the reused result would have differed. The scheduler turns check mode on for the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from graphbuild.errors import FingerprintMismatchError

__all__ = ["check_mode", "checking", "reused_mismatch"]

_CHECKING: ContextVar[bool] = ContextVar("graphbuild_checking", default=False)


def checking() -> bool:
    """True while a run in check mode runs (in the thread that runs its stages)."""
    return _CHECKING.get()


@contextmanager
def check_mode(enabled: bool = True) -> Iterator[None]:
    token = _CHECKING.set(enabled)
    try:
        yield
    finally:
        _CHECKING.reset(token)


def reused_mismatch(what: str, reused: str, computed: str, rule: str) -> FingerprintMismatchError:
    """The error for a reused result that recomputing contradicts."""
    return FingerprintMismatchError(
        f"{what}: the reused digest {reused[:12]} differs from the recomputed {computed[:12]}; "
        f"{rule}"
    )
