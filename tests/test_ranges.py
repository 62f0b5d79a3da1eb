"""Range-setting methods on stored calibration statistics, checked against their definitions:
torchao's moving-average observer, percentiles of the data, and AIMET's TF-enhanced cost
written out bucket by bucket."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchao.quantization.pt2e.observer import MovingAverageMinMaxObserver

from graphbuild.frontend import ranges
from graphbuild.frontend.statistics import (
    HISTOGRAM_BINS,
    GroupStatistics,
    Histogram,
    Statistics,
    bucket_counts,
    pack,
    rebin,
)


def observe(batches: list[torch.Tensor], histogram: bool = True) -> Statistics:
    """One site's statistics over ``batches``, each a calibration batch."""
    obs = GroupStatistics(axis=None, histogram=histogram)
    for x in batches:
        obs(x)
        obs.end_batch()
    return Statistics(pack({0: obs}))


def heavy_tailed(seed: int, n: int = 4, size: int = 4096) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(size, generator=g)
        x[:4] *= 40.0  # a few outliers stretch the min/max range
        out.append(x)
    return out


def test_minmax_is_the_observed_extremes():
    batches = heavy_tailed(0)
    stats = observe(batches)
    low, high = ranges.activation_range(stats, 0, {"method": "minmax"}, 255, False)
    everything = torch.cat(batches)
    assert float(low) == float(everything.min()) and float(high) == float(everything.max())


def test_moving_average_is_torchaos_moving_average_observer():
    batches = heavy_tailed(1, n=6)
    stats = observe(batches, histogram=False)
    config = {"method": "moving_average", "averaging": 0.1}
    low, high = ranges.activation_range(stats, 0, config, 255, False)
    reference = MovingAverageMinMaxObserver(averaging_constant=0.1)
    for x in batches:
        reference(x)
    assert torch.allclose(low, reference.min_val) and torch.allclose(high, reference.max_val)


def test_moving_average_of_a_shared_group_averages_batches_not_its_sites():
    """A group of several sites (a concat's inputs and output share one quantizer) is seen
    several times per batch: the average runs over each batch's range of all of them, so
    one site that starts at zeros (an LLM's empty KV cache beside the new keys) cannot pull
    the range to the 1/50 of the data the per-site average gave (keys quantized with a
    0.0003 step that saturated them on the first calibration of an ``llm`` export)."""
    g = torch.Generator().manual_seed(2)
    obs = GroupStatistics(axis=None, histogram=False)
    whole = []
    for i in range(2):  # cache, new keys, their concat: one batch each
        cache = torch.zeros(64) if i == 0 else torch.randn(64, generator=g)
        keys = torch.randn(64, generator=g)
        for x in (cache, keys, torch.cat([cache, keys])):
            obs(x)
        obs.end_batch()
        whole.append(torch.cat([cache, keys]))
    config = {"method": "moving_average", "averaging": 0.01}
    low, high = ranges.activation_range(Statistics(pack({0: obs})), 0, config, 255, False)
    reference = MovingAverageMinMaxObserver(averaging_constant=0.01)
    for x in whole:
        reference(x)
    assert torch.allclose(low, reference.min_val) and torch.allclose(high, reference.max_val)
    assert float(high - low) > 0.9 * float(whole[0].max() - whole[0].min())


def test_percentile_lands_within_a_bucket_of_the_datas_percentile():
    batches = heavy_tailed(2)
    stats = observe(batches)
    config = {"method": "percentile", "percentile": 99.0}
    low, high = ranges.activation_range(stats, 0, config, 255, False)
    data = torch.cat(batches).numpy()
    span = stats.histogram(0)[1]
    bucket = float(span[1] - span[0]) / HISTOGRAM_BINS
    assert abs(float(high) - np.percentile(data, 99.0)) <= 2 * bucket
    assert abs(float(low) - np.percentile(data, 1.0)) <= 2 * bucket
    assert float(high) < float(data.max())  # the outliers are clipped


