"""Fake-quantized model builders for the benchmarks.

:func:`fake_quantize` takes any float module and wraps every ``nn.Linear`` / ``nn.Conv2d`` so
that its weight goes through ``torch.fake_quantize_per_channel_affine`` (int8 symmetric on
[-127, 127], per output channel, ``scale = absmax / 127``) and its input through
``torch.fake_quantize_per_tensor_affine`` (uint8 on [0, 255], per tensor, scale and zero point
from the min/max seen in one calibration forward pass). Scales and zero points are BUFFERS of
the wrappers, so the model is "pre-quantized" the way ``tests.models.FakeQuantConvNet`` is and
graphbuild's ``qparams_from_model`` path reads them from the state.

Nothing else is quantized: in the decoders the attention-mask add (an elementwise add of a
constant ``-inf`` mask) keeps float operands.

The wrapped model shares its parameters with the float model it came from (modules are copied,
tensors are not), so a float baseline and the fake-quantized model cost one copy of the
weights; tied parameters (the decoder's embedding and output head) stay tied.

    from bench import models
    m = models.build("mid_decoder")      # BenchModel: float, fq, sample, info
    models.change_scales(m.fq)           # activation scale buffers x 1.01
    models.change_weights(m.fq)          # a few weights nudged, scale buffers kept
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from examples import convnet, tiny_decoder

__all__ = [
    "ACT_QMIN",
    "ACT_QMAX",
    "W_QMIN",
    "W_QMAX",
    "FakeQuantLinear",
    "FakeQuantConv2d",
    "fake_quantize",
    "change_scales",
    "change_weights",
    "activation_scale_buffers",
    "weight_bytes",
    "param_count",
    "BenchModel",
    "MODELS",
    "MID_DECODER",
    "TINY_DECODER",
    "build",
]

ACT_QMIN, ACT_QMAX = 0, 255  # uint8 activations, per tensor, asymmetric
W_QMIN, W_QMAX = -127, 127  # int8 weights, per output channel, symmetric


# --------------------------------------------------------------------------- wrappers


class _FakeQuantLayer(nn.Module):
    """A Linear or Conv2d (``inner``, kept as is: parameters and ties untouched) whose input
    and weight are fake-quantized with scale / zero-point buffers."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        w = inner.weight.detach()
        out_channels = w.shape[0]
        w_scale = w.abs().flatten(1).amax(1).float().clamp_min(1e-8) / float(W_QMAX)
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("w_zp", torch.zeros(out_channels, dtype=torch.int32))
        # placeholders until calibrate_inputs sets them from observed min/max
        self.register_buffer("in_scale", torch.ones(1))
        self.register_buffer("in_zp", torch.zeros(1, dtype=torch.int32))

    def quant_input(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fake_quantize_per_tensor_affine(
            x, self.in_scale, self.in_zp, ACT_QMIN, ACT_QMAX
        )

    def quant_weight(self) -> torch.Tensor:
        return torch.fake_quantize_per_channel_affine(
            self.inner.weight, self.w_scale, self.w_zp, 0, W_QMIN, W_QMAX
        )

    @torch.no_grad()
    def set_input_range(self, lo: float, hi: float) -> None:
        """uint8 asymmetric scale / zero point covering [lo, hi] (widened to include 0)."""
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        scale = max((hi - lo) / (ACT_QMAX - ACT_QMIN), 1e-8)
        zp = int(round(ACT_QMIN - lo / scale))
        zp = max(ACT_QMIN, min(ACT_QMAX, zp))
        self.in_scale.fill_(scale)
        self.in_zp.fill_(zp)


class FakeQuantLinear(_FakeQuantLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.quant_input(x), self.quant_weight(), self.inner.bias)


class FakeQuantConv2d(_FakeQuantLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.inner
        if c.padding_mode != "zeros":
            raise NotImplementedError("FakeQuantConv2d supports padding_mode='zeros' only")
        return F.conv2d(
            self.quant_input(x),
            self.quant_weight(),
            c.bias,
            c.stride,
            c.padding,
            c.dilation,
            c.groups,
        )


def _wrap(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.Linear):
        return FakeQuantLinear(module)
    if isinstance(module, nn.Conv2d):
        return FakeQuantConv2d(module)
    return module


def _replace_children(module: nn.Module) -> None:
    for name, child in list(module.named_children()):
        wrapped = _wrap(child)
        if wrapped is not child:
            setattr(module, name, wrapped)
        else:
            _replace_children(child)


def _shallow_module_copy(model: nn.Module) -> nn.Module:
    """A deep copy of the module tree sharing every parameter and buffer with ``model``."""
    memo: dict[int, Any] = {id(t): t for _, t in model.named_parameters(remove_duplicate=False)}
    memo.update({id(t): t for _, t in model.named_buffers(remove_duplicate=False)})
    return copy.deepcopy(model, memo)


def fake_quantize(
    model: nn.Module, calibration: Sequence[Any], *, share_weights: bool = True
) -> nn.Module:
    """Return ``model`` with every Linear / Conv2d wrapped in a fake-quant layer.

    ``calibration``: positional inputs of ONE forward pass (a tuple, or a list of tuples whose
    first element is used); the per-tensor input ranges come from its min / max. With
    ``share_weights`` the returned module shares parameters with ``model`` (which stays a
    float model); otherwise ``model`` itself is rewritten in place.
    """
    fq = _shallow_module_copy(model) if share_weights else model
    if isinstance(fq, (nn.Linear, nn.Conv2d)):
        raise ValueError("wrap a model that contains the layer, not the layer itself")
    _replace_children(fq)
    calibrate_inputs(fq, calibration)
    return fq.eval()


@torch.no_grad()
def calibrate_inputs(fq: nn.Module, calibration: Sequence[Any]) -> None:
    """One forward pass with min/max observers on every fake-quant layer's input (the pass
    itself runs the float layers, so the ranges are those of the float model)."""
    batch = calibration
    if isinstance(batch, list):
        batch = batch[0]
    if not isinstance(batch, tuple):
        batch = (batch,)
    layers = [m for m in fq.modules() if isinstance(m, _FakeQuantLayer)]
    ranges: dict[int, list[float]] = {}
    originals: dict[int, Callable] = {}

    def observe(layer: _FakeQuantLayer) -> Callable:
        inner_forward = layer.inner.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            lo, hi = float(x.min()), float(x.max())
            r = ranges.setdefault(id(layer), [lo, hi])
            r[0], r[1] = min(r[0], lo), max(r[1], hi)
            return inner_forward(x)

        return forward

    for layer in layers:  # float pass: the wrapper forwards straight to the inner layer
        originals[id(layer)] = layer.forward
        layer.forward = observe(layer)  # type: ignore[method-assign]
    try:
        fq(*batch)
    finally:
        for layer in layers:
            del layer.forward  # back to the class's forward
    missing = [
        n for n, m in fq.named_modules() if isinstance(m, _FakeQuantLayer) and id(m) not in ranges
    ]
    if missing:
        raise RuntimeError(f"calibration pass did not reach: {', '.join(missing)}")
    for layer in layers:
        layer.set_input_range(*ranges[id(layer)])


# --------------------------------------------------------------------------- changes


def activation_scale_buffers(fq: nn.Module) -> list[torch.Tensor]:
    return [m.in_scale for m in fq.modules() if isinstance(m, _FakeQuantLayer)]


@torch.no_grad()
def change_scales(fq: nn.Module, factor: float = 1.01) -> int:
    """Multiply every activation scale buffer by ``factor``; weights untouched. Returns the
    number of buffers changed."""
    bufs = activation_scale_buffers(fq)
    for b in bufs:
        b.mul_(factor)
    return len(bufs)


@torch.no_grad()
def change_weights(fq: nn.Module, every: int = 3, eps: float = 1e-3) -> int:
    """Nudge a few weights of every ``every``-th fake-quant layer (the first output channel
    moves towards zero by ``eps`` of its absmax, so the per-channel scale buffers, kept as
    they are, still cover it). Returns the number of layers changed."""
    layers = [m for m in fq.modules() if isinstance(m, _FakeQuantLayer)]
    changed = 0
    for i, layer in enumerate(layers):
        if i % every:
            continue
        row = layer.inner.weight[0]
        row.mul_(1.0 - eps)
        changed += 1
    return changed


# --------------------------------------------------------------------------- sizes


def _unique(tensors: Any) -> dict[int, torch.Tensor]:
    return {t.data_ptr(): t for t in tensors}


def weight_bytes(model: nn.Module, *, buffers: bool = True) -> int:
    """Bytes of the distinct parameters (and buffers): tied tensors counted once."""
    tensors = [t for _, t in model.named_parameters(remove_duplicate=False)]
    if buffers:
        tensors += [t for _, t in model.named_buffers(remove_duplicate=False)]
    return sum(t.numel() * t.element_size() for t in _unique(tensors).values())


def param_count(model: nn.Module) -> int:
    tensors = [t for _, t in model.named_parameters(remove_duplicate=False)]
    return sum(t.numel() for t in _unique(tensors).values())


# --------------------------------------------------------------------------- the models

TINY_DECODER = dict(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, seq=8)
MID_DECODER = dict(
    vocab=32000, hidden=1024, layers=12, heads=16, kv_heads=4, ffn=2816, seq=32
)  # ~168M parameters (tied embedding counted once), ~0.67 GB of fp32
LARGE_DECODER = dict(
    vocab=32000, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=5632, seq=32
)  # ~787M parameters, 3.1 GB of fp32: needs about 32 GiB of memory for the whole bench


LLAMA = dict(
    vocab=32000, hidden=256, layers=4, heads=8, kv_heads=2, ffn=688, seq=32
)  # transformers' LlamaForCausalLM, grouped-query attention (issue 20's retune model)


@dataclass
class BenchModel:
    name: str
    float: nn.Module
    fq: nn.Module
    sample: tuple
    info: dict[str, Any] = field(default_factory=dict)
    #: calibration batches for a preset export (``calibration(seed)``: another set per seed)
    calibration: Callable[[int], list] | None = None


CALIBRATION_BATCHES = 4  # per preset calibration set


def _decoder(name: str, cfg: dict, seed: int = 0) -> BenchModel:
    model, sample = tiny_decoder.build(seed, **cfg)
    calib = tiny_decoder.calibration(1, seed + 1, vocab=cfg["vocab"], seq=cfg["seq"])

    def calibration(k: int) -> list:
        return tiny_decoder.calibration(
            CALIBRATION_BATCHES, 100 + k, vocab=cfg["vocab"], seq=cfg["seq"]
        )

    return _finish(name, model, sample, calib, cfg, calibration)


def _llama(seed: int = 0) -> BenchModel:
    """transformers' LlamaForCausalLM (random weights, nothing downloaded), logits only."""
    from examples import tiny_llama

    cfg = LLAMA
    overrides = dict(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        intermediate_size=cfg["ffn"],
        max_position_embeddings=2 * cfg["seq"],
        attn_implementation="sdpa",
    )
    model, _ = tiny_llama.build(seed, **overrides)
    g = torch.Generator().manual_seed(seed + 1)
    sample = (torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=g),)

    def calibration(k: int) -> list:
        gen = torch.Generator().manual_seed(100 + k)
        shape = (1, cfg["seq"])
        return [
            (torch.randint(0, cfg["vocab"], shape, generator=gen),)
            for _ in range(CALIBRATION_BATCHES)
        ]

    return _finish("llama", model, sample, [sample], cfg, calibration)


def _convnet(seed: int = 0) -> BenchModel:
    model, sample = convnet.build(seed)

    def calibration(k: int) -> list:
        return convnet.calibration(CALIBRATION_BATCHES, 100 + k)

    return _finish("convnet", model, sample, convnet.calibration(1, seed + 1), {}, calibration)


def _finish(
    name: str,
    model: nn.Module,
    sample: tuple,
    calib: list,
    cfg: dict,
    calibration: Callable[[int], list] | None = None,
) -> BenchModel:
    fq = fake_quantize(model, calib)
    info = {
        "params": param_count(model),
        "fp32_weight_bytes": weight_bytes(model),
        "fake_quant_layers": sum(isinstance(m, _FakeQuantLayer) for m in fq.modules()),
        "config": cfg,
    }
    return BenchModel(name, model, fq, sample, info, calibration)


MODELS: dict[str, Callable[[], BenchModel]] = {
    "convnet": _convnet,
    "tiny_decoder": lambda: _decoder("tiny_decoder", TINY_DECODER),
    "llama": _llama,
    "mid_decoder": lambda: _decoder("mid_decoder", MID_DECODER),
    "large_decoder": lambda: _decoder("large_decoder", LARGE_DECODER),
}


def build(name: str) -> BenchModel:
    """One of :data:`MODELS`: the float model, its fake-quantized twin (shared weights), a
    sample input and sizes."""
    try:
        return MODELS[name]()
    except KeyError:
        raise KeyError(f"unknown bench model {name!r}; known: {', '.join(MODELS)}") from None
