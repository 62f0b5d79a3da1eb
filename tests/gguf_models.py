"""The GGUF tests' models: the tiny decoders and tokenizer of ``examples/tiny_gguf.py``, and
quantized variants that put a weight quantizer on every linear layer (or the embedding) in the
forms graphbuild's front end recognises: torch's fake-quant per output channel, and
FastForward's blocked tiles.
"""

from __future__ import annotations

import torch
from torch import nn

from examples.tiny_gguf import PROMPT, SENTENCES, VOCAB, decoder, token_ids, tokenizer
from tests.foreign_quantizers import FFQuantizer

__all__ = ["PROMPT", "SENTENCES", "VOCAB", "decoder", "token_ids", "tokenizer"]


class FakeQuantLinear(nn.Module):
    """A linear layer whose weight goes through ``torch.fake_quantize_per_channel_affine``
    (symmetric, per output channel) with scale and zero-point buffers; the parameter keeps
    its name (``...q_proj.weight``)."""

    def __init__(self, linear: nn.Linear, qmin: int, qmax: int):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.qmin, self.qmax = qmin, qmax
        amax = linear.weight.detach().abs().amax(dim=1).clamp_min(1e-8)
        self.register_buffer("w_scale", amax / qmax)
        self.register_buffer("w_zp", torch.zeros(amax.shape[0], dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.fake_quantize_per_channel_affine(
            self.weight, self.w_scale, self.w_zp, 0, self.qmin, self.qmax
        )
        return nn.functional.linear(x, w, self.bias)


class BlockQuantLinear(nn.Module):
    """A linear layer whose weight goes through a FastForward quantizer with tiles of
    ``block`` values along each row (symmetric, ``bits`` wide)."""

    def __init__(self, linear: nn.Linear, bits: int, block: int):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        rows, cols = linear.weight.shape
        top = 2 ** (bits - 1) - 1
        amax = linear.weight.detach().reshape(rows, cols // block, block).abs().amax(dim=2)
        scale = amax.clamp_min(1e-8) / top
        self.weight_quantizer = FFQuantizer(bits, scale.reshape(-1), None, tile=[1, block])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight_quantizer(self.weight), self.bias)


class FakeQuantEmbedding(nn.Module):
    """An embedding whose table goes through ``torch.fake_quantize_per_channel_affine`` per
    row (symmetric int8); the parameter keeps its name (``...embed_tokens.weight``)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight = embedding.weight
        amax = embedding.weight.detach().abs().amax(dim=1).clamp_min(1e-8)
        self.register_buffer("w_scale", amax / 127)
        self.register_buffer("w_zp", torch.zeros(amax.shape[0], dtype=torch.int32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = torch.fake_quantize_per_channel_affine(
            self.weight, self.w_scale, self.w_zp, 0, -127, 127
        )
        return nn.functional.embedding(ids, w)


def quantize_linears(model: nn.Module, make) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (the output projection included) by
    ``make(linear)`` in place; returns the model."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))
    return model