def _aimet_cost(counts, edges, delta, offset, steps, gamma=3.0):
    """AIMET's TF-enhanced cost as its definition reads, bucket by bucket."""
    start, step = edges[0], edges[1] - edges[0]
    bins = len(counts)
    low, high = delta * offset, delta * offset + delta * steps
    low_bin = min(max(0, math.floor((low - start) / step)), bins - 1)
    high_bin = min(max(0, math.floor((high - start) / step)), bins - 1)
    low_mid, high_mid = start + low_bin * step + step / 2, start + high_bin * step + step / 2
    cost = 0.0
    for i in range(bins):
        mid = start + i * step + step / 2
        if i < low_bin:
            cost += gamma * counts[i] * (mid - low_mid) ** 2
        elif i >= high_bin:
            cost += gamma * counts[i] * (mid - high_mid) ** 2
        else:
            q = round(mid / delta - offset)
            cost += counts[i] * (delta * (q + offset) - mid) ** 2
    return cost


@pytest.mark.parametrize("symmetric", [False, True])
def test_the_mse_search_computes_aimets_cost_and_picks_the_cheapest(symmetric):
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 50, 512).astype(np.float64)
    counts[:20] = 0
    edges = np.linspace(-2.0, 6.0, 513)
    steps = 255
    if symmetric:
        deltas = 2 * 6.0 / steps * np.arange(1, 102) / 100
        offsets = np.full_like(deltas, -128.0)
    else:
        deltas, offsets = ranges._asymmetric_candidates(-1.6, 6.0, steps)
    cost = ranges._cost(counts, edges, deltas, offsets, steps)
    for i in range(0, len(deltas), max(1, len(deltas) // 12)):
        expected = _aimet_cost(counts, edges, deltas[i], offsets[i], steps)
        assert cost[i] == pytest.approx(expected, rel=1e-6)


def test_mse_clips_outliers_and_quantizes_the_data_better_than_minmax():
    batches = heavy_tailed(4)
    stats = observe(batches)
    data = torch.cat(batches)
    chosen = {}
    for method in ("minmax", "mse"):
        low, high = ranges.activation_range(stats, 0, {"method": method}, 255, False)
        chosen[method] = (float(low), float(high))
    assert chosen["mse"][1] - chosen["mse"][0] < chosen["minmax"][1] - chosen["minmax"][0]

    def error(low, high):
        scale = (high - low) / 255
        q = torch.clamp(torch.round((data - low) / scale), 0, 255)
        return float(((q * scale + low) - data).pow(2).mean())

    assert error(*chosen["mse"]) < error(*chosen["minmax"])


def test_symmetric_mse_keeps_the_grid_centred():
    stats = observe(heavy_tailed(5))
    low, high = ranges.activation_range(stats, 0, {"method": "mse"}, 255, True)
    # offset -128 on a 255-step grid: min = -128 delta, max = 127 delta
    assert float(low) / float(high) == pytest.approx(-128 / 127, rel=1e-5)


def test_histogram_counts_are_torch_histc_counts():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(6))
    low, high = float(x.min()), float(x.max())
    counts = bucket_counts(x.numpy(), HISTOGRAM_BINS, low, high)
    assert np.array_equal(counts, torch.histc(x, HISTOGRAM_BINS, low, high).double().numpy())


def test_a_widening_histogram_keeps_every_count_and_its_shape():
    g = torch.Generator().manual_seed(7)
    batches = [torch.randn(20_000, generator=g) * (1 + i) for i in range(4)]
    hist = Histogram()
    for x in batches:
        hist.add(x, float(x.min()), float(x.max()))
    data = torch.cat(batches)
    assert hist.counts.sum() == pytest.approx(data.numel())
    direct = bucket_counts(data.numpy(), HISTOGRAM_BINS, hist.low, hist.high)
    # re-binned counts spread a bucket over its neighbours: equal at a coarser grain
    coarse = hist.counts.reshape(64, -1).sum(1)
    assert np.abs(coarse - direct.reshape(64, -1).sum(1)).max() <= 0.02 * data.numel() / 64 + 50


def test_rebin_onto_the_same_range_is_the_identity():
    counts = np.arange(16, dtype=np.float64)
    assert np.allclose(rebin(counts, -1.0, 1.0, -1.0, 1.0), counts)
