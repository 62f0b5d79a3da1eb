"""Tensor digests reused from earlier in the process, where that is sound.

Hashing a model's weights runs at memory speed, but an LLM's weights are gigabytes, and one
export reads them twice (the ``input.state`` facet, then ``weight_digests``) and the next
export of an unchanged model reads them again. A digest is reused for a tensor only while
its *token* is what it was when it was hashed: the same tensor object (weakly referenced)
over the same storage object (weakly referenced, so its address cannot have been reused),
at the same data pointer, storage offset, version counter, shape, stride, dtype and device.

The rule, from what torch's version counter does and does not see:

* Every in-place torch op on the tensor or on a view or ``detach()`` of it bumps the counter
  it shares with them (``with torch.no_grad(): w.add_(1)``, ``load_state_dict``, optimizers).
* Writes through an alias with a counter of its own do not: ``w.data.add_(1)`` (``.data`` is
  a new tensor with a new counter), a numpy view (``w.detach().numpy()[0] = 1``), another
  buffer over the same memory, a device kernel writing the memory. ``w.data = t`` swaps the
  storage and keeps the counter (the storage check sees it).

So within one run, which reads its input once and relies on the model staying as it is
while it runs, a token is enough: ``weight_digests`` reuses the digests ``input.state``
computed moments before. Outside a run (:func:`begin_run` to :func:`end_run`) and across
runs it is not: a caller of ``state_digests`` may have written through ``.data`` since.
Reuse across runs happens only when the caller promises that weights change through torch
ops only (:func:`reuse_across_runs`).
Check mode (``--check-fingerprints``) hashes every tensor and fails loudly where a reused
digest is wrong.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "begin_run",
    "clear",
    "end_run",
    "lookup",
    "remember",
    "reusable",
    "reuse_across_runs",
    "reusing_across_runs",
]

# re-entrant: a remembered tensor freed while the lock is held (the garbage collector runs
# on any allocation) calls _forget from the same thread
_lock = threading.RLock()
_entries: dict[int, tuple[Any, Any, tuple, str, int]] = {}  # id -> (ref, storage ref, token,
# digest, run)
_run = 0
_in_run = False
_across_runs = False


def reuse_across_runs(enabled: bool = True) -> None:
    """Reuse a tensor's digest from an earlier run of this process when its token is
    unchanged. Only sound when the model's tensors change through torch ops alone (no
    ``.data`` writes, no numpy or other buffer views written to); ``--check-fingerprints``
    verifies it."""
    global _across_runs
    _across_runs = bool(enabled)


def reusing_across_runs() -> bool:
    return _across_runs


def begin_run() -> None:
    """A new run starts: digests of earlier runs are reused only across runs."""
    global _run, _in_run
    with _lock:
        _run += 1
        _in_run = True


def end_run() -> None:
    """The run is over: what it hashed is reused again only across runs (a ``.data`` write
    after it must not leave a public digest stale)."""
    global _in_run
    with _lock:
        _in_run = False


def _token(t: torch.Tensor) -> tuple:
    return (
        t._version,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
        str(t.device),
    )


def lookup(t: torch.Tensor) -> str | None:
    """The digest remembered for ``t`` if its token is unchanged and reuse is allowed."""
    with _lock:
        entry = _entries.get(id(t))
        run, in_run = _run, _in_run
    if entry is None:
        return None
    ref, storage_ref, token, digest, when = entry
    if (when != run or not in_run) and not _across_runs:
        return None
    if ref() is not t or storage_ref() is not t.untyped_storage() or _token(t) != token:
        return None
    return digest


def reusable() -> list[tuple[torch.Tensor, str]]:
    """Every (tensor, digest) that :func:`lookup` would answer now: what check mode
    verifies before a run starts."""
    with _lock:
        refs = [(entry[0], entry[3]) for entry in _entries.values()]
    out = []
    for ref, digest in refs:
        t = ref()
        if t is not None and lookup(t) == digest:
            out.append((t, digest))
    return out


def remember(t: torch.Tensor, digest: str) -> None:
    """Remember ``t``'s digest under its current token (until the tensor is gone)."""
    key = id(t)
    try:
        storage = t.untyped_storage()
        ref = weakref.ref(t, lambda dead, key=key: _forget(key, dead))
        storage_ref = weakref.ref(storage)
    except TypeError:  # not weakly referenceable: nothing is remembered
        return
    with _lock:
        _entries[key] = (ref, storage_ref, _token(t), digest, _run)


def _forget(key: int, dead: Any) -> None:
    with _lock:
        entry = _entries.get(key)
        if entry is not None and entry[0] is dead:
            del _entries[key]


def clear() -> None:
    with _lock:
        _entries.clear()
