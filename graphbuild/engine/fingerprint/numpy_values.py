"""Fingerprints of numpy arrays and scalars."""

from __future__ import annotations

from typing import Any

from graphbuild.engine.fingerprint.walk import _Walk, fingerprint_type
from graphbuild.hashing import digest_bytes

try:
    import numpy as np

    @fingerprint_type.register(np.ndarray)
    def _(value: np.ndarray, walk: _Walk) -> Any:
        arr = np.ascontiguousarray(value)
        return {
            "ndarray": digest_bytes(arr.reshape(-1).view(np.uint8)),
            "dtype": str(arr.dtype),
            "shape": list(arr.shape),
        }

    @fingerprint_type.register(np.generic)
    def _(value: Any, walk: _Walk) -> Any:
        return {"numpy": str(value.dtype), "value": value.item().__repr__()}

except ImportError:  # pragma: no cover - numpy ships with torch
    pass
