"""Models the tests build: tiny, seeded, each exercising one kind of quantizer."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class FakeQuantConvNet(nn.Module):
    """The tutorial ConvNet, pre-quantized w8a8 with fake-quant ops whose scales and zero
    points are buffers: weights signed symmetric per output channel, activations unsigned
    asymmetric per tensor."""

    def __init__(self, channels: int = 8, size: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, stride=2)
        self.fc = nn.Linear(2 * channels * (size // 2) ** 2, 10)
        for name, layer in (("conv1", self.conv1), ("conv2", self.conv2), ("fc", self.fc)):
            w = layer.weight.detach()
            scale = w.abs().flatten(1).amax(1).clamp_min(1e-8) / 127.0
            self.register_buffer(f"{name}_w_scale", scale)
            self.register_buffer(f"{name}_w_zp", torch.zeros(w.shape[0], dtype=torch.int32))
        for name, scale, zp in (
            ("x", 0.03, 128),
            ("a1", 0.02, 0),
            ("a2", 0.02, 0),
            ("out", 0.05, 120),
        ):
            self.register_buffer(f"{name}_scale", torch.tensor([scale]))
            self.register_buffer(f"{name}_zp", torch.tensor([zp], dtype=torch.int32))

    def act(self, x: torch.Tensor, name: str) -> torch.Tensor:
        scale, zp = getattr(self, f"{name}_scale"), getattr(self, f"{name}_zp")
        return torch.fake_quantize_per_tensor_affine(x, scale, zp, 0, 255)

    def weight(self, name: str) -> torch.Tensor:
        layer = getattr(self, name)
        return torch.fake_quantize_per_channel_affine(
            layer.weight,
            getattr(self, f"{name}_w_scale"),
            getattr(self, f"{name}_w_zp"),
            0,
            -127,
            127,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(x, "x")
        x = self.act(F.relu(F.conv2d(x, self.weight("conv1"), self.conv1.bias, padding=1)), "a1")
        x = F.conv2d(x, self.weight("conv2"), self.conv2.bias, padding=1, stride=2)
        x = self.act(F.relu(x), "a2")
        return self.act(F.linear(torch.flatten(x, 1), self.weight("fc"), self.fc.bias), "out")


class LearnableFakeQuantNet(nn.Module):
    """Learnable fake-quant (LSQ style): per-tensor activations, per-channel weights."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.in_scale = nn.Parameter(torch.tensor([0.02]))
        self.in_zp = nn.Parameter(torch.tensor([128.0]))
        self.w_scale = nn.Parameter(self.fc1.weight.detach().abs().amax(1) / 127.0)
        self.w_zp = nn.Parameter(torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch._fake_quantize_learnable_per_tensor_affine(
            x, self.in_scale, self.in_zp, 0, 255, 1.0
        )
        w = torch._fake_quantize_learnable_per_channel_affine(
            self.fc1.weight, self.w_scale, self.w_zp, 0, -127, 127, 1.0
        )
        return self.fc2(F.relu(F.linear(x, w, self.fc1.bias)))


class BatchNormTrap(nn.Module):
    """Conv + BatchNorm whose fresh running mean equals the conv bias (both zero): an
    optimizer that merges equal initializers would tie two tensors that later differ."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        nn.init.zeros_(self.conv.bias)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("out_scale", torch.tensor([0.05]))
        self.register_buffer("out_zp", torch.tensor([128], dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        return torch.fake_quantize_per_tensor_affine(y, self.out_scale, self.out_zp, 0, 255)
