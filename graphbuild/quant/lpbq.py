"""Low-power blockwise quantization (LPBQ): block scales stored as integers under a float
scale per channel.

A blocked weight quantizer has one scale per (channel, block). LPBQ, as AIMET
(``GroupedBlockQuantizeDequantize``, ``LPBQScaleQuantizer``) and FastForward
(``export/_lpbq.py``, ``LPBQProcessor``) compute it and QNN's HTP runs it, quantizes those
scales once more, per channel::

    channel_scale = max over the channel's blocks of scale / 2^k
    block_int_scale = clamp(round(scale / channel_scale), 1, 2^k)
    effective scale = block_int_scale * channel_scale

with ``k`` the block scales' bit-width (AIMET's ``scale_bits`` = ``decompressed_bw -
bitwidth``; FastForward's ``compressed_bw`` with ``decompressed_bw = 2 * compressed_bw``). The
weight is then quantized with the effective scale. All arithmetic is float32, division then
rounding half to even, as both libraries do it; compressing scales that are already LPBQ
scales gives them back exactly (the largest block of a channel is exactly ``2^k`` times its
channel scale), so a model's own LPBQ scales pass through unchanged.

The per-block integers fit ``k + 1`` bits unsigned (``2^k`` itself is one of them): QNN's
execution provider reads them as uint8.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from graphbuild.errors import ExportError
from graphbuild.quant.quantmap import QuantMap

__all__ = ["as_lpbq", "channel_axis_of", "compress", "lpbq_axes"]


def channel_axis_of(grid: Sequence[int], block_axis: int) -> int:
    """The channel axis of an LPBQ quantizer whose block scales have shape ``grid``: the one
    axis besides ``block_axis`` longer than 1 (AIMET: an LPBQ tensor has at most two
    non-singleton axes), or for a single channel the axis next to the block axis."""
    rank = len(grid)
    block_axis %= rank
    wide = [i for i, d in enumerate(grid) if d > 1 and i != block_axis]
    if len(wide) > 1:
        raise ExportError(
            f"LPBQ needs one channel axis besides the block axis {block_axis}; block scales of "
            f"shape {list(grid)} vary along axes {wide}"
        )
    if wide:
        return wide[0]
    return 0 if block_axis != 0 or rank == 1 else 1


def lpbq_axes(grid: Sequence[int], block_axis: int, channel_axis: int | None) -> tuple[int, int]:
    """(channel axis, block axis), both non-negative, for block scales of shape ``grid``."""
    rank = len(grid)
    block = block_axis % rank
    channel = channel_axis_of(grid, block) if channel_axis is None else channel_axis % rank
    if channel == block:
        raise ExportError(f"LPBQ: the channel axis and the block axis are both {block}")
    return channel, block


def compress(
    scale: torch.Tensor, block_axis: int, scale_bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(block_int_scale, channel_scale, effective)`` of the block scales ``scale``.

    ``block_int_scale`` (int64) and ``effective`` (float32) have ``scale``'s shape;
    ``channel_scale`` (float32) has one value per channel, in channel order.
    """
    if not 1 <= scale_bits <= 8:
        raise ExportError(f"LPBQ block scales of {scale_bits} bits: expected 1 to 8")
    s = scale.detach().to(torch.float32)
    if s.dim() == 0 or s.numel() == 0:
        raise ExportError(f"LPBQ needs block scales, got a tensor of shape {list(s.shape)}")
    block_axis %= s.dim()
    channel_axis_of(tuple(s.shape), block_axis)  # the layout check
    top = float(2**scale_bits)
    channel = s.amax(dim=block_axis, keepdim=True) / top
    ints = torch.clamp(torch.round(s / channel), 1, top)
    ints = torch.where(channel > 0, ints, torch.ones_like(ints))  # an all-zero channel
    effective = ints * channel
    return ints.to(torch.int64), channel.reshape(-1).clone(), effective


def as_lpbq(qmap: QuantMap, weight_bits: int = 4) -> QuantMap:
    """``qmap`` with every blocked ``weight_bits``-bit weight quantizer on the full signed
    grid made LPBQ, as FastForward's ``LPBQProcessor(compressed_bw=4, decompressed_bw=8)``
    converts blocked weights at export: block scales as wide as the weight
    (``2^compressed_bw`` levels; the decompressed grid twice the weight's). Whether the
    quantizer is symmetric shows in its values: a non-zero zero point is an error when they
    are read. Other quantizers are left as they are."""
    grid = (-(2 ** (weight_bits - 1)), 2 ** (weight_bits - 1) - 1)
    out = []
    for spec in qmap:
        if (
            spec.block_size is not None
            and spec.param is not None
            and spec.block_scale_bits is None
            and spec.signed
            and (spec.bits, spec.qmin, spec.qmax) == (weight_bits, *grid)
        ):
            spec = replace(spec, block_scale_bits=weight_bits, symmetric=True)
        out.append(spec)
    return QuantMap(tuple(out))
