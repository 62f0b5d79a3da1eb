"""Range-setting methods by name, and the options each takes (imports no torch: a config
file is checked without it). The methods themselves are in ``frontend.ranges``.

A range setting is canonical: the method and only the parameter it uses, so that changing
an option the method ignores changes no key.
"""

from __future__ import annotations

from typing import Any

from graphbuild.errors import ConfigError

__all__ = ["DEFAULT_RANGE_METHOD", "RANGE_METHODS", "needs_histograms", "range_config"]

#: minmax: the observed extremes (PT2E's observers); moving_average: their moving average
#: over the calibration calls; percentile: a percentile of the observed values; mse: the
#: range of least expected quantization error (AIMET's TF-enhanced)
RANGE_METHODS = ("minmax", "moving_average", "percentile", "mse")
DEFAULT_RANGE_METHOD = "minmax"


def range_config(method: str, percentile: float = 99.99, averaging: float = 0.01) -> dict[str, Any]:
    """The canonical range setting; a ConfigError names a bad method or value."""
    if method not in RANGE_METHODS:
        raise ConfigError(f"unknown range_method {method!r}; known: {', '.join(RANGE_METHODS)}")
    if method == "percentile":
        if not _number(percentile) or not 50.0 <= float(percentile) <= 100.0:
            raise ConfigError(
                f"range_percentile must be a number from 50 to 100, not {percentile!r}"
            )
        return {"method": method, "percentile": float(percentile)}
    if method == "moving_average":
        if not _number(averaging) or not 0.0 < float(averaging) <= 1.0:
            raise ConfigError(
                f"range_averaging must be a number above 0 and at most 1, not {averaging!r}"
            )
        return {"method": method, "averaging": float(averaging)}
    return {"method": method}


def needs_histograms(config: dict[str, Any]) -> bool:
    """Whether calibration must collect histograms for this range setting."""
    return config["method"] in ("percentile", "mse")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
