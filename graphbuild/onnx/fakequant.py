"""The fake-quant kernel of ``bind``: torch's fake-quantize ops, bit for bit, and faster.

Weights bound into the float ``onnx`` format are snapped to their quantizer's grid here, with
the same float32 steps as ``torch.fake_quantize_per_{tensor,channel}_affine`` (what the
quantized torch model runs), evaluated in cache-sized blocks.
"""

from __future__ import annotations

import math

import torch

from graphbuild.errors import ExportError
from graphbuild.quant.quantmap import QParams, QuantSpec

_FQ_BLOCK = 1 << 18
"""Elements per block of :func:`_fake_quantize_blocked` (its passes stay in cache)."""
_FQ_MAX_INDEX = 2.0**62
"""``|x * inv_scale|`` below this keeps torch's int64 grid index defined."""
_FQ_MAX_GRID = 2**20
"""Grid bounds and zero points up to this keep ``q - z`` and ``qmin - z`` exact in float32."""


def fake_quantize(x: torch.Tensor, spec: QuantSpec, qparams: QParams) -> torch.Tensor:
    """``x`` fake-quantized by ``spec``, computed in float32 and returned in ``x.dtype``.

    Per-tensor and per-channel grids of up to 16 bits give what torch's own ops give (what
    the quantized torch model runs), bit for bit, from a faster evaluation of the same float32
    steps (:func:`_fake_quantize_blocked`); ``s * (clamp(round(x / s) + z, qmin, qmax) - z)``
    otherwise.
    """
    xf = x.detach().float()
    scale = qparams.scale.detach().float()
    zero_point = qparams.zero_point.detach()
    if spec.block_size is None and spec.bits <= 16:
        if spec.axis is None:
            scale, zero_point = _scalar(spec, scale), _scalar(spec, zero_point).int()
        else:
            scale, zero_point = scale.reshape(-1), zero_point.reshape(-1).int()
        owned = xf.data_ptr() != x.data_ptr()  # a float32 copy: may be overwritten
        out = _fake_quantize_blocked(xf, scale, zero_point, spec.axis, spec.qmin, spec.qmax, owned)
        if out is None:  # values torch's kernels give no defined result for, or bad shapes
            xf = x.detach().float()
            if spec.axis is None:
                out = torch.fake_quantize_per_tensor_affine(
                    xf, scale, zero_point, spec.qmin, spec.qmax
                )
            else:
                out = torch.fake_quantize_per_channel_affine(
                    xf, scale, zero_point, spec.axis, spec.qmin, spec.qmax
                )
        return out.to(x.dtype)
    s = broadcast_qparam(scale, spec, tuple(x.shape))
    z = broadcast_qparam(zero_point.float(), spec, tuple(x.shape))
    return (s * (torch.clamp(rounded_quotient(xf, s, spec) + z, spec.qmin, spec.qmax) - z)).to(
        x.dtype
    )


#: quantizer ops that multiply by the scale's reciprocal where the others divide by it
_RECIPROCAL_OPS = ("quantized_decomposed.quantize_per_channel_group",)


