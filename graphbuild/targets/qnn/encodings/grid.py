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


def weight_axes(op_type: str, rank: int, trans_b: bool = False) -> tuple[int, int]:
    """(output-channel axis, input-channel axis) of an op's weight input, as QNN reads it:
    the axes a per-channel (1.0.0, 0.6.1: unstated) or blocked encoding runs along."""
    if op_type == "ConvTranspose":
        return 1, 0
    if op_type == "MatMul":
        return rank - 1, rank - 2
    if op_type == "Gemm":
        return (0, 1) if trans_b else (1, 0)
    return 0, 1
