"""What one declared read saw (:class:`Reading`), and the reading of a context value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphbuild.engine.fingerprint.walk import fingerprint
from graphbuild.errors import FingerprintError
from graphbuild.hashing import digest_json


@dataclass(frozen=True)
class Reading:
    """What one declared read saw: a digest, a short value for people, and details
    (per tensor, per submodule) that let ``explain`` say what changed. ``digest`` is None
    when the read could not be fingerprinted; ``reason`` then says why."""

    digest: str | None
    value: Any = None
    details: dict[str, str] = field(default_factory=dict)
    reason: str | None = None


def read_value(value: Any) -> Reading:
    """Reading of a context value: its canonical form, shown whole when it is short."""
    try:
        fp = fingerprint(value)
    except FingerprintError as err:
        return Reading(None, reason=str(err))
    shown = value if _is_plain(value) else _short(fp)
    return Reading(digest_json(fp), shown)


def _is_plain(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool, type(None))):
        return True
    if isinstance(value, (list, tuple)):
        return len(value) <= 16 and all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return len(value) <= 16 and all(
            isinstance(k, str) and _is_plain(v) for k, v in value.items()
        )
    return False


def _short(fp: Any) -> str:
    return f"<{digest_json(fp)[:12]}>"
