"""What every encodings module shares: the versions and the integer grid of a container."""

from __future__ import annotations

from graphbuild.errors import ExportError
from graphbuild.targets.qnn.options import DEFAULT_ENCODINGS_VERSION, ENCODINGS_VERSIONS

VERSIONS = ENCODINGS_VERSIONS
DEFAULT_VERSION = DEFAULT_ENCODINGS_VERSION
SECTIONS = (("activation_encodings", False), ("param_encodings", True))


def full_grid(bits: int, signed: bool) -> tuple[int, int]:
    """The integer range of a ``bits``-wide container."""
    if signed:
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def check_version(version: str) -> None:
    """Raise :class:`ExportError` for a version graphbuild does not write or read."""
    if version not in VERSIONS:
        raise ExportError(
            f"unknown QNN encodings version '{version}'; known: {', '.join(VERSIONS)}"
        )
