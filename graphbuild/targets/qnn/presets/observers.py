"""Observers and quantization specs on AIMET's grids, for the QNN presets.

Symmetric quantizers use the full signed grid (int8 ``[-128, 127]``, int4 ``[-8, 7]``, int16
``[-32768, 32767]``) with zero point 0 and AIMET's scale ``max(max / (2^(b-1) - 1), -min /
2^(b-1))``: QNN's offset is then ``-2^(b-1)`` and the declared grid is the one used, so a QDQ
model needs no clamping. Asymmetric quantizers are torchao's min/max on the unsigned grid (the
range always holds zero). An encoding constraint (Softmax in [0, 1], Tanh in [-1, 1]) pins one
or both ends of the range instead of observing them; a minimum step (the HTP's, for a
Softmax's input) widens a narrower observed range about its middle.
"""

from __future__ import annotations

import torch
from torchao.quantization.pt2e.observer import MinMaxObserver, PerChannelMinMaxObserver
from torchao.quantization.pt2e.quantizer import QuantizationSpec

from graphbuild.errors import ConfigError

__all__ = ["AimetMinMaxObserver", "AimetPerChannelMinMaxObserver", "quantization_spec"]

_SIGNED = {4: torch.int8, 8: torch.int8, 16: torch.int16}
_UNSIGNED = {4: torch.uint8, 8: torch.uint8, 16: torch.uint16}


def _symmetric_qparams(
    min_val: torch.Tensor, max_val: torch.Tensor, quant_min: int, quant_max: int, eps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """AIMET's symmetric scale on the full signed grid, zero point 0."""
    low = torch.clamp(min_val, max=0.0)
    high = torch.clamp(max_val, min=0.0)
    scale = torch.maximum(high / quant_max, -low / -quant_min)
    scale = torch.max(scale, eps.to(scale.device))
    return scale.to(torch.float32), torch.zeros_like(scale, dtype=torch.int64)


class AimetMinMaxObserver(MinMaxObserver):
    """Per-tensor min/max observer with AIMET's symmetric scale and optional fixed ends."""

    def __init__(
        self,
        *args,
        fixed_min: float | None = None,
        fixed_max: float | None = None,
        min_scale: float | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.fixed_min = fixed_min
        self.fixed_max = fixed_max
        self.min_scale = min_scale

    def _calculate_qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fixed_min is not None:
            min_val = torch.full_like(min_val, self.fixed_min)
        if self.fixed_max is not None:
            max_val = torch.full_like(max_val, self.fixed_max)
        if self.min_scale is not None:
            min_val, max_val = _widened(
                min_val, max_val, self.min_scale * (self.quant_max - self.quant_min)
            )
        if self.qscheme == torch.per_tensor_symmetric:
            scale, zero_point = _symmetric_qparams(
                min_val, max_val, self.quant_min, self.quant_max, self.eps
            )
            return scale.reshape(1), zero_point.reshape(1)
        return super()._calculate_qparams(min_val, max_val)


def _widened(
    min_val: torch.Tensor, max_val: torch.Tensor, span: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[min, max] grown about its middle to at least ``span`` wide (zero stays inside)."""
    low, high = torch.clamp(min_val, max=0.0), torch.clamp(max_val, min=0.0)
    extra = torch.clamp(span - (high - low), min=0.0) / 2
    return low - extra, high + extra


class AimetPerChannelMinMaxObserver(PerChannelMinMaxObserver):
    """Per-channel min/max observer with AIMET's symmetric scale (weights)."""

    def _calculate_qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.qscheme == torch.per_channel_symmetric:
            return _symmetric_qparams(min_val, max_val, self.quant_min, self.quant_max, self.eps)
        return super()._calculate_qparams(min_val, max_val)


def quantization_spec(
    bits: int,
    *,
    symmetric: bool,
    axis: int | None = None,
    fixed: tuple[float | None, float | None] | None = None,
    min_scale: float | None = None,
) -> QuantizationSpec:
    """A torchao spec on AIMET's grid: signed and symmetric, or unsigned and asymmetric;
    per channel along ``axis`` (symmetric only), else per tensor; ``min_scale`` the smallest
    step the range may give (per tensor only)."""
    if bits not in _SIGNED:
        raise ConfigError(f"bit-width must be 4, 8 or 16, got {bits}")
    if symmetric:
        dtype, quant_min, quant_max = _SIGNED[bits], -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    else:
        dtype, quant_min, quant_max = _UNSIGNED[bits], 0, 2**bits - 1
    if axis is not None:
        if not symmetric:
            raise ConfigError("per-channel quantization is symmetric on HTP")
        return QuantizationSpec(
            dtype=dtype,
            observer_or_fake_quant_ctr=AimetPerChannelMinMaxObserver,
            quant_min=quant_min,
            quant_max=quant_max,
            qscheme=torch.per_channel_symmetric,
            ch_axis=axis,
        )
    low, high = fixed if fixed is not None else (None, None)
    observer = AimetMinMaxObserver.with_args(fixed_min=low, fixed_max=high, min_scale=min_scale)
    return QuantizationSpec(
        dtype=dtype,
        observer_or_fake_quant_ctr=observer,
        quant_min=quant_min,
        quant_max=quant_max,
        qscheme=torch.per_tensor_symmetric if symmetric else torch.per_tensor_affine,
    )
