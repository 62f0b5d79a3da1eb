"""What the cache accepts as a name: digests and plain file names.

Everything read from a cache (a manifest, an index row, a placement stamp, a remote entry) is
untrusted data (docs/design.md, invariant 11). Nothing read there may decide a path until it has
passed one of these checks.
"""

from __future__ import annotations

import re
from typing import Any

_DIGEST = re.compile(r"[0-9a-f]{32}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def is_digest(value: Any) -> bool:
    """True for exactly 32 lowercase hex digits (an xxh3-128 digest), nothing else."""
    return type(value) is str and _DIGEST.fullmatch(value) is not None


def is_plain_name(value: Any) -> bool:
    """True for a file name without any directory part: not empty, not ``.`` or ``..``, no
    ``/`` or ``\\``, no drive (``C:``), no control characters, at most 255 bytes."""
    if type(value) is not str or value in ("", ".", ".."):
        return False
    if "/" in value or "\\" in value or ":" in value or _CONTROL.search(value):
        return False
    try:
        return len(value.encode("utf-8")) <= 255
    except UnicodeEncodeError:  # lone surrogates
        return False


def is_placed_path(value: Any) -> bool:
    """True for what an export may place: a plain file name, or one folder and a plain file
    name in it (``cpu/genai_config.json``): a runtime's bundle keeps its files in a folder of
    its own."""
    if type(value) is not str:
        return False
    parts = value.split("/")
    return len(parts) <= 2 and all(is_plain_name(p) for p in parts)
