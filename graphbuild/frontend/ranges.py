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

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["activation_range"]

_MINIMUM_STEP = torch.finfo(torch.float32).eps
_ASYMMETRIC_STEPS, _SYMMETRIC_STEPS, _OFFSETS, _GAMMA = 17, 101, 21, 3.0


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
    """The candidate grid (step ``delta``, offset ``o``: values ``delta * (o + [0, steps])``)
    with the least histogram-weighted squared error, clipped values' error times gamma."""
    edges = _edges(counts, span)
    low = min(float(edges[0]), 0.0)
    high = max(float(edges[-1]), 0.0, low + _MINIMUM_STEP * num_steps)
    if symmetric:
        widest = 2 * max(high, -low) / num_steps
        deltas = widest * torch.arange(1, _SYMMETRIC_STEPS + 1, dtype=torch.float64)
        deltas = (deltas / (_SYMMETRIC_STEPS - 1)).clamp_min(_MINIMUM_STEP)[:, None]
        offsets = torch.full_like(deltas, float(-((num_steps + 1) // 2)))
    else:
        widest = (high - low) / num_steps
        observed = round(low / widest)
        deltas = widest * torch.arange(1, _ASYMMETRIC_STEPS + 1, dtype=torch.float64)
        deltas = deltas / (_ASYMMETRIC_STEPS - 1)
        count = min(num_steps + 2, _OFFSETS)
        step = num_steps / (count - 2)
        grid = torch.arange(-num_steps, step, step, dtype=torch.float64).round()
        offsets = torch.cat([grid, torch.tensor([float(observed)], dtype=torch.float64)])
        deltas, offsets = _clamped(deltas, offsets, widest * observed, num_steps, widest)
    error = _expected_error(counts, edges, deltas, offsets, num_steps)
    best = int(torch.argmin(error.flatten()))
    delta, offset = deltas.flatten()[best], offsets.flatten()[best]
    lowest = offset * delta
    return lowest.to(dtype), (lowest + num_steps * delta).to(dtype)


def _clamped(
    deltas: torch.Tensor, offsets: torch.Tensor, low: float, num_steps: int, widest: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (delta, offset) candidate pair, its range clipped to the observed one."""
    high = low + widest * num_steps
    grid_low = deltas[:, None] * offsets[None, :]
    grid_high = grid_low + deltas[:, None] * num_steps
    grid_low = grid_low.clamp_min(low)
    grid_high = grid_high.clamp_max(high)
    new_deltas = ((grid_high - grid_low) / num_steps).clamp_min(_MINIMUM_STEP)
    return new_deltas, (grid_low / new_deltas).round()


def _expected_error(
    counts: torch.Tensor,
    edges: torch.Tensor,
    deltas: torch.Tensor,
    offsets: torch.Tensor,
    num_steps: int,
) -> torch.Tensor:
    """Per candidate: sum over bins of count x (quantized midpoint - midpoint)^2, with the
    error of clipped midpoints weighted by gamma."""
    mids = (edges[:-1] + edges[1:]) / 2
    q = (mids / deltas[..., None] - offsets[..., None]).round()
    clipped = (q < 0) | (q > num_steps)
    back = (q.clamp(0, num_steps) + offsets[..., None]) * deltas[..., None]
    error = (back - mids).pow(2) * counts
    error = torch.where(clipped, error * _GAMMA, error)
    return error.sum(-1)
