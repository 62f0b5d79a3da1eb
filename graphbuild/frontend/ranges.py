"""Range-setting methods: the range a quantizer covers, from stored calibration statistics.

Each method is a cheap function of the statistics ``frontend.statistics`` collected (no
forward pass), so trying another method or parameter recomputes values only:

- ``minmax`` (the default): the smallest and largest value observed, what PT2E's min/max
  observers give;
- ``moving_average``: torchao's ``MovingAverageMinMaxObserver`` on the ranges of the
  calibration batches in order, ``m <- m + c * (current - m)`` with ``c = averaging`` (a
  batch's range spans every site of the group, so a concat's empty KV cache does not
  start the average at zero);
- ``percentile``: the ``percentile``-th and ``(100 - percentile)``-th percentiles of the
  observed values, read from the histogram (AIMET's percentile analyzer);
- ``mse``: the range with the least expected quantization error over the histogram, clipped
  values weighted by ``gamma`` (AIMET's TF-enhanced / SQNR analyzer: a grid of candidate step
  sizes, and for asymmetric grids of offsets plus the observed one; each value taken at its
  bin's midpoint).

``percentile`` and ``mse`` need histograms, which calibration collects only when asked
(``quant.range_methods.needs_histograms``). Weights (per-channel, static) always take min/max.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from graphbuild.frontend.statistics import Statistics

__all__ = ["activation_range"]

#: AIMET TF-enhanced's search: buckets, candidate steps (asymmetric, symmetric), offsets,
#: the weight of saturation against rounding error, and the narrowest range considered
_BINS, _ASYMMETRIC_STEPS, _SYMMETRIC_STEPS, _OFFSETS, _GAMMA = 512, 17, 101, 21, 3.0
_MIN_RANGE = 0.01


def activation_range(
    stats: Statistics,
    group: int,
    config: Mapping[str, Any],
    num_steps: int,
    symmetric: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of a per-tensor group under the range method ``config``, for a grid of
    ``num_steps`` steps (``2^bits - 1``), symmetric or not."""
    low, high = stats.range(group)
    method = config["method"]
    calls = stats.calls(group)
    if method == "moving_average" and calls is not None:
        return _moving_average(*calls, config)
    histogram = stats.histogram(group)
    if method in ("percentile", "mse") and histogram is not None:
        counts, span = histogram
        if method == "percentile":
            return _percentile(counts, span, config["percentile"], low.dtype)
        return _least_error(counts, span, num_steps, symmetric, low.dtype)
    return low, high