def rounded_quotient(x: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``round(x / scale)`` (half to even), as the quantizer's own op computes it: torch's
    ``quantize_per_channel_group`` multiplies by ``1.0 / scale`` (which may round the other
    way at a tie), FastForward, AIMET and ONNX's QuantizeLinear divide."""
    if spec.op.startswith(_RECIPROCAL_OPS):
        return torch.round(x * (1.0 / scale))
    return torch.round(x / scale)


def _fake_quantize_blocked(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int | None,
    qmin: int,
    qmax: int,
    owned: bool,
) -> torch.Tensor | None:
    """``torch.fake_quantize_per_{tensor,channel}_affine(x, ...)``, bit for bit, or None.

    torch's CPU kernels compute ``q = int64(z + nearbyint(x * (1.0f / s)))`` in float32 and
    return ``float((clamp(q, qmin, qmax) - z) * s)`` along with a mask (the per-channel op in a
    second, scalar pass). The same float32 steps run here as vectorized in-place passes over
    cache-sized blocks, nothing else: ``t = x * inv_scale``, round half to even, then either
    ``clamp(t, qmin - z, qmax - z)`` (a uniform ``z``: ``t + z`` is exact wherever it is not
    saturated) and ``+ 0.0`` (torch's integer ``q - z`` has no -0.0), or ``t + z``, clamp
    and ``- z``; then ``* s``. Every product is correctly rounded, so the results are the same.
    None when that cannot be promised: a non-finite or huge ``x * inv_scale`` (torch's int64
    cast of it is undefined), huge grid bounds or zero point, arguments torch's op rejects, or
    a tensor off the CPU (other kernels).
    """
    if x.device.type != "cpu" or x.numel() == 0:
        return None
    if not -_FQ_MAX_GRID <= qmin <= qmax <= _FQ_MAX_GRID:
        return None
    if axis is None:
        outer, channels, inner = 1, 1, x.numel()
    else:
        if not 0 <= axis < x.dim():  # torch's op rejects the axis
            return None
        outer, channels = math.prod(x.shape[:axis]), x.shape[axis]
        inner = math.prod(x.shape[axis + 1 :])
    if scale.numel() != channels or zero_point.numel() != channels:
        return None
    z = zero_point.reshape(-1).long()
    z_min, z_max = (int(v) for v in torch.aminmax(z))
    if axis is not None and not qmin <= z_min <= z_max <= qmax:  # torch's op rejects it
        return None
    if max(-z_min, z_max) > _FQ_MAX_GRID:
        return None
    inv = (1.0 / scale).reshape(1, channels, 1)
    s = scale.reshape(1, channels, 1)
    zf = z.float().reshape(1, channels, 1)
    uniform = z_min == z_max
    src = x.contiguous()
    out = src if owned or src.data_ptr() != x.data_ptr() else torch.empty_like(src)
    src, out = src.view(outer, channels, inner), out.view(outer, channels, inner)
    # blocks of about _FQ_BLOCK elements, each contiguous: split inner, else channels, else outer
    inner_step = min(inner, _FQ_BLOCK)
    chan_step = max(1, min(channels, _FQ_BLOCK // inner_step))
    outer_step = max(1, _FQ_BLOCK // (inner_step * channels)) if chan_step == channels else 1
    ranges = []
    for o in range(0, outer, outer_step):
        for c in range(0, channels, chan_step):
            ch = slice(c, c + chan_step)
            for i in range(0, inner, inner_step):
                block = (slice(o, o + outer_step), ch, slice(i, i + inner_step))
                t = out[block]
                torch.mul(src[block], inv[:, ch], out=t)
                ranges.append(torch.stack(torch.aminmax(t)))
                t.round_()
                if uniform:
                    t.clamp_(qmin - z_min, qmax - z_min).add_(0.0)
                else:
                    t.add_(zf[:, ch]).clamp_(qmin, qmax).sub_(zf[:, ch])
                t.mul_(s[:, ch])
    if not bool((torch.stack(ranges).abs() < _FQ_MAX_INDEX).all()):  # NaN compares False
        return None
    return out.view(x.shape)


def broadcast_qparam(t: torch.Tensor, spec: QuantSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """Reshape a scale or zero point so it broadcasts against a tensor of ``shape``."""
    if spec.axis is None:
        return _scalar(spec, t)
    axis = spec.axis % len(shape)
    if spec.block_size is None:
        if t.numel() != shape[axis]:
            raise ExportError(
                f"quantizer {spec.qid}: {t.numel()} per-channel values for {shape[axis]} channels"
            )
        return t.reshape([shape[axis] if i == axis else 1 for i in range(len(shape))])
    blocked = list(shape)
    blocked[axis] = math.ceil(shape[axis] / spec.block_size)
    if t.numel() != math.prod(blocked):
        raise ExportError(
            f"quantizer {spec.qid}: blocked values of shape {tuple(t.shape)}, expected {blocked}"
        )
    full = t.reshape(blocked).repeat_interleave(spec.block_size, dim=axis)
    return full.narrow(axis, 0, shape[axis])


def _scalar(spec: QuantSpec, t: torch.Tensor) -> torch.Tensor:
    if t.numel() != 1:
        raise ExportError(f"quantizer {spec.qid}: per-tensor value has {t.numel()} elements")
    return t.reshape(())
