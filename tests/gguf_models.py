"""Tiny transformers decoders and a tiny tokenizer for the GGUF tests, built offline.

The decoders have random weights with their Q and K projections scaled up, so that attention
is sharp: with transformers' default initialisation every position attends almost evenly and
a wrong RoPE row order would go unnoticed in the logits. Quantized variants put a weight
quantizer on every linear layer, in the forms graphbuild's front end recognises: torch's
fake-quant per output channel, and FastForward's blocked tiles.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from examples.tiny_llama import LogitsOnly
from tests.foreign_quantizers import FFQuantizer

VOCAB = 320
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for a tiny model",
    "llama.cpp reads the file and runs the model on the prompt",
]
PROMPT = "the lazy fox runs over the tiny world"


def tokenizer(path: Path | None = None, vocab_size: int = VOCAB):
    """A byte-level BPE tokenizer trained on three sentences (BOS added by its template),
    saved to ``path`` when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", 0)]
    )
    if path is not None:
        tok.save(str(path))
    return tok


def decoder(kind: str = "llama", seed: int = 0, gain: float = 10.0, **overrides) -> nn.Module:
    """A 2-layer transformers Llama, Qwen2 or Qwen3 returning logits, Q/K weights ``gain``
    times larger than initialised (and Qwen2's Q/K/V biases drawn at random)."""
    import transformers

    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }
    config_cls, model_cls = (getattr(transformers, n) for n in classes[kind])
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=kind != "llama",
        attn_implementation="eager",
    )
    if kind == "qwen3":
        settings["head_dim"] = 32  # not hidden / heads: llama.cpp reads key_length
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LogitsOnly(model_cls(config_cls(**settings))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(gain)
            elif name.endswith("proj.bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def token_ids(text: str = PROMPT, rows: int = 1) -> torch.Tensor:
    ids = tokenizer().encode(text).ids
    return torch.tensor([ids] * rows, dtype=torch.int64)


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
