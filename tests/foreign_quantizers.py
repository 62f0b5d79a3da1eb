"""Faithful minimal stand-ins for FastForward's and aimet-torch's quantizers, for the tests.

Neither library installs into the test environment: FastForward is not on the package
registry, and aimet-torch pulls in a CUDA torchvision and a plotting stack. What graphbuild
recognises is the form their quantizers take in a ``torch.export`` graph, so these stand-ins
reproduce exactly that form and arithmetic:

- FastForward (github qualcomm FastForward, ``src/fastforward/quantization/_quantizer_impl.py``
  and ``affine/_autograd.py``, ``tiled_tensor.py``): the custom ops
  ``fastforward::quantize_by_tile(Tensor data, Tensor scale, SymInt[] tile_size, float
  num_bits, ScalarType? output_dtype, Tensor? offset=None)`` and
  ``fastforward::dequantize_by_tile(Tensor data, Tensor scale, SymInt[] tile_size, Tensor?
  offset=None, ScalarType? output_dtype=None)``, registered with ``torch.library.custom_op``
  as FastForward does, called in that order in export mode by ``LinearQuantizer``. When the
  real ``fastforward`` is importable its ops are used instead.
- aimet-torch 2.42 (``aimet_torch/quantization/affine/quantizer.py`` ``get_scale`` /
  ``get_offset``, ``backends/torch_builtins.py`` ``QuantDequantFunc._forward_impl``):
  ``QuantizeDequantize`` with ``min``/``max`` parameters, scale and offset computed from them
  in the forward pass, then ``div -> round_ -> sub_ -> clamp_ -> add_ -> mul_`` with the
  range mask computed while anything requires grad.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

with contextlib.suppress(ImportError):
    import fastforward  # noqa: F401  - the real ops, when installed

if not hasattr(torch.ops.fastforward, "quantize_by_tile"):

    def _tiles_to_rows(data: torch.Tensor, tile: Sequence[int]) -> torch.Tensor:
        blocks = [d // t for d, t in zip(data.shape, tile, strict=True)]
        shape = [v for pair in zip(blocks, tile, strict=True) for v in pair]
        tiled = data.reshape(shape)
        order = list(range(0, tiled.ndim, 2)) + list(range(1, tiled.ndim, 2))
        return tiled.permute(order).reshape(data.numel() // max(1, _numel(tile)), -1)

    def _rows_to_tiles(rows: torch.Tensor, shape: Sequence[int], tile: Sequence[int]):
        blocks = [d // t for d, t in zip(shape, tile, strict=True)]
        tiled = rows.reshape([*blocks, *tile])
        n = len(shape)
        order = [i for pair in zip(range(n), range(n, 2 * n), strict=True) for i in pair]
        return tiled.permute(order).reshape(shape)

    def _numel(tile: Sequence[int]) -> int:
        out = 1
        for t in tile:
            out *= t
        return out

    @torch.library.custom_op("fastforward::quantize_by_tile", mutates_args=())
    def quantize_by_tile(
        data: torch.Tensor,
        scale: torch.Tensor,
        tile_size: Sequence[int],
        num_bits: float,
        output_dtype: torch.dtype | None,
        offset: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scale = scale.reshape(-1)
        offset = torch.round(offset.reshape(-1)) if offset is not None else torch.zeros_like(scale)
        lo, hi = -(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1
        rows = _tiles_to_rows(data, tile_size)
        q = torch.clamp(torch.round(rows / scale[:, None] - offset[:, None]), lo, hi)
        return _rows_to_tiles(q, data.shape, tile_size).to(output_dtype or data.dtype)

    @quantize_by_tile.register_fake
    def _(data, scale, tile_size, num_bits, output_dtype, offset=None):
        return torch.empty_like(data)

    @torch.library.custom_op("fastforward::dequantize_by_tile", mutates_args=())
    def dequantize_by_tile(
        data: torch.Tensor,
        scale: torch.Tensor,
        tile_size: Sequence[int],
        offset: torch.Tensor | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        scale = scale.reshape(-1)
        offset = torch.round(offset.reshape(-1)) if offset is not None else torch.zeros_like(scale)
        rows = _tiles_to_rows(data, tile_size)
        out = _rows_to_tiles((rows + offset[:, None]) * scale[:, None], data.shape, tile_size)
        return out.to(output_dtype) if output_dtype else out

    @dequantize_by_tile.register_fake
    def _(data, scale, tile_size, offset=None, output_dtype=None):
        return torch.empty_like(data)


class FFQuantizer(nn.Module):
    """FastForward's ``LinearQuantizer`` in export mode: ``scale`` a parameter, ``offset`` a
    parameter (asymmetric), a buffer (symmetric, one-sided allowed) or None; ``tile`` the
    granularity's tile size for the tensor it will see (None: the whole tensor)."""

    def __init__(
        self,
        num_bits: int,
        scale: torch.Tensor,
        offset: torch.Tensor | None,
        tile: Sequence[int] | None = None,
        offset_is_buffer: bool = False,
    ):
        super().__init__()
        self.num_bits, self.tile = num_bits, tile
        self.scale = nn.Parameter(scale.float())
        if offset is None:
            self.register_parameter("offset", None)
        elif offset_is_buffer:
            self.register_buffer("offset", offset.float())
        else:
            self.offset = nn.Parameter(offset.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tile = list(self.tile) if self.tile is not None else list(x.shape)
        q = torch.ops.fastforward.quantize_by_tile(
            x, self.scale, tile, float(self.num_bits), x.dtype, self.offset
        )
        return torch.ops.fastforward.dequantize_by_tile(q, self.scale, tile, self.offset, x.dtype)


def _minimum_scale(num_steps: int) -> float:
    """aimet_torch.common.quantsim._get_minimum_scale."""
    return min(float(torch.finfo(torch.float32).eps), 0.01 / num_steps)


class AimetQuantizeDequantize(nn.Module):
    """aimet-torch's ``QuantizeDequantize(shape, bitwidth, symmetric)``: asymmetric is
    unsigned ``[0, 2^b - 1]``, symmetric is signed ``[-2^(b-1), 2^(b-1) - 1]`` with offset
    ``-round((qmin + qmax) / 2)``; ``min``/``max`` parameters of ``shape``."""

    def __init__(self, shape: Sequence[int], bitwidth: int, symmetric: bool):
        super().__init__()
        self.shape, self.symmetric = tuple(shape), symmetric
        if symmetric:
            self.qmin, self.qmax = -(2 ** (bitwidth - 1)), 2 ** (bitwidth - 1) - 1
        else:
            self.qmin, self.qmax = 0, 2**bitwidth - 1
        self.min = nn.Parameter(torch.full(self.shape, -1.0))
        self.max = nn.Parameter(torch.full(self.shape, 1.0))

    @torch.no_grad()
    def set_range(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        self.min.copy_(lo.reshape(self.shape))
        self.max.copy_(hi.reshape(self.shape))

    def get_scale(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        num_steps = self.qmax - self.qmin
        scale = (self.max.to(dtype) - self.min.to(dtype)) / num_steps
        return scale.abs().clamp_min_(_minimum_scale(num_steps)).to(dtype)

    def get_offset(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.symmetric:
            fill = -round((self.qmin + self.qmax) / 2)
            return torch.full(self.shape, fill, dtype=dtype).to(dtype)
        scale = self.get_scale(dtype)
        return torch.clamp(torch.round(self.min / scale) - self.qmin, -self.qmax, -self.qmin).to(
            dtype
        )

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        scale, offset = self.get_scale(), self.get_offset()  # the encoding's scale and offset
        scale, offset = scale.to(tensor.dtype), offset.to(tensor.dtype)  # quantize_dequantize
        x_round = torch.round_(tensor.to(scale.dtype) / scale).sub_(offset)
        if tensor.requires_grad or scale.requires_grad or offset.requires_grad:
            _mask = (self.qmin <= x_round) & (x_round <= self.qmax)
        x_dequant = x_round.clamp_(self.qmin, self.qmax).add_(offset).mul_(scale)
        return x_dequant.to(tensor.dtype).view(tensor.shape)


def _interleave(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """aimet_torch.quantization._utils.interleave."""
    return tuple(v for pair in zip(a, b, strict=True) for v in pair)


def _concretize_block_size(
    input_shape: Sequence[int], scale_shape: Sequence[int], block_size: Sequence[int]
) -> tuple[int, ...]:
    """aimet_torch.quantization._utils.concretize_block_size."""
    input_shape = input_shape[-len(scale_shape) :]
    block = [*(1 for _ in range(len(scale_shape) - len(block_size))), *block_size]
    return tuple(
        block[i] if block[i] != -1 else input_shape[i] // scale_shape[i]
        for i in range(len(scale_shape))
    )


def _aimet_blocked_qdq(
    tensor: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    qmin: int,
    qmax: int,
    block_size: Sequence[int],
) -> torch.Tensor:
    """aimet-torch's ``quantize_dequantize`` with a block size (``backends/torch_builtins.py``:
    never torch's fake-quant fast path) and ``QuantDequantFunc._forward_impl``, float32."""
    orig_shape = tensor.shape
    block_size = _concretize_block_size(tensor.shape, scale.shape, block_size)
    tensor = tensor.reshape(-1, *_interleave(scale.shape, block_size))
    scale = scale.view(_interleave(scale.shape, [1] * scale.dim()))
    offset = offset.view(_interleave(offset.shape, [1] * offset.dim()))
    x_round = torch.round_(tensor.to(scale.dtype) / scale).sub_(offset)
    if tensor.requires_grad or scale.requires_grad or offset.requires_grad:
        _mask = (qmin <= x_round) & (x_round <= qmax)
    x_dequant = x_round.clamp_(qmin, qmax).add_(offset).mul_(scale)
    return x_dequant.to(tensor.dtype).view(orig_shape)


class AimetGroupedBlockQuantizeDequantize(AimetQuantizeDequantize):
    """aimet-torch 2.42's ``GroupedBlockQuantizeDequantize(shape, bitwidth, symmetric=True,
    decompressed_bw, block_size=..., block_grouping=...)`` (``quantization/affine/
    quantizer.py``), what ``set_grouped_blockwise_quantization_for_weights`` puts on a linear
    layer: ``shape (out, in / B)``, ``block_size (1, B)``, ``block_grouping (1, -1)``. The
    forward pass computes the raw block scales from ``min``/``max`` (``get_scale``), the
    per-channel scale as their maximum over the channel's blocks ``/ 2^(decompressed_bw -
    bitwidth)``, the LPBQ scale as the raw scales quantize-dequantized on that per-channel
    scale over ``[1, 2^(decompressed_bw - bitwidth)]``, then the blocked weight QDQ."""

    def __init__(
        self,
        shape: Sequence[int],
        bitwidth: int,
        decompressed_bw: int,
        block_size: Sequence[int],
        block_grouping: Sequence[int],
    ):
        super().__init__(shape, bitwidth, symmetric=True)
        self.bitwidth, self.decompressed_bw = bitwidth, decompressed_bw
        self.block_size, self.block_grouping = tuple(block_size), tuple(block_grouping)

    def _per_channel_scale(self, raw: torch.Tensor) -> torch.Tensor:
        shape = [
            s // g if g != -1 else 1 for s, g in zip(raw.shape, self.block_grouping, strict=True)
        ]
        grouping = _concretize_block_size(raw.shape, shape, self.block_grouping)
        reshaped = raw.reshape(*raw.shape[: raw.dim() - len(shape)], *_interleave(shape, grouping))
        max_scale = torch.amax(reshaped, dim=tuple(range(1, reshaped.dim(), 2)))
        return max_scale / 2 ** (self.decompressed_bw - self.bitwidth)

    def lpbq_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``_get_scale``: (the LPBQ block scale, the per-channel scale)."""
        raw = AimetQuantizeDequantize.get_scale(self)
        per_channel = self._per_channel_scale(raw)
        lpbq = _aimet_blocked_qdq(
            raw,
            per_channel,
            torch.zeros_like(per_channel),
            1,
            2 ** (self.decompressed_bw - self.bitwidth),
            self.block_grouping,
        )
        return lpbq, per_channel

    def get_scale(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.lpbq_scales()[0]

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        scale, offset = self.get_scale(), self.get_offset()  # get_encodings
        return _aimet_blocked_qdq(tensor, scale, offset, self.qmin, self.qmax, self.block_size)
