"""Digests: xxh3-128 over bytes, and over canonical JSON for structured values."""

from __future__ import annotations

import json
from typing import Any

import xxhash


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    """xxh3-128 hex digest of a buffer, read in place."""
    return xxhash.xxh3_128_hexdigest(data)


def canonical_json(value: Any) -> str:
    """The one JSON spelling of ``value``: sorted keys, no spaces, no NaN surprises."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_reject)


def digest_json(value: Any) -> str:
    return digest_bytes(canonical_json(value).encode())


def _reject(obj: Any) -> Any:
    raise TypeError(f"{type(obj).__qualname__} is not JSON-serializable")


class Hasher:
    """Incremental xxh3-128, for streaming copies that verify as they go."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def copy(self) -> Hasher:
        """An independent hasher in this one's state (to go back to if what follows is
        dropped)."""
        out = Hasher.__new__(Hasher)
        out._h = self._h.copy()
        return out
