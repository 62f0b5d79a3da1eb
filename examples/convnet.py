"""The tutorial ConvNet: conv-relu-conv-relu-linear, float, with sample inputs and
calibration batches. ``graphbuild export --target qnn`` in the repository root exports it
with the ``w8a16`` preset (see graphbuild.toml)."""

from __future__ import annotations

import torch
from torch import nn


class ConvNet(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 10, size: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, stride=2)
        self.fc = nn.Linear(2 * channels * (size // 2) ** 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(torch.flatten(x, 1))


def build(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The model (eval mode, seeded weights) and one sample input."""
    torch.manual_seed(seed)
    model = ConvNet().eval()
    return model, (torch.randn(1, 3, 16, 16),)


def calibration(batches: int = 8, seed: int = 1) -> list[tuple[torch.Tensor]]:
    """Calibration batches for PT2E quantization."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 3, 16, 16, generator=g),) for _ in range(batches)]
