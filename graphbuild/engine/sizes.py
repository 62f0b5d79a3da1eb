"""Memory sizes as a configuration writes them (``"8GiB"``): a module with no imports, so the
configuration reads them without loading the engine."""

from __future__ import annotations

__all__ = ["parse_memory"]

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_memory(value: int | str | None) -> int | None:
    """A memory budget in bytes from ``value``: bytes, ``"512MiB"``, ``"8GB"``, ``"2g"`` (binary
    units), or ``"auto"`` / None (None: the caller's default). ValueError for anything else."""
    if value is None or value == "auto":
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    text = str(value).strip().lower().removesuffix("ib").removesuffix("b") + ""
    number, unit = text.rstrip("kmgt"), text[len(text.rstrip("kmgt")) :]
    try:
        size = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ValueError(
            f"not a memory size: {value!r} (bytes, or e.g. '512MiB', '8GiB')"
        ) from None
    if size <= 0 or isinstance(value, bool):
        raise ValueError(f"not a memory size: {value!r} (bytes, or e.g. '512MiB', '8GiB')")
    return int(size)