def _moving_average(
    lows: torch.Tensor, highs: torch.Tensor, config: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    c = config["averaging"]
    low, high = lows[0], highs[0]
    for cur_low, cur_high in zip(lows[1:], highs[1:], strict=True):
        low = low + c * (cur_low - low)
        high = high + c * (cur_high - high)
    return low, high


def _edges(bins: int, span: torch.Tensor) -> np.ndarray:
    return np.linspace(float(span[0]), float(span[1]), bins + 1)


def _percentile(
    counts: torch.Tensor, span: torch.Tensor, percentile: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    edges = _edges(counts.numel(), span)
    if percentile >= 100.0:
        return torch.tensor(edges[0], dtype=dtype), torch.tensor(edges[-1], dtype=dtype)
    cumulative = np.cumsum(counts.numpy())
    total = cumulative[-1]
    top = int(np.searchsorted(cumulative, total * percentile / 100.0))
    bottom = int(np.searchsorted(cumulative, total * (1.0 - percentile / 100.0)))
    return torch.tensor(edges[bottom], dtype=dtype), torch.tensor(edges[top], dtype=dtype)


def _least_error(
    counts: torch.Tensor, span: torch.Tensor, num_steps: int, symmetric: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """AIMET's TF-enhanced search: the candidate grid (step ``delta``, offset ``o``: values
    ``delta * (o + [0, steps])``) of least cost over a histogram of ``_BINS`` buckets, the
    cost being each bucket midpoint's squared rounding error, and for buckets outside the
    grid their squared distance to the midpoint of the end bucket, times ``_GAMMA``. In
    numpy: small arrays, where torch's thread pool costs more than the arithmetic."""
    counts_np = counts.numpy().astype(np.float64).reshape(_BINS, -1).sum(1)  # to 512 buckets
    edges = _edges(_BINS, span)
    used = np.flatnonzero(counts_np > 0)
    if used.size == 0:
        return torch.tensor(0.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)
    low = min(float(edges[used[0]]), 0.0)  # left edges of the outermost used buckets
    high = max(float(edges[used[-1]]), 0.0, low + _MIN_RANGE)
    if symmetric:
        widest = 2 * max(abs(high), abs(low)) / num_steps
        deltas = widest * np.arange(1, _SYMMETRIC_STEPS + 1, dtype=np.float64) / 100
        offsets = np.full_like(deltas, float(math.floor(-num_steps / 2)))
    else:
        deltas, offsets = _asymmetric_candidates(low, high, num_steps)
    cost = _cost(counts_np, edges, deltas, offsets, num_steps)
    best = int(np.argmin(cost))
    lowest = deltas[best] * offsets[best]
    return (
        torch.tensor(lowest, dtype=dtype),
        torch.tensor(lowest + num_steps * deltas[best], dtype=dtype),
    )


def _asymmetric_candidates(
    low: float, high: float, num_steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """17 steps from 1/16 to 17/16 of the observed one, each with 21 offsets from
    ``-steps`` to 0, clamped into the observed range (one that spans it is dropped), and the
    observed grid itself."""
    observed = (high - low) / num_steps
    offset = round(low / observed)
    low = observed * offset
    high = low + observed * num_steps
    fractions = np.arange(1, _ASYMMETRIC_STEPS + 1, dtype=np.float64)[:, None] / 16
    deltas = fractions * observed + np.zeros((1, _OFFSETS))
    offsets = np.trunc(-num_steps + num_steps / 20.0 * np.arange(_OFFSETS))[None, :] + 0 * deltas
    grid_low = deltas * offsets
    grid_high = grid_low + deltas * num_steps
    keep = ~((grid_low < low) & (grid_high > high))
    grid_low, grid_high = np.maximum(low, grid_low), np.minimum(high, grid_high)
    deltas = (grid_high - grid_low) / num_steps
    keep &= deltas > 0
    deltas = deltas[keep]
    offsets = np.round(grid_low[keep] / deltas)
    return np.append(deltas, observed), np.append(offsets, float(offset))


def _cost(
    counts: np.ndarray,
    edges: np.ndarray,
    deltas: np.ndarray,
    offsets: np.ndarray,
    num_steps: int,
) -> np.ndarray:
    """Per candidate: the rounding cost of the buckets inside its grid plus gamma times the
    saturation cost of those outside (buckets by index, as AIMET counts them). A midpoint's
    rounding error does not depend on the offset (an integer); saturation sums come from
    prefix sums; empty buckets are skipped."""
    bins = counts.size
    start, step = float(edges[0]), float(edges[1] - edges[0])
    used = np.flatnonzero(counts > 0)
    weights = counts[used]
    mids = start + used * step + step / 2
    low_bin = np.clip(np.floor((deltas * offsets - start) / step), 0, bins - 1).astype(np.int64)
    high_bin = np.floor((deltas * (offsets + num_steps) - start) / step)
    high_bin = np.clip(high_bin, 0, bins - 1).astype(np.int64)
    # saturation: sum of c * (m - a)^2 = a^2 C - 2 a M + S over the buckets below / above
    c = np.concatenate([[0.0], np.cumsum(weights)])
    cm = np.concatenate([[0.0], np.cumsum(weights * mids)])
    cmm = np.concatenate([[0.0], np.cumsum(weights * mids * mids)])
    ranks = np.concatenate([[0], np.cumsum(counts > 0)])
    below, above = ranks[low_bin], ranks[high_bin]  # used buckets below low_bin, high_bin
    low_mid = start + low_bin * step + step / 2
    high_mid = start + high_bin * step + step / 2
    sat_low = low_mid**2 * c[below] - 2 * low_mid * cm[below] + cmm[below]
    top_c, top_cm, top_cmm = c[-1] - c[above], cm[-1] - cm[above], cmm[-1] - cmm[above]
    sat_high = high_mid**2 * top_c - 2 * high_mid * top_cm + top_cmm
    # rounding inside: delta^2 (round(m / delta) - m / delta)^2
    t = mids[None, :] / deltas[:, None]
    t -= np.round(t)
    t *= t
    t *= weights[None, :]
    t[(used[None, :] < low_bin[:, None]) | (used[None, :] >= high_bin[:, None])] = 0.0
    return t.sum(1) * deltas**2 + _GAMMA * (sat_low + sat_high)
