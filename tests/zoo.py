"""The model zoo: small, randomly initialised versions of the architectures people export to
QNN, built from configs in the test (nothing is downloaded).

* ``resnet``: torchvision-style basic blocks written out, with in-place ``relu_`` and ``+=``
  (``add_``), max pool, adaptive average pool;
* ``mobilenetv3``: MobileNetV3 blocks: hardswish, depthwise convolutions, squeeze-excite
  (average pool, hardsigmoid, mul), residual adds;
* ``bert``, ``gpt2``, ``llama`` (grouped-query attention), ``vit``, ``gptneox`` (a rotary
  embedding over the whole head: its pass-through half is a zero-size tensor): transformers'
  own models from tiny configs, with their default (sdpa) attention; BERT returns its output
  dataclass, the others are wrapped to return the logits tensor;
* ``convbias``: convolutions whose biases are computed in ``forward`` (a zero bias made there,
  a learned scalar expanded to the channels);
* ``poolhead``: a classifier head pooling with a fixed 7x7 window (``ceil_mode``) over a
  smaller feature map: the window covers the whole input.

Each entry gives the model, one sample input and calibration batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, IMAGE = 128, 16, (1, 3, 16, 16)


# --------------------------------------------------------------------------- CNNs


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: in-place ReLU and ``out += identity``."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeeze: int = 4) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, channels // squeeze, 1)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(channels // squeeze, channels, 1)
        self.scale = nn.Hardsigmoid(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.fc2(self.relu(self.fc1(self.avgpool(x))))) * x


class InvertedResidual(nn.Module):
    def __init__(self, channels: int, expanded: int, se: bool) -> None:
        super().__init__()
        self.expand = nn.Sequential(
            nn.Conv2d(channels, expanded, 1, bias=False),
            nn.BatchNorm2d(expanded),
            nn.Hardswish(inplace=True),
        )
        self.depthwise = nn.Sequential(
            nn.Conv2d(expanded, expanded, 3, 1, 1, groups=expanded, bias=False),
            nn.BatchNorm2d(expanded),
            nn.Hardswish(inplace=True),
        )
        self.se = SqueezeExcite(expanded) if se else nn.Identity()
        self.project = nn.Sequential(
            nn.Conv2d(expanded, channels, 1, bias=False), nn.BatchNorm2d(channels)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.se(self.depthwise(self.expand(x))))


class MobileNetV3(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.Hardswish(inplace=True)
        )
        self.blocks = nn.Sequential(
            InvertedResidual(8, 16, se=True), InvertedResidual(8, 24, se=False)
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(8, 32), nn.Hardswish(inplace=True), nn.Dropout(0.2), nn.Linear(32, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def _trained_looking_batchnorm(model: nn.Module, seed: int) -> None:
    """Random running statistics and affine parameters, as a trained network has (a freshly
    built BatchNorm is the identity)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.75)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)


class ConvBias(nn.Module):
    """Biases computed in ``forward``: what QNN cannot take as a convolution's bias."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.3)
        self.bn1 = nn.BatchNorm2d(8)
        self.w2 = nn.Parameter(torch.randn(8, 8, 3, 3) * 0.15)
        self.shift = nn.Parameter(torch.tensor([0.1]))
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(F.conv2d(x, self.w1, torch.zeros(8), stride=2, padding=1)))
        x = torch.relu(F.conv2d(x, self.w2, self.shift.expand(8), padding=1))
        return self.fc(x.mean((2, 3)))


class PoolHead(nn.Module):
    """A head written for 224-pixel inputs (``AvgPool2d(7)``, ``ceil_mode``) on a 4x4 map."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2, 1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 16, 3, 2, 1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
        )
        self.pool = nn.AvgPool2d(7, ceil_mode=True)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


# --------------------------------------------------------------------------- transformers


class Logits(nn.Module):
    """A transformers model returning its logits tensor (``output`` in the ONNX model)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs).logits


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
    )
    return BertForSequenceClassification(config)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return Logits(GPT2LMHeadModel(config))


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )
    return Logits(LlamaForCausalLM(config))


def _gptneox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        rotary_pct=1.0,
        use_cache=False,
    )
    return Logits(GPTNeoXForCausalLM(config))


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=10,
    )
    return Logits(ViTForImageClassification(config))


# --------------------------------------------------------------------------- the zoo


@dataclass(frozen=True)
class Entry:
    """How to build one zoo model and its inputs."""

    build: Callable[[], nn.Module]
    tokens: bool  # token ids (else images)
    output: str = "output"  # the graph output's name: the model's own

    def inputs(self, seed: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        if self.tokens:
            return (torch.randint(0, VOCAB, (1, SEQ), generator=g),)
        return (torch.randn(IMAGE, generator=g),)


def _cnn(cls: type[nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = cls()
        with torch.no_grad():
            _trained_looking_batchnorm(model, seed=7)
        return model

    return build


ZOO: dict[str, Entry] = {
    "resnet": Entry(_cnn(ResNet), tokens=False),
    "mobilenetv3": Entry(_cnn(MobileNetV3), tokens=False),
    "bert": Entry(_bert, tokens=True, output="logits"),  # a SequenceClassifierOutput
    "gpt2": Entry(_gpt2, tokens=True),
    "llama": Entry(_llama, tokens=True),
    "vit": Entry(_vit, tokens=False),
    "gptneox": Entry(_gptneox, tokens=True),
    "convbias": Entry(_cnn(ConvBias), tokens=False),
    "poolhead": Entry(_cnn(PoolHead), tokens=False),
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The model (eval mode, seeded random weights) and one sample input."""
    entry = ZOO[name]
    torch.manual_seed(seed)
    return entry.build().eval(), entry.inputs(seed=100)


def calibration(name: str, batches: int = 4) -> list[tuple[torch.Tensor]]:
    """Calibration batches for ``name`` (the sample input first, then fresh ones)."""
    return [ZOO[name].inputs(seed=100 + i) for i in range(batches)]
