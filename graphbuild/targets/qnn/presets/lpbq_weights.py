"""LPBQ weights for the QNN presets: a torchao PT2E observer and what its quantizer becomes.

``w4a16_lpbq`` quantizes a linear layer's weight ``(out, in)`` in blocks of
:data:`BLOCK_SIZE` input channels on the int4 grid ``[-8, 7]``, symmetric, each block's scale
AIMET's symmetric min/max scale, compressed to LPBQ (:func:`graphbuild.quant.lpbq.compress`:
4-bit integer block scales under one float scale per output channel; AIMET's
``set_lpbq_for_params(sim, bitwidth=4, block_size=64)`` and FastForward's
``LPBQProcessor(compressed_bw=4, decompressed_bw=8)``). The quantized program computes with
those LPBQ scales, so the torch model, the ONNX model and the encodings agree.

On ``convert_pt2e`` the observer becomes ``quantized_decomposed.quantize_per_channel_group``
followed by ``dequantize_per_channel_group`` (groups along the last axis, torch's own blocked
pair), which normalize reads as a blocked quantizer; the quantize stage notes that the
preset's blocked quantizers are LPBQ (:data:`NOTE`) and normalize records it in the quant map.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.observer import ObserverBase
from torchao.quantization.pt2e.quantizer import QuantizationSpec

from graphbuild.errors import ExportError
from graphbuild.quant.lpbq import compress

__all__ = ["BLOCK_SIZE", "NOTE", "SCALE_BITS", "LpbqWeightObserver", "lpbq_spec", "takes_lpbq"]

BLOCK_SIZE = 64
"""Input channels per block: AIMET's documented LPBQ block and FastForward's tile."""
SCALE_BITS = 4
"""Bits of the integer block scales (AIMET's ``decompressed_bw`` 8 minus the weight's 4)."""
NOTE = "lpbq_block_scale_bits"
"""The quantize stage's note: its program's blocked weight quantizers are LPBQ with this many
bits of block scale."""

_QMIN, _QMAX = -8, 7


def takes_lpbq(shape: tuple[int, ...], axis: int, block_size: int = BLOCK_SIZE) -> bool:
    """Whether a weight of ``shape`` with output channels along ``axis`` is quantized in LPBQ
    blocks: a 2-D ``(out, in)`` weight whose input channels divide into blocks (AIMET's
    ``set_lpbq_for_params`` leaves the others per channel)."""
    return len(shape) == 2 and axis == 0 and shape[1] % block_size == 0 and shape[1] > 0


def lpbq_spec(block_size: int = BLOCK_SIZE, scale_bits: int = SCALE_BITS) -> QuantizationSpec:
    """The PT2E spec of an LPBQ weight: int4 ``[-8, 7]``, symmetric, blocks along axis 1."""
    return QuantizationSpec(
        dtype=torch.int8,
        observer_or_fake_quant_ctr=LpbqWeightObserver.with_args(
            block_size=block_size, scale_bits=scale_bits
        ),
        quant_min=_QMIN,
        quant_max=_QMAX,
        qscheme=torch.per_channel_symmetric,
        ch_axis=0,
    )


class LpbqWeightObserver(ObserverBase):
    """Min/max of each block of ``block_size`` along axis 1 of a 2-D weight; its qparams are
    the LPBQ-compressed AIMET symmetric scales (``(out, in / block_size)``) and zeros."""

    def __init__(
        self,
        dtype: torch.dtype = torch.int8,
        *,
        block_size: int = BLOCK_SIZE,
        scale_bits: int = SCALE_BITS,
        quant_min: int = _QMIN,
        quant_max: int = _QMAX,
        eps: float = torch.finfo(torch.float32).eps,
        **_: Any,
    ) -> None:
        super().__init__(dtype=dtype, is_dynamic=False)
        self.block_size, self.scale_bits = block_size, scale_bits
        self.quant_min, self.quant_max = quant_min, quant_max
        self.qscheme = torch.per_channel_symmetric  # a non-finite weight is an error
        self.register_buffer("eps", torch.tensor([eps]))
        self.register_buffer("min_val", torch.tensor([]))
        self.register_buffer("max_val", torch.tensor([]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] % self.block_size:
            raise ExportError(
                f"LPBQ weight of shape {list(x.shape)}: expected (out, in) with in a multiple "
                f"of {self.block_size}"
            )
        blocks = x.detach().float().reshape(x.shape[0], -1, self.block_size)
        low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
        if self.min_val.numel():
            low, high = torch.minimum(low, self.min_val), torch.maximum(high, self.max_val)
        self.min_val, self.max_val = low, high
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """LPBQ block scales (float32, ``(out, blocks)``) and zero points (int64 zeros)."""
        if not self.min_val.numel():
            raise ExportError("LPBQ weight observer saw no weight")
        low = torch.clamp(self.min_val, max=0.0)
        high = torch.clamp(self.max_val, min=0.0)
        raw = torch.maximum(high / self.quant_max, -low / -self.quant_min)
        raw = torch.max(raw, self.eps)  # AIMET's symmetric scale, as the presets' observers
        _, _, effective = compress(raw, 1, self.scale_bits)
        return effective, torch.zeros(effective.shape, dtype=torch.int64)

    def convert(self, model: GraphModule, observer_node: Node) -> None:
        """Replace the observer with ``quantize_per_channel_group`` ->
        ``dequantize_per_channel_group`` on the LPBQ scales."""
        from torchao.quantization.pt2e.utils import create_getattr_from_value

        scale, zero_point = self.calculate_qparams()
        graph = model.graph
        (x,) = observer_node.args
        ops = torch.ops.quantized_decomposed
        with graph.inserting_before(observer_node):
            s = create_getattr_from_value(model, graph, "_lpbq_scale_", scale)
            z = create_getattr_from_value(model, graph, "_lpbq_zero_point_", zero_point)
            common = (s, z, self.quant_min, self.quant_max, torch.int8, self.block_size)
            q = graph.call_function(ops.quantize_per_channel_group.default, (x, *common))
            dq = graph.call_function(
                ops.dequantize_per_channel_group.default, (q, *common, torch.float32)
            )
        observer_node.replace_all_uses_with(dq)
        graph.erase_node(observer_node)
