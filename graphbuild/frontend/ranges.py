"""Range-setting methods: the range a quantizer covers, from stored calibration statistics.

Each method is a cheap function of the statistics ``frontend.statistics`` collected (no
forward pass), so trying another method or parameter recomputes values only:

- ``minmax`` (the default): the smallest and largest value observed, what PT2E's min/max
  observers give;
- ``moving_average``: torchao's ``MovingAverageMinMaxObserver`` on the ranges of the observed
  calls in order, ``m <- m + c * (current - m)`` with ``c = averaging``;
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

import torch

__all__ = ["activation_range"]

#: AIMET TF-enhanced's search: buckets, candidate steps (asymmetric, symmetric), offsets,
#: the weight of saturation against rounding error, and the narrowest range considered
_BINS, _ASYMMETRIC_STEPS, _SYMMETRIC_STEPS, _OFFSETS, _GAMMA = 512, 17, 101, 21, 3.0
_MIN_RANGE = 0.01


def activation_range(
    stats: Mapping[str, torch.Tensor],
    group: int,
    config: Mapping[str, Any],
    num_steps: int,
    symmetric: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of a per-tensor group under the range method ``config``, for a grid of
    ``num_steps`` steps (``2^bits - 1``), symmetric or not."""
    low, high = stats[f"{group}.min"], stats[f"{group}.max"]
    method = config["method"]
    if method == "moving_average" and f"{group}.calls_min" in stats:
        return _moving_average(stats[f"{group}.calls_min"], stats[f"{group}.calls_max"], config)
    if method in ("percentile", "mse") and f"{group}.hist" in stats:
        counts, span = stats[f"{group}.hist"], stats[f"{group}.hist_range"]
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


def _edges(counts: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    return torch.linspace(float(span[0]), float(span[1]), counts.numel() + 1, dtype=torch.float64)


def _percentile(
    counts: torch.Tensor, span: torch.Tensor, percentile: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    edges = _edges(counts, span)
    if percentile >= 100.0:
        return edges[0].to(dtype), edges[-1].to(dtype)
    cumulative = counts.cumsum(0)
    total = cumulative[-1]
    top = torch.searchsorted(cumulative, total * percentile / 100.0)
    bottom = torch.searchsorted(cumulative, total * (1.0 - percentile / 100.0))
    return edges[bottom].to(dtype), edges[top].to(dtype)


def _least_error(
    counts: torch.Tensor, span: torch.Tensor, num_steps: int, symmetric: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """AIMET's TF-enhanced search: the candidate grid (step ``delta``, offset ``o``: values
    ``delta * (o + [0, steps])``) of least cost over a histogram of ``_BINS`` buckets, the
    cost being each bucket midpoint's squared rounding error, and for buckets outside the
    grid their squared distance to the midpoint of the end bucket, times ``_GAMMA``."""
    counts = counts.to(torch.float64).reshape(_BINS, -1).sum(1)  # 2048 -> 512 buckets
    edges = _edges(counts, span)
    used = torch.nonzero(counts > 0).flatten()
    if used.numel() == 0:
        return torch.tensor(0.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)
    low = min(float(edges[int(used[0])]), 0.0)  # left edges of the outermost used buckets
    high = max(float(edges[int(used[-1])]), 0.0, low + _MIN_RANGE)
    if symmetric:
        widest = 2 * max(abs(high), abs(low)) / num_steps
        deltas = widest * torch.arange(1, _SYMMETRIC_STEPS + 1, dtype=torch.float64) / 100
        offsets = torch.full_like(deltas, float(math.floor(-num_steps / 2)))
    else:
        deltas, offsets = _asymmetric_candidates(low, high, num_steps)
    cost = _cost(counts, edges, deltas, offsets, num_steps)
    best = int(torch.argmin(cost))
    lowest = deltas[best] * offsets[best]
    return lowest.to(dtype), (lowest + num_steps * deltas[best]).to(dtype)


def _asymmetric_candidates(
    low: float, high: float, num_steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """17 steps from 1/16 to 17/16 of the observed one, each with 21 offsets from
    ``-steps`` to 0, clamped into the observed range (one that spans it is dropped), and the
    observed grid itself."""
    observed = (high - low) / num_steps
    offset = round(low / observed)
    low = observed * offset
    high = low + observed * num_steps
    deltas, offsets = [], []
    for f in range(1, _ASYMMETRIC_STEPS + 1):
        for i in range(_OFFSETS):
            delta, o = f / 16 * observed, int(-num_steps + num_steps / 20.0 * i)
            grid_low, grid_high = delta * o, delta * o + delta * num_steps
            if grid_low < low and grid_high > high:
                continue
            grid_low, grid_high = max(low, grid_low), min(high, grid_high)
            delta = (grid_high - grid_low) / num_steps
            if delta <= 0:
                continue
            deltas.append(delta)
            offsets.append(float(round(grid_low / delta)))
    deltas.append(observed)
    offsets.append(float(offset))
    return torch.tensor(deltas, dtype=torch.float64), torch.tensor(offsets, dtype=torch.float64)


def _cost(
    counts: torch.Tensor,
    edges: torch.Tensor,
    deltas: torch.Tensor,
    offsets: torch.Tensor,
    num_steps: int,
) -> torch.Tensor:
    """Per candidate: the rounding cost of the buckets inside its grid plus gamma times the
    saturation cost of those outside (buckets by index, as AIMET counts them). A midpoint's
    rounding error does not depend on the offset (an integer); saturation sums come from
    prefix sums; empty buckets are skipped."""
    bins = counts.numel()
    start, step = float(edges[0]), float(edges[1] - edges[0])
    used = torch.nonzero(counts > 0).flatten()
    weights = counts[used]
    mids = start + used.to(torch.float64) * step + step / 2
    low_bin = ((deltas * offsets - start) / step).floor().clamp(0, bins - 1)
    high_bin = ((deltas * (offsets + num_steps) - start) / step).floor().clamp(0, bins - 1)
    # saturation: sum of c * (m - a)^2 = a^2 C - 2 a M + S over the buckets below / above
    c = torch.cat([weights.new_zeros(1), weights.cumsum(0)])
    cm = torch.cat([weights.new_zeros(1), (weights * mids).cumsum(0)])
    cmm = torch.cat([weights.new_zeros(1), (weights * mids * mids).cumsum(0)])
    ranks = torch.cat([used.new_zeros(1), (counts > 0).to(torch.int64).cumsum(0)])
    below = ranks[low_bin.to(torch.int64)]  # how many used buckets lie below low_bin
    above = ranks[high_bin.to(torch.int64)]
    low_mid = start + low_bin * step + step / 2
    high_mid = start + high_bin * step + step / 2
    sat_low = low_mid.square() * c[below] - 2 * low_mid * cm[below] + cmm[below]
    top_c, top_cm, top_cmm = c[-1] - c[above], cm[-1] - cm[above], cmm[-1] - cmm[above]
    sat_high = high_mid.square() * top_c - 2 * high_mid * top_cm + top_cmm
    # rounding inside: delta^2 (round(m / delta) - m / delta)^2, float32 as AIMET may
    t = mids.to(torch.float32)[None, :] / deltas.to(torch.float32)[:, None]
    t.sub_(t.round()).square_().mul_(weights.to(torch.float32)[None, :])
    index = used[None, :]
    t.masked_fill_((index < low_bin[:, None]) | (index >= high_bin[:, None]), 0.0)
    rounding = t.sum(1).to(torch.float64) * deltas.square()
    return rounding + _GAMMA * (sat_low + sat_high)
