"""Calibration statistics: the data half of PT2E quantization (docs/design.md, invariant 13).

Statistics depend on the calibration data and the weights, never on bit-widths: they are what
a recalibration recomputes and what a preset change reuses. Per observer group (see
``frontend.placement``):

- ``min`` and ``max``: what torchao's min/max observers record of every value the group
  saw (per channel along the group's axis for a weight), so a range computed from them is
  exactly the one ``prepare_pt2e`` + calibration + ``convert_pt2e`` gives;
- ``calls_min`` / ``calls_max``: the range of each calibration batch in order (every value
  the group saw in it, at all its sites), for a moving average;
- ``hist`` and ``hist_range`` when asked for: a histogram of the finite values over the
  range they span (``HISTOGRAM_BINS`` bins), for the percentile and MSE range methods.

Groups whose sites all read stored tensors (weights, buffers, constants) are *static*: their
statistics come from the tensors alone (:func:`static_statistics`), so a new calibration set
does not touch them. The others are observed by running the site program over the
calibration batches (:func:`calibrate`). Statistics are a ``{name: tensor}`` dict of a few
packed tensors (every group's values concatenated, with offsets): raw tensors in the cache,
no pickle, a handful of blobs however many quantizers; :class:`Statistics` reads them.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.export import ExportedProgram

from graphbuild.errors import CodecError, ExportError
from graphbuild.frontend.devices import to_device
from graphbuild.frontend.programs import lifted_runner
from graphbuild.quant.markers import MARKER_TARGET

__all__ = [
    "DEGENERATE_STEPS",
    "HISTOGRAM_BINS",
    "GroupStatistics",
    "Statistics",
    "block_range",
    "block_statistics",
    "calibrate",
    "calibration_batches",
    "observed_ranges",
    "pack",
    "static_groups",
    "static_statistics",
]

HISTOGRAM_BINS = 2048
#: a calibrated range narrower than this many of the group's smallest steps has collapsed
DEGENERATE_STEPS = 16


def static_groups(sites: Sequence[Mapping[str, Any]]) -> set[int]:
    """The groups whose every site reads a stored tensor: their statistics need no data."""
    groups = {s["group"] for s in sites}
    return groups - {s["group"] for s in sites if s["input"] not in ("state", "constant")}


class GroupStatistics:
    """The statistics of one group as calibration goes. Per tensor: torchao's
    ``MinMaxObserver.forward`` written out (the same ops, so the same range), keeping each
    calibration batch's range too (:meth:`end_batch` closes one); per channel (weights):
    torchao's ``PerChannelMinMaxObserver``.

    A batch's range covers every value the group saw in it: a group of several sites (a
    concat's inputs and output share one quantizer) is seen several times per batch, and a
    moving average over those sightings would start from whichever site came first (an
    LLM's empty KV cache: zeros) and keep a few percent of the data's range."""

    def __init__(self, axis: int | None, histogram: bool) -> None:
        self.channels = None
        if axis is not None:
            from torchao.quantization.pt2e.observer import PerChannelMinMaxObserver

            self.channels = PerChannelMinMaxObserver(axis)
        self.low = torch.tensor(float("inf"))
        self.high = torch.tensor(float("-inf"))
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._batch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.histogram = Histogram() if histogram and axis is None else None

    def __call__(self, x: torch.Tensor) -> None:
        if self.channels is not None:
            self.channels(x)
            return
        if x.numel() == 0:
            return
        x = x.detach().to(torch.float32)
        low, high = torch.aminmax(x)
        self.low, self.high = torch.min(low, self.low), torch.max(high, self.high)
        if self._batch is None:  # this batch's range so far, for the moving average
            self._batch = (low, high)
        else:
            self._batch = (torch.min(low, self._batch[0]), torch.max(high, self._batch[1]))
        if self.histogram is not None:
            self.histogram.add(x, float(low), float(high))

    def end_batch(self) -> None:
        """Close the current calibration batch: its range becomes one call of the moving
        average (a batch the group saw nothing of adds none)."""
        if self._batch is not None:
            self.calls.append(self._batch)
            self._batch = None

    def extremes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(min, max): 0-d per tensor, one per channel."""
        if self.channels is not None:
            return self.channels.min_val.detach(), self.channels.max_val.detach()
        return self.low, self.high


def pack(observed: Mapping[int, GroupStatistics]) -> dict[str, torch.Tensor]:
    """The statistics of ``observed`` groups as a few tensors: each group's min and max (one
    value per tensor, one per channel), its calls' ranges and its histogram, concatenated
    in group order with offsets (``index`` names the groups)."""
    order = sorted(observed)
    lows, highs, calls_low, calls_high, hists, hist_index, spans = [], [], [], [], [], [], []
    offsets, call_offsets, channels = [0], [0], []
    for group in order:
        obs = observed[group]
        low, high = obs.extremes()
        channels.append(low.dim())
        lows.append(low.reshape(-1).to(torch.float32))
        highs.append(high.reshape(-1).to(torch.float32))
        offsets.append(offsets[-1] + lows[-1].numel())
        calls_low.extend(c[0] for c in obs.calls)
        calls_high.extend(c[1] for c in obs.calls)
        call_offsets.append(call_offsets[-1] + len(obs.calls))
        if obs.histogram is not None and obs.histogram.counts is not None:
            hists.append(torch.from_numpy(obs.histogram.counts.copy()))
            hist_index.append(group)
            spans.append([obs.histogram.low, obs.histogram.high])
    if not order:
        return {}  # no tensor of no bytes: nothing observed, nothing stored
    out = {
        "index": torch.tensor(order, dtype=torch.int64),
        "per_channel": torch.tensor(channels, dtype=torch.int8),
        "min": torch.cat(lows),
        "max": torch.cat(highs),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "call_offsets": torch.tensor(call_offsets, dtype=torch.int64),
    }
    if calls_low:
        out["calls_min"] = torch.stack(calls_low).reshape(-1)
        out["calls_max"] = torch.stack(calls_high).reshape(-1)
    if hists:
        out["hist"] = torch.stack(hists)
        out["hist_index"] = torch.tensor(hist_index, dtype=torch.int64)
        out["hist_range"] = torch.tensor(spans, dtype=torch.float64)
    return out


class Statistics:
    """Reads packed statistics (from :func:`pack`), one or several sets (the weights' and
    the activations'), by group."""

    def __init__(self, *packs: Mapping[str, torch.Tensor]) -> None:
        self._where: dict[int, tuple[Mapping[str, torch.Tensor], int]] = {}
        self._hist: dict[int, tuple[Mapping[str, torch.Tensor], int]] = {}
        for packed in packs:
            if not packed:
                continue
            for i, group in enumerate(packed["index"].tolist()):
                self._where[group] = (packed, i)
            for i, group in enumerate(packed.get("hist_index", torch.zeros(0)).tolist()):
                self._hist[int(group)] = (packed, i)

    def __contains__(self, group: int) -> bool:
        return group in self._where

    def range(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(min, max) of ``group``: 0-d per tensor (as torchao's observer keeps them), one
        value per channel."""
        packed, i = self._where[group]
        start, end = int(packed["offsets"][i]), int(packed["offsets"][i + 1])
        low, high = packed["min"][start:end], packed["max"][start:end]
        if int(packed["per_channel"][i]) == 0:
            return low.reshape(()), high.reshape(())
        return low, high

    def calls(self, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each observed call's (min, max) in order, or None."""
        packed, i = self._where[group]
        start, end = int(packed["call_offsets"][i]), int(packed["call_offsets"][i + 1])
        if start == end:
            return None
        return packed["calls_min"][start:end], packed["calls_max"][start:end]

    def histogram(self, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(counts, [low, high]) of ``group``'s histogram, or None."""
        if group not in self._hist:
            return None
        packed, i = self._hist[group]
        return packed["hist"][i], packed["hist_range"][i]


class Histogram:
    """Counts of the finite values over a range that widens as values arrive: on widening,
    the counts so far are spread over the new bins by overlap (deterministic). Kept in
    numpy: small arrays, where torch's thread pool costs more than the arithmetic."""

    def __init__(self, bins: int = HISTOGRAM_BINS) -> None:
        self.bins = bins
        self.counts: np.ndarray | None = None
        self.low = 0.0
        self.high = 0.0

    def add(self, x: torch.Tensor, low: float, high: float) -> None:
        """Count the values of ``x`` (float32), whose extremes are ``low`` and ``high``."""
        values = x.detach().cpu().numpy().ravel()
        if not (math.isfinite(low) and math.isfinite(high)):
            values = values[np.isfinite(values)]
            if values.size == 0:
                return
            low, high = float(values.min()), float(values.max())
        if self.counts is None:
            self.low, self.high = _widen(low, high)
            self.counts = np.zeros(self.bins, dtype=np.float64)
        elif low < self.low or high > self.high:
            new_low, new_high = _widen(min(low, self.low), max(high, self.high))
            self.counts = rebin(self.counts, self.low, self.high, new_low, new_high)
            self.low, self.high = new_low, new_high
        self.counts += bucket_counts(values, self.bins, self.low, self.high)


def _widen(low: float, high: float) -> tuple[float, float]:
    """A range with room: equal ends get half a unit either side (``torch.histc``'s rule)."""
    return (low - 0.5, high + 0.5) if low == high else (low, high)


def bucket_counts(values: np.ndarray, bins: int, low: float, high: float) -> np.ndarray:
    """How many ``values`` fall in each of ``bins`` equal buckets of ``[low, high]`` (values
    outside are ignored; ``high`` falls in the last bucket), as ``torch.histc`` counts."""
    values = values[(values >= low) & (values <= high)].astype(np.float64)
    index = np.floor((values - low) * (bins / (high - low))).astype(np.int64)
    np.clip(index, 0, bins - 1, out=index)
    return np.bincount(index, minlength=bins).astype(np.float64)


def rebin(
    counts: np.ndarray, low: float, high: float, new_low: float, new_high: float
) -> np.ndarray:
    """``counts`` over ``[low, high]`` spread over as many bins on ``[new_low, new_high]``
    (which contains it), each source bin in proportion to its overlap with each new bin."""
    bins = counts.size
    cumulative = np.concatenate([[0.0], np.cumsum(counts)])
    # each new edge's position on the old bins, and the count below it (uniform per bin)
    edges = np.linspace(new_low, new_high, bins + 1)
    position = np.clip((edges - low) * (bins / (high - low)), 0, bins)
    index = np.minimum(np.floor(position), bins - 1).astype(np.int64)
    fraction = position - index
    below = cumulative[index] + fraction * np.append(counts, 0.0)[index]
    return below[1:] - below[:-1]


def static_statistics(
    sites: Sequence[Mapping[str, Any]],
    groups: Sequence[Mapping[str, Any]],
    tensors: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Statistics of the static groups, from the stored tensors they read (``tensors``: by
    state or constant name)."""
    observed: dict[int, GroupStatistics] = {}
    static = static_groups(sites)
    for site in sites:
        group = site["group"]
        if group not in static:
            continue
        name = site["tensor"]
        if name not in tensors:
            raise ExportError(f"no tensor '{name}' for the quantizer that reads it")
        if group not in observed:
            observed[group] = GroupStatistics(groups[group]["axis"], histogram=False)
        observed[group](tensors[name])
    for obs in observed.values():
        obs.end_batch()
    return pack(observed)


def block_statistics(
    sites: Sequence[Mapping[str, Any]],
    groups: Iterable[int],
    tensors: Mapping[str, torch.Tensor],
    block_size: int,
) -> dict[str, torch.Tensor]:
    """The min and max of each block of ``block_size`` along axis 1 of the 2-D weights the
    static ``groups`` read (``(out, in / block_size)``, as an LPBQ observer keeps them), as
    ``block_min.<group>`` and ``block_max.<group>``: what blocked scales are computed from."""
    out: dict[str, torch.Tensor] = {}
    wanted = set(groups)
    for site in sites:
        group = site["group"]
        if group not in wanted or f"block_min.{group}" in out:
            continue
        x = tensors[site["tensor"]].detach().float()
        if x.dim() != 2 or x.shape[1] % block_size:
            raise ExportError(
                f"blocked weight '{site['tensor']}' of shape {list(x.shape)}: expected "
                f"(out, in) with in a multiple of {block_size}"
            )
        blocks = x.reshape(x.shape[0], -1, block_size)
        out[f"block_min.{group}"] = blocks.amin(dim=-1).contiguous()
        out[f"block_max.{group}"] = blocks.amax(dim=-1).contiguous()
    return out


def block_range(stats: Mapping[str, torch.Tensor], group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) per block of ``group`` from :func:`block_statistics`."""
    key = f"block_min.{group}"
    if key not in stats:
        raise ExportError(f"no block statistics for quantizer group {group}")
    return stats[key].clone(), stats[f"block_max.{group}"].clone()


def calibrate(
    program: ExportedProgram,
    sites: Sequence[Mapping[str, Any]],
    groups: Sequence[Mapping[str, Any]],
    batches: Iterable[tuple],
    *,
    histograms: bool = False,
) -> dict[str, torch.Tensor]:
    """Run ``program`` (a site program with real state) over ``batches`` and return the
    statistics of every group that is not static. A batch holding NaN is refused, naming it;
    so is a quantized tensor whose values went NaN on finite inputs."""
    static = static_groups(sites)
    watched = {s["index"] for s in sites if s["group"] not in static}
    observed = {
        s["group"]: GroupStatistics(groups[s["group"]]["axis"], histograms)
        for s in sites
        if s["index"] in watched
    }
    group_of = {s["index"]: s["group"] for s in sites}

    def record(x: torch.Tensor, site: int) -> None:
        if site in watched:
            observed[group_of[site]](x)

    run = lifted_runner(program, {MARKER_TARGET: _observed})
    with torch.no_grad(), _recording(record):
        for index, batch in enumerate(batches):
            _check_batch(index, batch)
            try:
                run(*batch)
            except CodecError as err:
                raise ExportError(f"quantize: calibration batch {index}: {err}") from err
            for obs in observed.values():
                obs.end_batch()
    out = pack(observed)
    _check_no_nan(sites, Statistics(out))
    return out


_RECORDER = threading.local()


@contextlib.contextmanager
def _recording(record: Callable[[torch.Tensor, int], None]) -> Iterator[None]:
    previous = getattr(_RECORDER, "record", None)
    _RECORDER.record = record
    try:
        yield
    finally:
        _RECORDER.record = previous


def _observed(x: torch.Tensor, site: int) -> torch.Tensor:
    """A marker in calibration's copy of the site program: the value, shown to the
    thread's recorder. One function for every calibration, so the copy is made once per
    program (``lifted_runner`` keeps it)."""
    _RECORDER.record(x, site)
    return x


def calibration_batches(calibration: Iterable | None, sample_args: tuple) -> Iterator[tuple]:
    """Positional-argument tuples on the CPU, from batches that are tuples, lists or single
    values on any device; with no calibration set (``None``), the sample inputs once, with a
    warning. An empty calibration set is refused: it is a mistake, not a request."""
    if calibration is None:
        warnings.warn(
            "quantize: no calibration batches; calibrating on the sample inputs once",
            stacklevel=3,
        )
        yield to_device(tuple(sample_args), "cpu")
        return
    count = 0
    for batch in calibration:
        count += 1
        args = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        yield to_device(args, "cpu")
    if count == 0:
        raise ExportError(
            "quantize: the calibration set is empty; give at least one batch, or none "
            "(calibration=None) to calibrate on the sample inputs"
        )


def _check_batch(index: int, batch: tuple) -> None:
    leaves = torch.utils._pytree.tree_flatten(batch)[0]
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.isnan().any():
            raise ExportError(
                f"quantize: calibration batch {index} holds NaN (input {position}): no range "
                "can be calibrated on it; fix or drop that batch"
            )


def _check_no_nan(sites: Sequence[Mapping[str, Any]], stats: Statistics) -> None:
    """NaN from finite batches: refused, naming the first quantized tensor (in graph order)
    where it appeared, where it comes from, and the others it reached."""
    bad: list[str] = []
    nan_groups = {
        g for g in {s["group"] for s in sites} if g in stats and _has_nan(*stats.range(g))
    }
    for site in sites:
        if site["group"] in nan_groups and site["source"] not in bad:
            bad.append(site["source"])
    if bad:
        others = ", ".join(f"'{n}'" for n in bad[1:6]) + (" ..." if len(bad) > 6 else "")
        also = f" (and reached {others})" if others else ""
        raise ExportError(
            f"quantize: calibration produced NaN, first at '{bad[0]}'{also}, from finite "
            "inputs: no range fits; find where the model makes NaN (a 0/0, a log of a "
            "negative number)"
        )


def _has_nan(low: torch.Tensor, high: torch.Tensor) -> bool:
    return bool(np.isnan(low.numpy()).any() or np.isnan(high.numpy()).any())


def observed_ranges(
    sites: Sequence[Mapping[str, Any]],
    groups: Sequence[Mapping[str, Any]],
    stats: Statistics,
) -> tuple[dict[int, str], dict[str, list[float]]]:
    """What calibration says about each quantizer before any bit-width is known: the sites
    whose group saw ``inf`` (they stay float: no scale fits; site -> why), and the
    activations whose finite range spans fewer than :data:`DEGENERATE_STEPS` steps of the
    smallest scale (observed node name -> [min, max]). NaN anywhere, and a non-finite value
    in a per-channel weight, are errors naming the tensor."""
    verdicts = {g: _verdict(groups[g], stats) for g in {s["group"] for s in sites}}
    dropped: dict[int, str] = {}
    degenerate: dict[str, list[float]] = {}
    for site in sites:
        verdict, extremes = verdicts[site["group"]]
        what = f"'{site['source']}'" + (f" ('{site['tensor']}')" if site["tensor"] else "")
        if verdict == "nan":
            raise ExportError(
                f"quantize: the values observed at {what} include NaN: no range fits; fix "
                "the tensor or the model before quantizing"
            )
        if verdict == "infinite":
            if groups[site["group"]]["axis"] is not None:
                raise ExportError(
                    f"quantize: the values observed at {what} are not finite ({extremes}); a "
                    "quantizer there would have no valid scale. Use a finite attention mask "
                    "or keep that op in float."
                )
            dropped[site["index"]] = (
                "calibration saw non-finite values (an additive -inf mask?): no scale fits"
            )
        elif verdict == "degenerate" and site["input"] in ("activation", "input"):
            degenerate[site["source"]] = list(extremes)
    return dropped, degenerate


def _verdict(group: Mapping[str, Any], stats: Statistics) -> tuple[str, Any]:
    """One group's statistics judged: ``nan``, ``infinite`` (with its extremes), ``degenerate``
    (with [min, max]: a per-tensor range narrower than a few of its smallest steps) or ``ok``.
    In numpy: a few numbers, where torch's per-op cost dominates."""
    low, high = (t.detach().cpu().numpy() for t in stats.range(group["index"]))
    if np.isnan(low).any() or np.isnan(high).any():
        return "nan", None
    untouched = (low == np.inf) & (high == -np.inf)
    finite = np.isfinite(low) & np.isfinite(high)
    if (~untouched & ~finite).any():
        return "infinite", f"min {float(low.min())}, max {float(high.max())}"
    if low.size == 1:
        lo, hi = min(float(low.reshape(())), 0.0), max(float(high.reshape(())), 0.0)
        finite_range = math.isfinite(lo) and math.isfinite(hi) and lo <= hi
        if finite_range and 0.0 < hi - lo < DEGENERATE_STEPS * group["eps"]:  # zeros lose nothing
            return "degenerate", (float(low.reshape(())), float(high.reshape(())))
    return "ok", None
